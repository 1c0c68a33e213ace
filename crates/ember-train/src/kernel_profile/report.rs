//! The profile a run prints: kernels by device time and launches per step, parts, idle time.

use std::fmt;
use std::time::Duration;

use super::Part;

/// One kernel's share of the profiled steps, in one part of them.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    /// The kernel's name, shortened to its function (`MatmulEntry`, `AttentionForward`).
    pub name: String,
    /// The part of the step that launched it.
    pub part: Part,
    /// Launches over all profiled steps.
    pub launches: u64,
    /// Device time over all profiled steps.
    pub total: Duration,
}

/// What [`KernelProfiler`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelProfile {
    /// Steps profiled.
    pub steps: u64,
    /// The first profiled step (1-based, as the log counts them).
    pub first_step: u64,
    /// Host wall time of the profiled steps, by [`Part`].
    pub walls: [Duration; 3],
    /// Per part of each step, from the first kernel's start to the last kernel's end on the
    /// device, summed.
    pub span: Duration,
    /// Kernels by total device time, longest first.
    pub kernels: Vec<KernelTime>,
    /// Launches the backend could not time (counted, not guessed).
    pub unmeasured: u64,
    /// How the kernels were timed: `device` (timestamps on the device) or `system` (host wall
    /// around a blocking submit, kernels one at a time: each time includes the submission).
    pub method: String,
}

impl KernelProfile {
    pub(super) fn new(first_step: u64) -> Self {
        Self {
            steps: 0,
            first_step,
            walls: [Duration::ZERO; 3],
            span: Duration::ZERO,
            kernels: Vec::new(),
            unmeasured: 0,
            method: String::new(),
        }
    }

    /// Host wall time of the profiled steps.
    pub fn wall(&self) -> Duration {
        self.walls.iter().sum()
    }

    /// Device time of every measured kernel (of `part`, or of all).
    pub fn busy(&self, part: Option<Part>) -> Duration {
        self.of(part).map(|k| k.total).sum()
    }

    /// Launches of every measured kernel (of `part`, or of all).
    pub fn launches(&self, part: Option<Part>) -> u64 {
        self.of(part).map(|k| k.launches).sum()
    }

    pub(super) fn of(&self, part: Option<Part>) -> impl Iterator<Item = &KernelTime> {
        self.kernels
            .iter()
            .filter(move |k| part.is_none_or(|p| k.part == p))
    }
}

/// How many kernels the table lists; the rest are summed in one line.
pub(super) const ROWS: usize = 25;

impl fmt::Display for KernelProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let steps = self.steps.max(1) as f64;
        let per_step = |d: Duration| 1000.0 * d.as_secs_f64() / steps;
        let busy = self.busy(None);
        let share = |d: Duration| 100.0 * d.as_secs_f64() / busy.as_secs_f64().max(1e-12);
        let last = self.first_step + self.steps - 1;
        writeln!(
            f,
            "kernel profile, steps {}-{last} ({} steps, device synchronised after each part, {} timing):",
            self.first_step, self.steps, self.method
        )?;
        writeln!(
            f,
            "  {:.2} ms/step wall; device busy {:.2} ms/step of a {:.2} ms/step span ({:.0}%), {:.0} kernel launches/step",
            per_step(self.wall()),
            per_step(busy),
            per_step(self.span),
            100.0 * busy.as_secs_f64() / self.span.as_secs_f64().max(1e-12),
            (self.launches(None) + self.unmeasured) as f64 / steps,
        )?;
        writeln!(
            f,
            "  {:<8} {:>8}  {:>8}  {:>9}",
            "part", "wall ms", "busy ms", "launches"
        )?;
        for part in Part::ALL {
            writeln!(
                f,
                "  {:<8} {:>8.2}  {:>8.2}  {:>9.1}",
                part.name(),
                per_step(self.walls[part.index()]),
                per_step(self.busy(Some(part))),
                self.launches(Some(part)) as f64 / steps,
            )?;
        }
        writeln!(
            f,
            "  {:>6}  {:>8}  {:>9}  {:>9}  {:<8} kernel",
            "share", "ms/step", "launches", "us/launch", "part"
        )?;
        for k in self.kernels.iter().take(ROWS) {
            writeln!(
                f,
                "  {:>5.1}%  {:>8.3}  {:>9.1}  {:>9.1}  {:<8} {}",
                share(k.total),
                per_step(k.total),
                k.launches as f64 / steps,
                1e6 * k.total.as_secs_f64() / k.launches.max(1) as f64,
                k.part.name(),
                k.name
            )?;
        }
        if self.kernels.len() > ROWS {
            let rest = &self.kernels[ROWS..];
            let total: Duration = rest.iter().map(|k| k.total).sum();
            writeln!(
                f,
                "  {:>5.1}%  {:>8.3}  {:>9.1}  {:>9}  {:<8} ({} more kernels)",
                share(total),
                per_step(total),
                rest.iter().map(|k| k.launches).sum::<u64>() as f64 / steps,
                "",
                "",
                rest.len()
            )?;
        }
        if self.unmeasured > 0 {
            writeln!(
                f,
                "  {} launches could not be timed and are left out",
                self.unmeasured
            )?;
        }
        Ok(())
    }
}
