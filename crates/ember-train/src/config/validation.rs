//! The checks of every value of `[data]` and `[training]`: each error names `<section>.<key>`
//! and the value.

use super::schema::{DataConfig, TokenizerKind, TrainingConfig};
use crate::error::{Result, value_err};
use crate::schedule::Schedule;

impl TrainingConfig {
    /// The devices a run uses: `override_name` (`--device`) if given, else `device`; the first
    /// holds the model.
    pub fn devices(&self, override_name: Option<&str>) -> Result<Vec<burn::tensor::Device>> {
        crate::device::parse_list(override_name.unwrap_or(&self.device))
    }

    /// The learning-rate schedule these settings describe.
    pub fn schedule(&self) -> Schedule {
        Schedule {
            kind: self.schedule,
            lr: self.lr,
            min_lr: self.min_lr,
            warmup_steps: self.warmup_steps,
            decay_steps: self.decay_steps.unwrap_or(self.max_steps),
        }
    }

    /// Checks every value; the error names `training.<key>` and the value.
    pub fn validate(&self) -> Result<()> {
        let positive_int = |key: &str, v: u64| {
            if v == 0 {
                Err(value_err(
                    &format!("training.{key}"),
                    "must be at least 1, got 0",
                ))
            } else {
                Ok(())
            }
        };
        positive_int("batch_size", self.batch_size as u64)?;
        positive_int("grad_accum", self.grad_accum as u64)?;
        positive_int("max_steps", self.max_steps)?;
        positive_int("eval_interval", self.eval_interval)?;
        positive_int("eval_batches", self.eval_batches as u64)?;
        positive_int("checkpoint_interval", self.checkpoint_interval)?;
        positive_int("keep_checkpoints", self.keep_checkpoints as u64)?;
        positive_int("log_interval", self.log_interval)?;
        if let Some(patience) = self.early_stop_patience {
            positive_int("early_stop_patience", patience)?;
        }
        let positive_float = |key: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(value_err(
                    &format!("training.{key}"),
                    format!("must be a positive number, got {v}"),
                ))
            }
        };
        positive_float("lr", self.lr)?;
        positive_float("eps", self.eps)?;
        let non_negative = |key: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(value_err(
                    &format!("training.{key}"),
                    format!("must be zero or positive, got {v}"),
                ))
            }
        };
        non_negative("min_lr", self.min_lr)?;
        non_negative("weight_decay", self.weight_decay)?;
        non_negative("grad_clip", self.grad_clip)?;
        if !(0.0..1.0).contains(&self.label_smoothing) {
            return Err(value_err(
                "training.label_smoothing",
                format!("must be in [0, 1), got {}", self.label_smoothing),
            ));
        }
        for (key, v) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(value_err(
                    &format!("training.{key}"),
                    format!("must be in [0, 1), got {v}"),
                ));
            }
        }
        if self.min_lr > self.lr {
            return Err(value_err(
                "training.min_lr",
                format!("= {} is above training.lr = {}", self.min_lr, self.lr),
            ));
        }
        let devices = crate::device::check_list(&self.device)?;
        if !self.grad_accum.is_multiple_of(devices) {
            return Err(value_err(
                "training.grad_accum",
                format!(
                    "= {} is not a multiple of the {devices} devices in training.device = \"{}\" \
                     (each device takes whole micro-batches)",
                    self.grad_accum, self.device
                ),
            ));
        }
        Ok(())
    }
}

impl DataConfig {
    /// Checks every value; the error names `data.<key>` and the value.
    pub fn validate(&self) -> Result<()> {
        if !(self.train_fraction > 0.0 && self.train_fraction < 1.0) {
            return Err(value_err(
                "data.train_fraction",
                format!(
                    "must be between 0 and 1 (exclusive), got {}",
                    self.train_fraction
                ),
            ));
        }
        if self.tokenizer == TokenizerKind::Bpe
            && self.tokenizer_file.is_none()
            && self.bpe_vocab_size < 257
        {
            return Err(value_err(
                "data.bpe_vocab_size",
                format!(
                    "must be at least 257 (256 bytes + merges), got {}",
                    self.bpe_vocab_size
                ),
            ));
        }
        Ok(())
    }
}

/// Checks that the file or folder `path`, the value of config key `key`, exists: where it does
/// not, the error names the key, and for a relative path the folder it was looked for in (a
/// config's paths are read from the current folder, not the config file's, as nanoGPT's are).
pub(crate) fn must_exist(key: &str, path: &std::path::Path) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    let from = match std::env::current_dir() {
        Ok(cwd) if path.is_relative() => format!(
            " in the current folder {} (a config's relative paths are read from the folder \
             ember runs in)",
            cwd.display()
        ),
        _ => String::new(),
    };
    Err(value_err(
        key,
        format!("= {}: no such file or folder{from}", path.display()),
    ))
}
