//! Where a GPU training step spends its time: every kernel the profiled steps launch, timed on
//! the device through CubeCL's launch observer and summed by kernel name and by part of the
//! step (forward + backward, gradient clipping, optimizer).
//!
//! `ember train --profile-steps N` profiles the last `N` steps of the run (the ones before them
//! warm up: the first steps compile and autotune every kernel). Each part of a profiled step
//! ends with the device synchronised, so evaluation and checkpoint work stays out of the
//! profile, every kernel is counted in the part that issued it (with Burn's fusion too, whose
//! queue the synchronisation flushes), and all are measured; that costs the overlap of host work
//! with queued kernels, so the profiled wall time is a little above the unprofiled one.
//!
//! The kernels are timed in order on the device (CUDA events, wgpu timestamp queries), so
//! besides each kernel's time the profile knows how long the device sat idle between kernels:
//! a step whose device is busy for a small part of its span is bound by the host (launches,
//! allocation, autodiff bookkeeping), not by arithmetic.
//!
//! Layout: this file holds the profiler a run drives (parts, profiled steps); [`report`] the
//! profile it prints, [`launches`] one step's launches and their device time and gaps, and
//! `observe` CubeCL's launch observer (GPU builds) or its stand-in (CPU-only builds).

#[cfg(any(feature = "wgpu", feature = "vulkan", feature = "cuda"))]
#[path = "observe.rs"]
mod imp;
#[cfg(not(any(feature = "wgpu", feature = "vulkan", feature = "cuda")))]
#[path = "observe_none.rs"]
mod imp;
mod launches;
mod report;
#[cfg(test)]
mod tests;

pub use report::{KernelProfile, KernelTime};

use launches::StepLaunches;
#[cfg(test)]
use report::ROWS;

use std::cell::RefCell;
use std::time::{Duration, Instant};

use burn::tensor::Device;

use crate::error::{Result, TrainError};

/// The parts of a training step a profile tells apart, in the order a step runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// The micro-batches' forward and backward passes (and gradient accumulation).
    Gradients,
    /// The global gradient norm and its clipping.
    Clip,
    /// AdamW's update of every parameter.
    Optimizer,
}

impl Part {
    const ALL: [Part; 3] = [Part::Gradients, Part::Clip, Part::Optimizer];

    /// How the profile names it.
    pub fn name(self) -> &'static str {
        match self {
            Part::Gradients => "fwd+bwd",
            Part::Clip => "clip",
            Part::Optimizer => "optim",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Profiles the last steps of a run on its devices.
pub struct KernelProfiler {
    devices: Vec<Device>,
    first: u64,
    last: u64,
    inner: imp::Profiler,
    profile: RefCell<Option<KernelProfile>>,
}

impl KernelProfiler {
    /// A profiler of the last `steps` steps of a run that starts after step `start` and stops
    /// after step `stop`, on `devices` (`name`, as the run names them); refused where no step
    /// is left to warm up or a device runs no kernels this build can observe.
    pub fn new(
        devices: Vec<Device>,
        name: &str,
        steps: u64,
        start: u64,
        stop: u64,
    ) -> Result<Self> {
        let key = "--profile-steps";
        if steps == 0 {
            return Err(TrainError::Device(format!(
                "{key} 0: profile at least one step"
            )));
        }
        if steps >= stop.saturating_sub(start) {
            return Err(TrainError::Device(format!(
                "{key} {steps}: the run has {} steps to go (steps {}-{stop}); profile fewer, so that the first steps compile and tune the kernels",
                stop.saturating_sub(start),
                start + 1
            )));
        }
        if !devices.iter().all(ember_kernels::on_cubecl) {
            return Err(TrainError::Device(format!(
                "{key} times GPU kernels; device `{name}` runs on the CPU (profile it with `perf record`)"
            )));
        }
        let inner = imp::Profiler::new();
        Ok(Self {
            devices,
            first: stop - steps + 1,
            last: stop,
            inner,
            profile: RefCell::new(None),
        })
    }

    /// Starts step `step` (1-based): profiled (the device synchronised first) if it is one of
    /// the last steps, else `None`.
    pub fn begin(&self, step: u64) -> Result<Option<ProfiledStep<'_>>> {
        if !(self.first..=self.last).contains(&step) {
            return Ok(None);
        }
        self.sync()?;
        Ok(Some(ProfiledStep {
            profiler: self,
            step,
            start: Instant::now(),
            walls: [Duration::ZERO; 3],
            watching: self.inner.watch(),
        }))
    }

    /// The profile of the steps run so far, kernels longest first; `None` before the first
    /// profiled step.
    pub fn finish(self) -> Option<KernelProfile> {
        let mut profile = self.profile.into_inner()?;
        profile.kernels.sort_by(|a, b| {
            (b.total, a.part.index(), &a.name).cmp(&(a.total, b.part.index(), &b.name))
        });
        Some(profile)
    }

    fn sync(&self) -> Result<()> {
        for device in &self.devices {
            device.sync().map_err(|e| {
                TrainError::Device(format!(
                    "profiling: the device failed to synchronise: {e:?}"
                ))
            })?;
        }
        Ok(())
    }
}

/// A step being profiled: its parts run through [`ProfiledStep::part`], then
/// [`ProfiledStep::end`].
pub struct ProfiledStep<'a> {
    profiler: &'a KernelProfiler,
    step: u64,
    start: Instant,
    walls: [Duration; 3],
    watching: imp::Watching,
}

impl ProfiledStep<'_> {
    /// Runs `body` as `part` of the step, the device synchronised at its end.
    pub fn part<R>(&mut self, part: Part, body: impl FnOnce() -> R) -> Result<R> {
        let start = Instant::now();
        self.profiler.inner.set_part(part);
        let out = body();
        self.profiler.sync()?;
        self.walls[part.index()] += start.elapsed();
        Ok(out)
    }

    /// Ends the step: its launches' measurements are read and added to the profile.
    pub fn end(self) {
        self.profiler.inner.unwatch(self.watching);
        let measured = self.profiler.inner.take_step(self.start);
        let mut profile = self.profiler.profile.borrow_mut();
        let profile = profile.get_or_insert_with(|| KernelProfile::new(self.step));
        profile.steps += 1;
        for (sum, wall) in profile.walls.iter_mut().zip(self.walls) {
            *sum += wall;
        }
        measured.add_to(profile);
    }
}

/// Runs `body` as `part` of `step`: profiled if `step` is.
pub fn part<R>(step: &mut Option<ProfiledStep>, part: Part, body: impl FnOnce() -> R) -> Result<R> {
    match step {
        Some(step) => step.part(part, body),
        None => Ok(body()),
    }
}
