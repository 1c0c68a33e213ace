//! CubeCL's launch observer (GPU builds): every kernel launched during a profiled part, timed
//! on the device, and work outside CubeCL (cuBLAS, cuDNN) timed by events around it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn_cubecl::cubecl::future::block_on;
use burn_cubecl::cubecl::logging::{
    LaunchObservation, LaunchObserver, ProfileDuration, TimingMethod, TimingRequest,
};

use ember_kernels::external_launches::{self, Elapsed, ExternalLaunches};

use super::{Part, StepLaunches};

/// Installed for the length of a profiled step.
pub(super) type Watching = LaunchObservation;

/// Keeps every launch's measurement, unread, until the step is over, with the part of the
/// step that was running when it was issued (by the trainer's thread, or by fusion's
/// while the trainer's waits for it at the end of the part).
#[derive(Default)]
struct Recorder {
    part: AtomicUsize,
    deferred: Mutex<Vec<(&'static str, Part, ProfileDuration)>>,
    /// Measurements the launch path read itself (when CubeCL's own profiling logger is
    /// on, it reads them first).
    resolved: Mutex<Vec<(&'static str, Part, Duration)>>,
    /// Work ember queued outside CubeCL, unread.
    external: Mutex<Vec<(&'static str, Part, Elapsed)>>,
}

impl ExternalLaunches for Recorder {
    fn launched(&self, name: &'static str, elapsed: Elapsed) {
        let part = self.part();
        self.external.lock().unwrap().push((name, part, elapsed));
    }
}

impl Recorder {
    fn part(&self) -> Part {
        Part::ALL[self.part.load(Ordering::Relaxed)]
    }
}

impl LaunchObserver for Recorder {
    fn launched(&self, _kernel: &'static str) {}

    fn timing(&self) -> TimingRequest {
        TimingRequest::Deferred
    }

    fn profiled(&self, kernel: &'static str, profile: ProfileDuration) {
        let part = self.part();
        self.deferred.lock().unwrap().push((kernel, part, profile));
    }

    fn timed(&self, kernel: &'static str, duration: Duration, _method: TimingMethod) {
        let part = self.part();
        self.resolved.lock().unwrap().push((kernel, part, duration));
    }
}

pub(super) struct Profiler {
    recorder: Arc<Recorder>,
}

impl Profiler {
    pub(super) fn new() -> Self {
        Self {
            recorder: Arc::default(),
        }
    }

    pub(super) fn watch(&self) -> Watching {
        external_launches::observe(Some(self.recorder.clone()));
        LaunchObservation::new(self.recorder.clone())
    }

    pub(super) fn unwatch(&self, watching: Watching) {
        external_launches::observe(None);
        drop(watching);
    }

    pub(super) fn set_part(&self, part: Part) {
        self.recorder.part.store(part.index(), Ordering::Relaxed);
    }

    /// The launches since the last call, their measurements read (the device has run
    /// them: the caller synchronised it), their windows placed from `epoch` (the host
    /// instant the step started at, the device idle).
    pub(super) fn take_step(&self, epoch: Instant) -> StepLaunches {
        let deferred = std::mem::take(&mut *self.recorder.deferred.lock().unwrap());
        let resolved = std::mem::take(&mut *self.recorder.resolved.lock().unwrap());
        let mut step = StepLaunches::default();
        for (kernel, part, profile) in deferred {
            step.note(profile.timing_method().to_string());
            match block_on(profile.resolve()) {
                Some(ticks) => {
                    let window = (
                        ticks.start_duration_since(epoch),
                        ticks.end_duration_since(epoch),
                    );
                    step.timed
                        .push((kernel, part, Some(window), ticks.duration()));
                }
                None => step.unmeasured += 1,
            }
        }
        let external = std::mem::take(&mut *self.recorder.external.lock().unwrap());
        for (name, part, elapsed) in external {
            match elapsed() {
                Some(duration) => step.external.push((name, part, duration)),
                None => step.unmeasured += 1,
            }
        }
        for (kernel, part, duration) in resolved {
            // Read by the launch path: one kernel at a time, host wall around it.
            step.note(TimingMethod::System.to_string());
            step.timed.push((kernel, part, None, duration));
        }
        step
    }
}
