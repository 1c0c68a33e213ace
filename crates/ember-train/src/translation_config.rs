//! The TOML config of a translation run: `task = "translation"`, then `[model]` (an
//! [`EncoderDecoderConfig`]), `[data]` (a parallel corpus) and `[training]`.

use std::path::{Path, PathBuf};

use ember_model::EncoderDecoderConfig;
use serde::{Deserialize, Serialize};

use crate::config::{Override, TrainingConfig, blame, parse_with};
use crate::error::{Result, value_err};

/// A translation run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TranslationRunConfig {
    /// Always `"translation"`.
    pub task: String,
    /// The model; vocabulary sizes come from the tokenizers.
    pub model: EncoderDecoderConfig,
    /// The parallel corpus and its tokenizers.
    pub data: TranslationData,
    /// Optimisation, evaluation and checkpointing (`batch_size` is unused: see
    /// `data.batch_tokens`).
    pub training: TrainingConfig,
}

impl Default for TranslationRunConfig {
    fn default() -> Self {
        Self {
            task: "translation".into(),
            model: EncoderDecoderConfig::default(),
            data: TranslationData::default(),
            training: TrainingConfig {
                schedule: crate::schedule::ScheduleKind::InverseSqrt,
                lr: 5e-4,
                min_lr: 0.0,
                warmup_steps: 1000,
                beta2: 0.98,
                weight_decay: 0.0,
                label_smoothing: 0.1,
                ..TrainingConfig::default()
            },
        }
    }
}

/// The `[data]` section of a translation run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TranslationData {
    /// Training sources, one sentence per line. Default `data/multi30k/train.de`.
    pub train_src: PathBuf,
    /// Training targets, line-aligned with `train_src`. Default `data/multi30k/train.en`.
    pub train_tgt: PathBuf,
    /// Validation sources. Default `data/multi30k/val.de`.
    pub val_src: PathBuf,
    /// Validation targets. Default `data/multi30k/val.en`.
    pub val_tgt: PathBuf,
    /// One BPE vocabulary for both languages (default) or one each.
    pub shared_vocab: bool,
    /// BPE vocabulary size (per language when not shared). Default 8000.
    pub vocab_size: usize,
    /// Pairs longer than this many tokens on either side are dropped. Default 100.
    pub max_len: usize,
    /// Use only the first N training pairs (for quick runs). Default: all.
    pub max_train_pairs: Option<usize>,
    /// Padded tokens per batch (batches group sentences of similar length). Default 4096.
    pub batch_tokens: usize,
    /// Validation sentences translated (greedy) for BLEU at each evaluation; 0 turns it off.
    /// Default 200.
    pub bleu_sentences: usize,
}

impl Default for TranslationData {
    fn default() -> Self {
        let p = |name: &str| PathBuf::from("data/multi30k").join(name);
        Self {
            train_src: p("train.de"),
            train_tgt: p("train.en"),
            val_src: p("val.de"),
            val_tgt: p("val.en"),
            shared_vocab: true,
            vocab_size: 8000,
            max_len: 100,
            max_train_pairs: None,
            batch_tokens: 4096,
            bleu_sentences: 200,
        }
    }
}

impl TranslationRunConfig {
    /// Reads and validates a config file.
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

    /// Checks all sections (vocabulary sizes may still be 0: they come from the tokenizers).
    pub fn validate(&self) -> Result<()> {
        if self.task != "translation" {
            return Err(value_err(
                "task",
                format!("must be \"translation\" here, got {:?}", self.task),
            ));
        }
        let mut model = self.model.clone();
        model.src_vocab_size = model.src_vocab_size.max(1);
        model.tgt_vocab_size = model.tgt_vocab_size.max(1);
        if model.shared_embeddings {
            model.tgt_vocab_size = model.src_vocab_size;
        }
        model.validate()?;
        if self.model.shared_embeddings && !self.data.shared_vocab {
            return Err(value_err(
                "model.shared_embeddings",
                "needs data.shared_vocab = true",
            ));
        }
        if self.data.vocab_size < 261 {
            return Err(value_err(
                "data.vocab_size",
                format!(
                    "must be at least 261 (256 bytes + 4 special tokens + merges), got {}",
                    self.data.vocab_size
                ),
            ));
        }
        for (key, v) in [
            ("data.max_len", self.data.max_len),
            ("data.batch_tokens", self.data.batch_tokens),
        ] {
            if v < 2 {
                return Err(value_err(key, format!("must be at least 2, got {v}")));
            }
        }
        if self.data.max_train_pairs == Some(0) {
            return Err(value_err(
                "data.max_train_pairs",
                "must be at least 1 (leave it out for every pair), got 0",
            ));
        }
        if self.data.max_len > self.model.max_positions {
            return Err(value_err(
                "data.max_len",
                format!(
                    "= {} exceeds model.max_positions = {}",
                    self.data.max_len, self.model.max_positions
                ),
            ));
        }
        if self.data.batch_tokens < self.data.max_len {
            return Err(value_err(
                "data.batch_tokens",
                format!(
                    "= {} cannot hold one sentence of data.max_len = {}",
                    self.data.batch_tokens, self.data.max_len
                ),
            ));
        }
        self.training.validate()
    }

    /// The config as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("the config always serializes")
    }
}
