//! The run's progress: the bar, one line per log interval off a terminal, the clock behind its
//! tokens/s, and the loss plot.

use super::guards::read_all;
use super::summary::{RunSummary, TimeSpent};
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::Tensor;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::checkpoint::CheckpointState;
use crate::error::{Result, TrainError};
use crate::metrics::{Metrics, Record};

/// A log record on the progress bar, or as a plain line off a terminal (a pipe, a file, nohup).
pub(super) fn log_line(bar: &ProgressBar, record: &Record, max_steps: u64) {
    bar.set_position(record.step);
    bar.set_message(format!(
        "loss {:.4} | {:.0} tok/s | lr {:.2e}",
        record.train_loss, record.tokens_per_sec, record.lr
    ));
    if bar.is_hidden() {
        eprintln!(
            "step {:>6}/{max_steps}: loss {:.4}, lr {:.2e}, {:.0} tok/s, {:.1} s",
            record.step, record.train_loss, record.lr, record.tokens_per_sec, record.elapsed_secs
        );
    }
}

/// The time and tokens of this process's part of a run.
pub(super) struct Clock {
    start: Instant,
    start_step: u64,
    /// Training seconds of earlier segments of a resumed run.
    before: f64,
    pub(super) tokens: u64,
    /// This process's evaluations and their time.
    pub(super) evaluations: TimeSpent,
    /// This process's checkpoint saves and their time.
    pub(super) checkpoints: TimeSpent,
}

impl Clock {
    pub(super) fn new(state: &CheckpointState) -> Self {
        Self {
            start: Instant::now(),
            start_step: state.step,
            before: state.elapsed_secs,
            tokens: 0,
            evaluations: TimeSpent::default(),
            checkpoints: TimeSpent::default(),
        }
    }

    /// Training seconds, earlier segments included.
    pub(super) fn elapsed(&self) -> f64 {
        self.before + self.start.elapsed().as_secs_f64()
    }

    pub(super) fn eval_record(&self, step: u64, lr: f64, train: f64, val: f64) -> Record {
        Record {
            step,
            lr,
            train_loss: train,
            val_loss: Some(val),
            grad_norm: None,
            tokens_per_sec: self.tokens as f64 / self.start.elapsed().as_secs_f64().max(1e-9),
            elapsed_secs: self.elapsed(),
            kind: "eval".into(),
        }
    }

    /// The summary's timings at `step`; the losses are the caller's to fill in.
    pub(super) fn summary(&self, step: u64, checkpoint: PathBuf) -> RunSummary {
        let run_secs = self.start.elapsed().as_secs_f64();
        let steps = (step - self.start_step).max(1) as f64;
        RunSummary {
            step,
            train_loss: None,
            val_loss: None,
            elapsed_secs: self.before + run_secs,
            tokens_per_sec: self.tokens as f64 / run_secs.max(1e-9),
            ms_per_step: 1000.0 * run_secs / steps,
            checkpoint,
            best: None,
            stopped_early: false,
            kernel_profile: None,
            device_memory: None,
            evaluations: self.evaluations,
            checkpoints: self.checkpoints,
        }
    }
}

/// Redraws `loss.png`: drawn beside it and renamed over it, so that a viewer watching the file
/// (or a run killed while drawing) never sees half a picture.
pub(super) fn draw_plot(metrics: &Metrics, title: &str, out: &Path) {
    let records = crate::metrics::read(metrics.path());
    // (The `.png` ending tells the drawing library the format.)
    let (tmp, plot) = (out.join(".loss.tmp.png"), out.join("loss.png"));
    let drawn = crate::plot::loss_curves(&records, title, &tmp)
        .and_then(|()| std::fs::rename(&tmp, &plot).map_err(|e| crate::error::write_err(&plot, e)));
    if let Err(e) = drawn {
        let _ = std::fs::remove_file(&tmp);
        eprintln!("warning: no loss plot: {e}");
    }
}

/// Losses and norms since the last log line, kept on the device until the log reads them all
/// at once (one synchronisation per log line, not per step).
pub(super) struct LogWindow {
    first_step: u64,
    losses: Vec<Tensor<1>>,
    norms: Vec<Tensor<1>>,
    tokens: usize,
    since: Instant,
}

impl LogWindow {
    pub(super) fn new(step: u64) -> Self {
        Self {
            first_step: step,
            losses: Vec::new(),
            norms: Vec::new(),
            tokens: 0,
            since: Instant::now(),
        }
    }

    pub(super) fn push(&mut self, loss: Tensor<1>, norm: Option<Tensor<1>>, tokens: usize) {
        self.losses.push(loss);
        self.norms.extend(norm);
        self.tokens += tokens;
    }

    /// Reads the window, fails on the first non-finite loss (naming its step), and resets.
    pub(super) fn flush(&mut self, step: u64, lr: f64, elapsed: f64) -> Result<Record> {
        let steps = match self.first_step + 1 {
            first if first == step => format!("the training loss of step {step}"),
            first => format!("the training loss of steps {first}-{step}"),
        };
        let losses = read_all(std::mem::take(&mut self.losses), &steps)?;
        let norms = read_all(std::mem::take(&mut self.norms), &steps)?;
        if let Some(i) = losses.iter().position(|l| !l.is_finite()) {
            return Err(TrainError::Diverged {
                step: self.first_step + i as u64 + 1,
                loss: losses[i],
            });
        }
        let mean = |v: &[f32]| v.iter().map(|&x| x as f64).sum::<f64>() / v.len().max(1) as f64;
        let record = Record {
            step,
            lr,
            train_loss: mean(&losses),
            val_loss: None,
            grad_norm: (!norms.is_empty()).then(|| mean(&norms)),
            tokens_per_sec: self.tokens as f64 / self.since.elapsed().as_secs_f64().max(1e-9),
            elapsed_secs: elapsed,
            kind: "log".into(),
        };
        *self = Self::new(step);
        Ok(record)
    }
}

/// Prints a line above the progress bar, or plainly when there is no bar (not a terminal).
pub(super) fn say(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

pub(super) fn progress_bar(total: u64, position: u64, enabled: bool) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if !enabled {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template("{bar:30.cyan/blue} {pos}/{len} steps | {msg} | ETA {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_position(position);
    bar
}
