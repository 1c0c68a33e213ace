//! Where a language model comes from: an ember checkpoint (or run folder) or a Hugging Face
//! GPT-2 or GPT-NeoX folder. Opening reads the architecture and tokenizer; loading reads the
//! weights into a model built on any device (with autodiff, for fine-tuning).

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use ember_data::Tokenizer;
use ember_model::{DecoderOnly, DecoderOnlyConfig};

use crate::checkpoint::CONFIG_FILE;
use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use crate::hf;

/// A trained language model, ready for inference.
pub struct LoadedLm {
    /// The model, on the requested device, without autodiff.
    pub model: DecoderOnly,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// The config it was trained with (defaults but for `model` when imported).
    pub config: RunConfig,
    /// The checkpoint folder it came from.
    pub dir: PathBuf,
    /// The step it was saved at (0 when imported).
    pub step: u64,
}

impl LoadedLm {
    /// Writes the model as a Hugging Face GPT-2 or GPT-NeoX folder in `out` (see [`hf::export_hf`]).
    pub fn export_hf(&self, out: &Path) -> Result<PathBuf> {
        hf::export_hf(
            &self.model,
            &self.config.model,
            &self.tokenizer,
            &self.dir,
            out,
        )
    }
}

/// An opened model folder: everything but the weights.
pub struct LmSource {
    /// The run config (defaults but for `model` for a Hugging Face folder).
    pub config: RunConfig,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The checkpoint or Hugging Face folder.
    pub dir: PathBuf,
    /// The step it was saved at (0 when imported).
    pub step: u64,
    /// A Hugging Face folder's config (its weights in `model.safetensors`), read once when
    /// opened; `None` for an ember checkpoint.
    pub hf: Option<hf::HfConfig>,
}

/// Opens a checkpoint, a run folder (its newest checkpoint) or a Hugging Face GPT-2 or GPT-NeoX
/// folder.
pub fn open_lm(path: &Path) -> Result<LmSource> {
    hf::check_weights_format(path)?;
    let (dir, config, tokenizer, step, hf_config) = if hf::is_hf_folder(path) {
        if let Some(file) = hf::ember_files(path) {
            return Err(TrainError::Checkpoint {
                path: path.to_path_buf(),
                message: format!(
                    "holds both a Hugging Face model ({}, {}) and an ember run or checkpoint \
                     (`{file}`), so which one to load is unclear: move the Hugging Face files \
                     to a folder of their own",
                    hf::HF_CONFIG,
                    hf::HF_WEIGHTS
                ),
            });
        }
        let (hf_config, model, tokenizer) = hf::open_hf(path)?;
        let config = RunConfig {
            model,
            ..RunConfig::default()
        };
        (path.to_path_buf(), config, tokenizer, 0, Some(hf_config))
    } else {
        let (dir, state) = crate::checkpoint::open(path, "decoder_only", "a language model")?;
        let config = RunConfig::load(&dir.join(CONFIG_FILE))?;
        let tokenizer = Tokenizer::load(&dir)?;
        (dir, config, tokenizer, state.step, None)
    };
    if tokenizer.vocab_size() > config.model.vocab_size {
        return Err(TrainError::Checkpoint {
            path: dir,
            message: format!(
                "the tokenizer has {} tokens but the model only {}",
                tokenizer.vocab_size(),
                config.model.vocab_size
            ),
        });
    }
    Ok(LmSource {
        config,
        tokenizer,
        dir,
        step,
        hf: hf_config,
    })
}

impl LmSource {
    /// Builds `config` (this source's architecture, perhaps with another dropout or context) on
    /// `device` and reads the weights into it.
    pub fn load_model(&self, config: &DecoderOnlyConfig, device: &Device) -> Result<DecoderOnly> {
        let model = config.init(device)?;
        match &self.hf {
            Some(hf_config) => hf::load_weights(model, config, hf_config, &self.dir),
            None => crate::checkpoint::load_model(model, &self.dir),
        }
    }

    /// Loads the model as it was saved, for inference on `device`.
    pub fn load(self, device: &Device) -> Result<LoadedLm> {
        let model = self.load_model(&self.config.model, device)?;
        Ok(LoadedLm {
            model,
            tokenizer: self.tokenizer,
            config: self.config,
            dir: self.dir,
            step: self.step,
        })
    }
}

/// Loads a checkpoint (or the newest in a run folder, or a Hugging Face GPT-2 or GPT-NeoX
/// folder) for inference.
pub fn load_lm(path: &Path, device: &Device) -> Result<LoadedLm> {
    open_lm(path)?.load(device)
}
