//! What stops a run cleanly or keeps its best: losses and weights read back and checked finite,
//! the output folder checked writable, the best checkpoint's bookkeeping.

use super::progress::say;
use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use indicatif::ProgressBar;

use crate::checkpoint::{self};
use crate::error::{Result, TrainError};
use crate::metrics::Metrics;

/// The best validation loss so far with its step, and how many evaluations since have not
/// beaten it.
#[derive(Default)]
pub(super) struct Best {
    best: Option<(f64, u64)>,
    evals_since: u64,
}

impl Best {
    /// A fresh run starts with none; a resumed run takes the loss from its `best` checkpoint and
    /// counts the evaluations after it in the metrics kept up to the resumed step.
    pub(super) fn open(out: &Path, metrics: &Metrics, resume: bool) -> Self {
        let best = resume.then(|| checkpoint::best_val_loss(out)).flatten();
        let evals_since = match best {
            Some((_, best_step)) => crate::metrics::read(metrics.path())
                .iter()
                .filter(|r| r.kind == "eval" && r.step > best_step)
                .count() as u64,
            None => 0,
        };
        Self { best, evals_since }
    }

    /// Counts an evaluation; whether it beat the best.
    pub(super) fn record(&mut self, val: f64, step: u64) -> bool {
        let improved = self.best.is_none_or(|(b, _)| val < b);
        if improved {
            self.best = Some((val, step));
            self.evals_since = 0;
        } else {
            self.evals_since += 1;
        }
        improved
    }

    /// Whether `patience` evaluations have gone by without improvement (and says so).
    pub(super) fn patience_spent(&self, patience: Option<u64>, bar: &ProgressBar) -> bool {
        let Some(patience) = patience else {
            return false;
        };
        let Some((b, at)) = self.best.filter(|_| self.evals_since >= patience) else {
            return false;
        };
        say(
            bar,
            format!(
                "early stop: val loss has not improved on {b:.4} (step {at}) in {patience} evaluations"
            ),
        );
        true
    }

    pub(super) fn loss(&self) -> Option<f64> {
        self.best.map(|(loss, _)| loss)
    }
}

/// The values of `values`, one read from the device; a failed read (the kernels that were to
/// compute them did not run) is an error naming `what`, never an empty or zero result.
pub(super) fn read_all(values: Vec<Tensor<1>>, what: &str) -> Result<Vec<f32>> {
    if values.is_empty() {
        return Ok(Vec::new());
    }
    Tensor::cat(values, 0)
        .try_into_vec_as::<f32>()
        .map_err(|e| crate::error::device_read_err(what, &e))
}

/// Sum of |w| over all parameters, to catch a NaN/inf before it is saved.
pub(super) struct Finite(Vec<Tensor<1>>);

impl ModuleVisitor for Finite {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.push(param.val().abs().sum());
    }
}

pub(super) fn ensure_finite<M: Module>(model: &M, step: u64) -> Result<()> {
    let mut finite = Finite(Vec::new());
    model.visit(&mut finite);
    let what = format!("the weights of step {step} (before saving them)");
    let total: f32 = read_all(finite.0, &what)?.iter().sum();
    if total.is_finite() {
        Ok(())
    } else {
        Err(TrainError::Diverged { step, loss: total })
    }
}

/// Fails early, before any training, if the run folder cannot be written.
pub(super) fn check_writable(dir: &Path) -> Result<()> {
    let probe = dir.join(format!(".write-test-{}", std::process::id()));
    std::fs::write(&probe, b"ok").map_err(|e| crate::error::write_err(dir, e))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}
