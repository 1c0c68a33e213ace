//! # ember-train
//!
//! One training loop for every ember task, with AdamW, warmup + cosine (or inverse square
//! root) schedules, gradient accumulation, global-norm clipping, periodic evaluation, metrics
//! (`metrics.jsonl`), a loss plot (`loss.png`), and atomic checkpoints that a run resumes from;
//! data-parallel over the devices of one process ([`parallel`]) or over processes started by a
//! launcher ([`distributed`]: NCCL with `nccl`, MPI with `mpi`).

pub mod adamw;
pub mod average;
pub mod checkpoint;
pub mod config;
pub mod conversation;
pub mod device;
pub mod distributed;
pub mod error;
pub mod eval;
pub mod hf;
pub mod init_from;
pub mod kernel_profile;
pub mod lm;
pub mod lm_source;
pub mod memory;
pub mod metrics;
pub mod optimizer;
pub mod parallel;
pub mod plot;
pub mod precision;
pub mod run_folder;
pub mod schedule;
pub mod task;
pub mod trainer;
pub mod translation;
pub mod translation_config;

pub use config::RunConfig;
pub use error::{Result, TrainError};
pub use lm::train_lm;
pub use lm_source::{LmSource, LoadedLm, load_lm, open_lm};
pub use precision::Precision;
pub use task::{Split, Task};
pub use trainer::{DeviceMemory, Launch, RunOptions, RunSummary};
pub use translation::{LoadedTranslator, load_translator, train_translation};
pub use translation_config::TranslationRunConfig;
