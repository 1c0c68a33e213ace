//! `ember train --init-from DIR`: a run that starts from existing weights (an ember checkpoint
//! or a Hugging Face GPT-2 or GPT-NeoX folder), as nanoGPT fine-tunes GPT-2 on Shakespeare. The
//! architecture and the tokenizer come from DIR; of the config's `[model]` section only
//! `context_len` (the training window, at most DIR's positions) and `dropout` apply.

use std::path::{Path, PathBuf};

use ember_model::DecoderOnlyConfig;

use crate::config::parse_toml;
use crate::error::{Result, TrainError};

/// The `[model]` keys a run started from other weights may still set.
pub const ADJUSTABLE: [&str; 2] = ["context_len", "dropout"];

/// Where the weights come from, and what the config changes about the model.
#[derive(Debug, Clone, Default)]
pub struct InitFrom {
    /// An ember checkpoint or run folder, or a Hugging Face GPT-2 or GPT-NeoX folder.
    pub dir: PathBuf,
    /// The training window, if the config sets one.
    pub context_len: Option<usize>,
    /// Dropout, if the config sets it.
    pub dropout: Option<f64>,
}

impl InitFrom {
    /// Reads the `[model]` keys of `config_path`; any besides [`ADJUSTABLE`] is an error, since
    /// the architecture is DIR's.
    pub fn new(dir: &Path, config_path: &Path) -> Result<Self> {
        let table: toml::Table = parse_toml(config_path)?;
        let model = table.get("model").and_then(|m| m.as_table());
        let mut init = Self {
            dir: dir.to_path_buf(),
            ..Self::default()
        };
        for (key, value) in model.into_iter().flatten() {
            let bad = |message: String| TrainError::ConfigFile {
                path: config_path.to_path_buf(),
                message: format!("`model.{key}` {message}"),
            };
            match key.as_str() {
                "context_len" => {
                    let n = value.as_integer().filter(|&n| n > 0);
                    let n =
                        n.ok_or_else(|| bad(format!("must be a positive integer, got {value}")))?;
                    init.context_len = Some(n as usize);
                }
                "dropout" => {
                    let p = value.as_float().or(value.as_integer().map(|i| i as f64));
                    init.dropout =
                        Some(p.ok_or_else(|| bad(format!("must be a number, got {value}")))?);
                }
                _ => {
                    return Err(bad(format!(
                        "cannot be set with --init-from: the architecture comes from {} (only {} may be set)",
                        dir.display(),
                        ADJUSTABLE.join(" and ")
                    )));
                }
            }
        }
        Ok(init)
    }

    /// `source`'s architecture with this run's context and dropout.
    pub fn model_config(&self, source: &DecoderOnlyConfig) -> Result<DecoderOnlyConfig> {
        let mut config = source.clone();
        config.max_positions = Some(source.max_positions());
        if let Some(context) = self.context_len {
            config.context_len = context;
        }
        if let Some(dropout) = self.dropout {
            config.dropout = dropout;
        }
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn init(text: &str) -> Result<InitFrom> {
        let path = std::env::temp_dir().join(format!("ember-init-{}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let result = InitFrom::new(Path::new("gpt2"), &path);
        let _ = std::fs::remove_file(path);
        result
    }

    #[test]
    fn only_context_and_dropout_may_be_set() {
        let ok = init("[model]\ncontext_len = 32\ndropout = 0.1\n[training]\nlr = 1e-4\n").unwrap();
        assert_eq!((ok.context_len, ok.dropout), (Some(32), Some(0.1)));
        let source = DecoderOnlyConfig {
            vocab_size: 10,
            context_len: 64,
            ..Default::default()
        };
        let config = ok.model_config(&source).unwrap();
        assert_eq!((config.context_len, config.max_positions()), (32, 64));
        assert_eq!(config.dropout, 0.1);

        let err = init("[model]\nd_model = 64\n").unwrap_err().to_string();
        assert!(
            err.contains("model.d_model") && err.contains("--init-from"),
            "{err}"
        );
        let long = init("[model]\ncontext_len = 128\n").unwrap();
        let err = long.model_config(&source).unwrap_err().to_string();
        assert!(err.contains("context_len") && err.contains("64"), "{err}");
    }
}
