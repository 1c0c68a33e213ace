//! The `[data]` and `[training]` sections: every field documented, with its default.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::precision::Precision;
use crate::schedule::ScheduleKind;

/// How text becomes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// One token per character of the corpus.
    #[default]
    Char,
    /// Byte-level BPE trained on the corpus (or loaded from `tokenizer_file`).
    Bpe,
}

/// The `[data]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// UTF-8 text file to train on (at most 64 MB), or a folder `ember prepare` wrote. Default
    /// `data/tinyshakespeare.txt`.
    pub path: PathBuf,
    /// `char` (default) or `bpe`.
    pub tokenizer: TokenizerKind,
    /// BPE vocabulary size when training one. Default 512.
    pub bpe_vocab_size: usize,
    /// A Hugging Face `tokenizer.json` to use instead of training a BPE.
    pub tokenizer_file: Option<PathBuf>,
    /// Fraction of the corpus used for training; the rest is validation. Default 0.9.
    pub train_fraction: f64,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            path: PathBuf::from("data/tinyshakespeare.txt"),
            tokenizer: TokenizerKind::Char,
            bpe_vocab_size: 512,
            tokenizer_file: None,
            train_fraction: 0.9,
        }
    }
}

/// The `[training]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingConfig {
    /// Compute device: `flex` (default), `ndarray`, `wgpu`, `vulkan`, `cuda[:N]` or `auto`; or
    /// several, comma-separated (`cuda:0,cuda:1`), for data-parallel training: the step's
    /// `grad_accum` micro-batches are spread over them, so `grad_accum` must be a multiple of
    /// their number.
    pub device: String,
    /// Seed of weights, batches and dropout. Default 1337.
    pub seed: u64,
    /// Sequences per micro-batch. Default 12.
    pub batch_size: usize,
    /// Micro-batches whose gradients are summed before each optimizer step. Default 1.
    pub grad_accum: usize,
    /// Optimizer steps. Default 2000.
    pub max_steps: u64,
    /// Peak learning rate. Default 1e-3.
    pub lr: f64,
    /// Final learning rate of the cosine schedule. Default 1e-4.
    pub min_lr: f64,
    /// Linear warmup steps. Default 100.
    pub warmup_steps: u64,
    /// Step where the cosine reaches `min_lr`. Default `max_steps`.
    pub decay_steps: Option<u64>,
    /// `cosine` (default), `constant` or `inverse_sqrt`.
    pub schedule: ScheduleKind,
    /// AdamW beta1. Default 0.9.
    pub beta1: f64,
    /// AdamW beta2. Default 0.99.
    pub beta2: f64,
    /// AdamW epsilon. Default 1e-8.
    pub eps: f64,
    /// Decoupled weight decay of weight matrices (not biases, norms). Default 0.1.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this; 0 turns clipping off. Default 1.0.
    pub grad_clip: f64,
    /// Label smoothing of the training loss (the transformer paper uses 0.1). Default 0.
    pub label_smoothing: f64,
    /// Evaluate every this many steps (and at the end). Default 250.
    pub eval_interval: u64,
    /// Batches averaged for each train/val loss estimate. Default 20.
    pub eval_batches: usize,
    /// Write a checkpoint every this many steps (and at the end). Default 500.
    pub checkpoint_interval: u64,
    /// Checkpoints kept on disk (the newest). Default 2.
    pub keep_checkpoints: usize,
    /// Update the progress line (or, off a terminal, print a log line) every this many
    /// steps. Default 10.
    pub log_interval: u64,
    /// Stop once this many evaluations in a row have not lowered the best validation loss
    /// (the best checkpoint is kept either way). Default: off.
    pub early_stop_patience: Option<u64>,
    /// Float type of the products: `f32` (default) or `bf16` (bf16 products with `f32`
    /// weights, optimizer state, norms, softmax and loss; for GPUs). See [`Precision`].
    pub precision: Precision,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            device: "flex".into(),
            seed: 1337,
            batch_size: 12,
            grad_accum: 1,
            max_steps: 2000,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 100,
            decay_steps: None,
            schedule: ScheduleKind::Cosine,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
            label_smoothing: 0.0,
            eval_interval: 250,
            eval_batches: 20,
            checkpoint_interval: 500,
            keep_checkpoints: 2,
            log_interval: 10,
            early_stop_patience: None,
            precision: Precision::F32,
        }
    }
}
