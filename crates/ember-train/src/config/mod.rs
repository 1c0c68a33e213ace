//! The TOML run config: `[model]`, `[data]` and `[training]`. Every field is documented here,
//! has a default, and unknown keys are rejected.
//!
//! Layout: this file holds the whole config and how it is read; [`schema`] the `[data]` and
//! `[training]` sections with their defaults, [`validation`] the checks of every value,
//! [`overrides`] `--set KEY=VALUE`, [`loading`] reading TOML with errors that name the file,
//! line, key and value.

mod loading;
mod overrides;
mod schema;
#[cfg(test)]
mod tests;
mod validation;

pub(crate) use loading::{blame, in_file, parse_toml, parse_with};
pub use overrides::Override;
pub use schema::{DataConfig, TokenizerKind, TrainingConfig};
pub(crate) use validation::must_exist;

use loading::one_line;

use std::path::{Path, PathBuf};

use ember_model::DecoderOnlyConfig;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError, value_err};

/// A whole run: what to train, on what, and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// `"lm"` (the default) for language modelling; translation configs say `"translation"`.
    pub task: String,
    /// The model; see [`DecoderOnlyConfig`]. `vocab_size` is filled in from the tokenizer.
    pub model: DecoderOnlyConfig,
    /// The corpus and tokenizer.
    pub data: DataConfig,
    /// Optimisation, evaluation and checkpointing.
    pub training: TrainingConfig,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            task: "lm".into(),
            model: DecoderOnlyConfig::default(),
            data: DataConfig::default(),
            training: TrainingConfig::default(),
        }
    }
}

impl RunConfig {
    /// Reads and validates a config file. Errors name the file, and the line and key or the
    /// key and value at fault.
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_with(path, &[])
    }

    /// Reads a config file, applies command-line overrides (in order), and validates the
    /// result. Errors name the file or the override at fault.
    pub fn load_with(path: &Path, overrides: &[Override]) -> Result<Self> {
        let config: Self = parse_with(path, overrides)?;
        config.validate().map_err(|e| blame(path, overrides, e))?;
        Ok(config)
    }

    /// Parses and validates config text.
    pub fn parse(text: &str) -> Result<Self> {
        let config: RunConfig = toml::from_str(text).map_err(|e| TrainError::ConfigFile {
            path: PathBuf::from("<config>"),
            message: one_line(&e),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks all sections. The model's `vocab_size` may still be 0 (it comes from the data).
    pub fn validate(&self) -> Result<()> {
        if self.task != "lm" {
            return Err(value_err(
                "task",
                format!("must be \"lm\" here, got {:?}", self.task),
            ));
        }
        let mut model = self.model.clone();
        if model.vocab_size == 0 {
            model.vocab_size = 1;
        }
        model.validate()?;
        self.data.validate()?;
        self.training.validate()?;
        // A batch's ids are counted in one number (the memory check then says how large).
        let tokens = self
            .training
            .batch_size
            .checked_mul(self.model.context_len + 1);
        if tokens.is_none_or(|t| t as u64 > 1 << 32) {
            return Err(value_err(
                "training.batch_size",
                format!(
                    "= {} sequences of model.context_len = {} tokens is more than 2^32 tokens a batch",
                    self.training.batch_size, self.model.context_len
                ),
            ));
        }
        Ok(())
    }

    /// The config as TOML, as saved beside checkpoints.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("the config always serializes")
    }
}

/// The `task` a config file declares (`"lm"` when it has none), read before the whole file is
/// parsed so the right config type can be chosen.
pub fn task_of(path: &Path) -> Result<String> {
    let table: toml::Table = parse_toml(path)?;
    match table.get("task") {
        None => Ok("lm".into()),
        Some(toml::Value::String(task)) if task == "lm" || task == "translation" => {
            Ok(task.clone())
        }
        Some(other) => Err(in_file(
            path,
            value_err(
                "task",
                format!("must be \"lm\" or \"translation\", got {other}"),
            ),
        )),
    }
}

/// On resume: says, on one `note:` line, each `[model]` value the checkpoint in `dir` keeps
/// where the run's config (`config`) says otherwise; nothing where they agree.
pub(crate) fn note_kept_model<T: serde::Serialize>(dir: &Path, saved: &T, config: &T) {
    let changed = differences(saved, config);
    if !changed.is_empty() {
        eprintln!(
            "note: resuming the model saved in {}, which keeps {}: a resumed run continues the \
             saved model",
            dir.display(),
            changed.join(", ")
        );
    }
}

/// Each value where `saved` and `config` differ, as `model.KEY = SAVED (the config says
/// CONFIG)`, in the saved config's order.
fn differences<T: serde::Serialize>(saved: &T, config: &T) -> Vec<String> {
    let table = |c: &T| toml::Table::try_from(c).expect("a model config always serializes");
    let (saved, config) = (table(saved), table(config));
    let keys = saved
        .keys()
        .chain(config.keys().filter(|k| !saved.contains_key(*k)));
    keys.filter_map(|key| {
        let (a, b) = (saved.get(key), config.get(key));
        let show = |v: Option<&toml::Value>| v.map_or("unset".to_string(), |v| v.to_string());
        (a != b).then(|| format!("model.{key} = {} (the config says {})", show(a), show(b)))
    })
    .collect()
}
