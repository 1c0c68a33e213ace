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
    /// A checkpoint written beside the steps failed (a full disk): the run stopped.
    #[error(
        "the checkpoint of step {step} was not written, and training stopped: {cause}; {}",
        match newest {
            Some(dir) => format!("the newest checkpoint on disk is {} (--resume continues from it)", dir.display()),
            None => "no checkpoint of this run is on disk".to_string(),
        }
    )]
    SaveFailed {
        /// The step of the checkpoint.
        step: u64,
        /// Why it failed.
        cause: Box<TrainError>,
        /// The newest checkpoint on disk, if any.
        newest: Option<PathBuf>,
    },
    /// Training was asked to stop (Ctrl-C, SIGTERM) and saved a checkpoint first.
    #[error("interrupted at step {step}; saved {}", checkpoint.display())]
    Interrupted {
        /// Steps completed.
        step: u64,
        /// The checkpoint written at that step.
        checkpoint: PathBuf,
    },
    /// A run across processes could not start or go on: the launcher's environment, the
    /// rendezvous, the collective library, or another rank.
    #[error("{0}")]
    Distributed(String),
    /// The run cannot fit in the memory the machine has free (`crate::memory`).
    #[error("{0}")]
    Memory(String),
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

/// A read from the device failed: the kernels that were to compute the values did not run
/// (Burn reports the failure, e.g. an allocation the device refused, only when the values are
/// read). One line: what was being read, and the innermost cause of Burn's chain of errors.
pub(crate) fn device_read_err(what: &str, e: &(dyn std::error::Error + 'static)) -> TrainError {
    let mut root = e;
    while let Some(inner) = root.source() {
        root = inner;
    }
    // CubeCL's errors carry their own chain in the text: "...\nCaused by:\n  <cause>\n...";
    // the innermost is the line after the last "Caused by:".
    let text = root.to_string();
    let lines: Vec<&str> = text.lines().collect();
    let cause = match lines.iter().rposition(|l| l.trim() == "Caused by:") {
        Some(i) if i + 1 < lines.len() => lines[i + 1].trim(),
        _ => lines.first().map_or("", |l| l.trim()),
    };
    let hint = if cause.contains("allocate") {
        " (the device is out of memory: a smaller training.batch_size, with training.grad_accum \
         for the same batch, needs less)"
    } else {
        ""
    };
    TrainError::Device(format!(
        "the device failed while computing {what}: {cause}{hint}"
    ))
}

pub(crate) fn value_err(key: &str, message: impl Into<String>) -> TrainError {
    TrainError::ConfigValue {
        key: key.to_string(),
        message: message.into(),
    }
}

/// Writes `error: <message>` and a newline to stderr in one write: `eprintln!` writes each
/// piece of its format separately (stderr is unbuffered), and another process writing to the
/// same stderr (`mpirun`, the other ranks) can land between `error: ` and the message.
pub fn print_error_line(message: &str) {
    use std::io::Write;
    let line = format!("error: {message}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error whose text carries a chain, as CubeCL's do, behind one `source()` level.
    #[derive(Debug)]
    struct Outer(Inner);
    #[derive(Debug)]
    struct Inner(&'static str);
    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Error while reading data")
        }
    }
    impl std::fmt::Display for Inner {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
    impl std::error::Error for Inner {}

    #[test]
    fn a_failed_device_read_names_what_and_the_innermost_cause_on_one_line() {
        // The text of the failure seen on lavapipe when a training step did not fit.
        let chain = "An error happened during execution\nCaused by:\n  Several failures at \
                     once\nCaused by:\n  The bytes were never written (failure #177)\n  skipped \
                     `SliceAssignKernel`\nCaused by:\n  An IO error happened\nCaused by:\n  \
                     can't allocate buffer of size: 150994944\nNo backtrace available";
        let message = device_read_err("the training loss of step 2", &Outer(Inner(chain)));
        assert_eq!(
            message.to_string(),
            "the device failed while computing the training loss of step 2: can't allocate \
             buffer of size: 150994944 (the device is out of memory: a smaller \
             training.batch_size, with training.grad_accum for the same batch, needs less)"
        );
        // Without a chain in the text: the innermost error's first line, and no memory hint.
        let message = device_read_err("the weights", &Outer(Inner("lost device\nmore")));
        assert_eq!(
            message.to_string(),
            "the device failed while computing the weights: lost device"
        );
    }
}
