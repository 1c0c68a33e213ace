//! The one error type of the training crate.

use std::path::PathBuf;

/// Why a run could not start, continue, or save.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The config file is missing, not TOML, or has an unknown key or a value of the wrong type.
    #[error("{path}: {message}")]
    ConfigFile {
        /// The config file.
        path: PathBuf,
        /// The parser's message (it names the line and the key).
        message: String,
    },
    /// A config value is out of range.
    #[error("invalid config value: `{key}` {message}")]
    ConfigValue {
        /// `section.key`, e.g. `training.lr`.
        key: String,
        /// What is wrong, with the value.
        message: String,
    },
    /// The model section does not describe a valid model.
    #[error(transparent)]
    Model(#[from] ember_model::ConfigError),
    /// Reading the corpus or the tokenizer failed.
    #[error(transparent)]
    Data(#[from] ember_data::DataError),
    /// The device is unknown or missing from this build.
    #[error("{0}")]
    Device(String),
    /// A checkpoint is missing, incomplete, or from another model.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The checkpoint folder or file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Writing to the output folder failed.
    #[error("cannot write {path}: {message}")]
    Write {
        /// The file or folder.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// The run folder holds another run, or another process is training into it.
    #[error("run folder {path}: {message}")]
    RunFolder {
        /// The run folder.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// A `--set section.key=value` override is malformed or names a key the config lacks.
    #[error("--set {text}: {message}")]
    Override {
        /// The override as given.
        text: String,
        /// What is wrong.
        message: String,
    },
    /// Training was asked to stop (Ctrl-C, SIGTERM) and saved a checkpoint first.
    #[error("interrupted at step {step}; saved {}", checkpoint.display())]
    Interrupted {
        /// Steps completed.
        step: u64,
        /// The checkpoint written at that step.
        checkpoint: PathBuf,
    },
    /// The loss stopped being a finite number.
    #[error(
        "loss is {loss} at step {step}: training diverged; the last good checkpoint is kept (try a lower training.lr or gradient clipping)"
    )]
    Diverged {
        /// The step.
        step: u64,
        /// The loss value.
        loss: f32,
    },
}

/// Short for `Result<T, TrainError>`.
pub type Result<T> = std::result::Result<T, TrainError>;

pub(crate) fn write_err(path: &std::path::Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::Write {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

pub(crate) fn value_err(key: &str, message: impl Into<String>) -> TrainError {
    TrainError::ConfigValue {
        key: key.to_string(),
        message: message.into(),
    }
}
