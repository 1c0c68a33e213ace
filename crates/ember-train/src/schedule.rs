//! Learning-rate schedules as pure functions of the step, so a resumed run continues the
//! schedule exactly with nothing to save.

use serde::{Deserialize, Serialize};

/// The shape of the learning-rate curve after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// Linear warmup to `lr`, then cosine decay to `min_lr` at `decay_steps` (nanoGPT).
    #[default]
    Cosine,
    /// Linear warmup, then `lr` for ever.
    Constant,
    /// Linear warmup, then `lr * sqrt(warmup / step)`: the transformer paper's schedule, with
    /// its peak scaled to `lr`.
    InverseSqrt,
}

/// A learning-rate schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    /// The curve.
    pub kind: ScheduleKind,
    /// Peak learning rate.
    pub lr: f64,
    /// Floor of the cosine decay.
    pub min_lr: f64,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Step at which the cosine reaches `min_lr`.
    pub decay_steps: u64,
}

impl Schedule {
    /// The learning rate for (0-based) `step`.
    pub fn at(&self, step: u64) -> f64 {
        let warmup = self.warmup_steps;
        if step < warmup {
            return self.lr * (step + 1) as f64 / (warmup + 1) as f64;
        }
        match self.kind {
            ScheduleKind::Constant => self.lr,
            ScheduleKind::InverseSqrt => {
                self.lr
                    * (warmup.max(1) as f64 / (step.max(1)) as f64)
                        .sqrt()
                        .min(1.0)
            }
            ScheduleKind::Cosine => {
                if step >= self.decay_steps {
                    return self.min_lr;
                }
                let span = (self.decay_steps - warmup).max(1) as f64;
                let ratio = (step - warmup) as f64 / span;
                let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
                self.min_lr + coeff * (self.lr - self.min_lr)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cosine() -> Schedule {
        Schedule {
            kind: ScheduleKind::Cosine,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 100,
            decay_steps: 2000,
        }
    }

    #[test]
    fn warmup_is_linear_then_cosine_reaches_min() {
        let s = cosine();
        assert!((s.at(0) - 1e-3 / 101.0).abs() < 1e-12);
        assert!((s.at(49) - 1e-3 * 50.0 / 101.0).abs() < 1e-12);
        assert!((s.at(100) - 1e-3).abs() < 1e-12);
        // Halfway through the decay the cosine is at the midpoint.
        assert!((s.at(1050) - 5.5e-4).abs() < 1e-9);
        assert!((s.at(2000) - 1e-4).abs() < 1e-12);
        assert!((s.at(5000) - 1e-4).abs() < 1e-12);
        for step in 100..1999 {
            assert!(s.at(step + 1) <= s.at(step));
        }
    }

    #[test]
    fn inverse_sqrt_peaks_at_warmup() {
        let s = Schedule {
            kind: ScheduleKind::InverseSqrt,
            warmup_steps: 400,
            ..cosine()
        };
        assert!((s.at(400) - 1e-3).abs() < 1e-12);
        assert!((s.at(1600) - 5e-4).abs() < 1e-12);
        assert!(s.at(399) < 1e-3);
    }
}
