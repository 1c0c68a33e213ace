//! Metrics of a run, one JSON object per line in `metrics.jsonl`.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, write_err};

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Optimizer steps completed.
    pub step: u64,
    /// Learning rate of the last step.
    pub lr: f64,
    /// Mean training loss of the steps since the previous record, or the evaluated train loss.
    pub train_loss: f64,
    /// Validation loss, on evaluation lines.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Global gradient norm before clipping, on logging lines.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Training tokens per second since the previous record.
    pub tokens_per_sec: f64,
    /// Seconds of training so far.
    pub elapsed_secs: f64,
    /// `"log"` for progress lines, `"eval"` for evaluations.
    pub kind: String,
}

/// Appends records to a run's `metrics.jsonl`.
pub struct Metrics {
    path: PathBuf,
}

impl Metrics {
    /// Opens `run_dir/metrics.jsonl`. When resuming at `resume_step`, lines from after that step
    /// (written by the interrupted run past its last checkpoint) are dropped.
    pub fn open(run_dir: &Path, resume_step: Option<u64>) -> Result<Self> {
        let path = run_dir.join("metrics.jsonl");
        match resume_step {
            Some(step) => {
                let kept: Vec<Record> =
                    read(&path).into_iter().filter(|r| r.step <= step).collect();
                let text: String = kept
                    .iter()
                    .map(|r| serde_json::to_string(r).expect("record serializes") + "\n")
                    .collect();
                // Replaced by rename, so a crash here leaves the old file whole.
                let tmp = run_dir.join(".metrics.jsonl.tmp");
                fs::write(&tmp, text).map_err(|e| write_err(&tmp, e))?;
                fs::rename(&tmp, &path).map_err(|e| write_err(&path, e))?;
            }
            None => fs::write(&path, "").map_err(|e| write_err(&path, e))?,
        }
        Ok(Self { path })
    }

    /// Appends one record.
    pub fn append(&self, record: &Record) -> Result<()> {
        let mut file = OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.path)
            .map_err(|e| write_err(&self.path, e))?;
        let line = serde_json::to_string(record).expect("record serializes");
        writeln!(file, "{line}").map_err(|e| write_err(&self.path, e))
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads every well-formed record of a metrics file (a torn last line is skipped).
pub fn read(path: &Path) -> Vec<Record> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}
