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

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
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
    fn new(first_step: u64) -> Self {
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

    fn of(&self, part: Option<Part>) -> impl Iterator<Item = &KernelTime> {
        self.kernels
            .iter()
            .filter(move |k| part.is_none_or(|p| k.part == p))
    }
}

/// How many kernels the table lists; the rest are summed in one line.
const ROWS: usize = 25;

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

/// One launch of a profiled step: its kernel, the part that issued it, its window on the
/// device from the step's start (on the host clock) where the backend gave timestamps, and its
/// device time.
type Launch = (&'static str, Part, Option<(Duration, Duration)>, Duration);

/// The launches of one profiled step, resolved.
#[derive(Default)]
struct StepLaunches {
    timed: Vec<Launch>,
    /// Work queued outside CubeCL (cuBLAS's products) with its device time: inside the windows
    /// of the CubeCL kernels around it, so it adds to the busy time, not to the span.
    external: Vec<(&'static str, Part, Duration)>,
    unmeasured: u64,
    /// How they were timed (`device`, `system`), each once.
    methods: Vec<String>,
}

impl StepLaunches {
    #[cfg_attr(
        not(any(feature = "wgpu", feature = "vulkan", feature = "cuda")),
        allow(dead_code)
    )]
    fn note(&mut self, method: String) {
        if !self.methods.contains(&method) {
            self.methods.push(method);
        }
    }

    fn add_to(self, profile: &mut KernelProfile) {
        let mut index: HashMap<(String, Part), usize> = profile
            .kernels
            .iter()
            .enumerate()
            .map(|(i, k)| ((k.name.clone(), k.part), i))
            .collect();
        // Each part's window: the device is synchronised between parts, so idle time between
        // them is host time, not the device's.
        let mut windows: [Option<(Duration, Duration)>; 3] = [None; 3];
        let mut serial = Duration::ZERO;
        // One launch more of `name` in `part`, and its time, in the profile's rows.
        let mut count = |name: String, part: Part, duration: Duration| {
            let i = *index.entry((name.clone(), part)).or_insert_with(|| {
                profile.kernels.push(KernelTime {
                    name,
                    part,
                    launches: 0,
                    total: Duration::ZERO,
                });
                profile.kernels.len() - 1
            });
            profile.kernels[i].launches += 1;
            profile.kernels[i].total += duration;
        };
        for (kernel, part, window, duration) in self.timed {
            count(short_name(kernel), part, duration);
            match window {
                Some((start, end)) => {
                    let w = &mut windows[part.index()];
                    *w = Some(w.map_or((start, end), |(a, b)| (a.min(start), b.max(end))));
                }
                // Without a device clock (system timing) the kernels ran one at a time: the
                // span is their sum.
                None => serial += duration,
            }
        }
        for (name, part, duration) in self.external {
            count(name.to_string(), part, duration);
        }
        profile.span += serial
            + windows
                .iter()
                .flatten()
                .map(|(a, b)| b.saturating_sub(*a))
                .sum::<Duration>();
        profile.unmeasured += self.unmeasured;
        for method in self.methods {
            if !profile.method.split('+').any(|m| m == method) {
                if !profile.method.is_empty() {
                    profile.method.push('+');
                }
                profile.method.push_str(&method);
            }
        }
    }
}

/// `cubecl_std::...::MatmulEntry<F, ...>` → `MatmulEntry`; fused kernels keep their own name.
fn short_name(kernel: &str) -> String {
    let head = kernel.split('<').next().unwrap_or(kernel);
    head.rsplit("::").next().unwrap_or(head).trim().to_string()
}

#[cfg(any(feature = "wgpu", feature = "vulkan", feature = "cuda"))]
mod imp {
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
}

#[cfg(not(any(feature = "wgpu", feature = "vulkan", feature = "cuda")))]
mod imp {
    use std::time::Instant;

    use super::{Part, StepLaunches};

    /// Never built with a device (every device of a CPU-only build is refused first).
    pub(super) struct Profiler;

    /// Nothing to watch without a GPU backend.
    pub(super) struct Watching;

    impl Profiler {
        pub(super) fn new() -> Self {
            Self
        }

        pub(super) fn watch(&self) -> Watching {
            Watching
        }

        pub(super) fn unwatch(&self, _watching: Watching) {}

        pub(super) fn set_part(&self, _part: Part) {}

        pub(super) fn take_step(&self, _epoch: Instant) -> StepLaunches {
            StepLaunches::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: u64) -> Duration {
        Duration::from_millis(x)
    }

    /// A step's launches: (kernel, part, start ms, end ms), timed on the device.
    fn step(launches: &[(&'static str, Part, u64, u64)], unmeasured: u64) -> StepLaunches {
        StepLaunches {
            timed: launches
                .iter()
                .map(|&(k, p, a, b)| (k, p, Some((ms(a), ms(b))), ms(b - a)))
                .collect(),
            external: Vec::new(),
            unmeasured,
            methods: vec!["device".into()],
        }
    }

    /// Work timed outside CubeCL (cuBLAS's products) adds kernel rows and busy time inside the
    /// span of the CubeCL kernels around it, not span of its own.
    #[test]
    fn external_launches_add_busy_time_not_span() {
        use Part::*;
        let mut profile = KernelProfile::new(1);
        let mut launches = step(
            &[
                ("KernelBinop", Gradients, 0, 1),
                ("KernelBinop", Gradients, 9, 10),
            ],
            0,
        );
        launches.external = vec![
            ("cublasGemmEx", Gradients, ms(3)),
            ("cublasGemmEx", Gradients, ms(4)),
        ];
        launches.add_to(&mut profile);
        let rows: Vec<_> = profile
            .kernels
            .iter()
            .map(|k| (k.name.as_str(), k.launches, k.total))
            .collect();
        assert!(rows.contains(&("cublasGemmEx", 2, ms(7))), "{rows:?}");
        assert_eq!(profile.busy(None), ms(9));
        assert_eq!(profile.span, ms(10));
    }

    #[test]
    fn launches_are_summed_by_kernel_and_part_and_the_span_counts_idle_time() {
        use Part::*;
        let mut profile = KernelProfile::new(11);
        // Step 1: two matmuls and an add in the forward and backward passes with 1 ms idle
        // between them, an add in the optimizer; step 2 an add and a matmul, one launch
        // unmeasured.
        step(
            &[
                ("cubecl::matmul::MatmulEntry<f32, Tf32>", Gradients, 2, 5),
                ("KernelBinop", Gradients, 6, 7),
                ("cubecl::matmul::MatmulEntry<f32, Tf32>", Gradients, 7, 10),
                ("KernelBinop", Optimizer, 20, 21),
            ],
            0,
        )
        .add_to(&mut profile);
        step(
            &[
                ("KernelBinop", Gradients, 0, 2),
                ("MatmulEntry", Gradients, 3, 4),
            ],
            1,
        )
        .add_to(&mut profile);
        profile.steps = 2;
        profile.walls = [ms(16), ms(0), ms(4)];
        let profiler = KernelProfiler {
            devices: Vec::new(),
            first: 11,
            last: 12,
            inner: imp::Profiler::new(),
            profile: RefCell::new(Some(profile)),
        };
        let done = profiler.finish().unwrap();
        let rows: Vec<_> = done
            .kernels
            .iter()
            .map(|k| (k.name.as_str(), k.part, k.launches, k.total))
            .collect();
        assert_eq!(
            rows,
            [
                ("MatmulEntry", Gradients, 3, ms(7)),
                ("KernelBinop", Gradients, 2, ms(3)),
                ("KernelBinop", Optimizer, 1, ms(1)),
            ]
        );
        assert_eq!(done.busy(None), ms(11));
        assert_eq!(done.busy(Some(Gradients)), ms(10));
        // Spans: 2..10 and 20..21 in step 1 (each part on its own), 0..4 in step 2.
        assert_eq!(done.span, ms(13));
        assert_eq!(done.launches(None), 6);
        assert_eq!(done.method, "device");
        let text = done.to_string();
        assert!(
            text.starts_with("kernel profile, steps 11-12 (2 steps"),
            "{text}"
        );
        // 11 ms of kernels in 13 ms of span: 85%; 10 ms wall per step; 3.5 launches per step
        // with the unmeasured one.
        assert!(
            text.contains("10.00 ms/step wall; device busy 5.50 ms/step of a 6.50 ms/step span (85%), 4 kernel launches/step"),
            "{text}"
        );
        assert!(
            text.contains("  fwd+bwd      8.00      5.00        2.5"),
            "{text}"
        );
        assert!(
            text.contains("  optim        2.00      0.50        0.5"),
            "{text}"
        );
        assert!(
            text.contains(" 63.6%     3.500        1.5     2333.3  fwd+bwd  MatmulEntry"),
            "{text}"
        );
        assert!(text.contains("1 launches could not be timed"), "{text}");
    }

    #[test]
    fn kernels_past_the_table_are_summed_in_one_line() {
        let mut profile = KernelProfile::new(1);
        let names: Vec<&'static str> = (0..ROWS + 3)
            .map(|i| &*Box::leak(format!("k{i:02}").into_boxed_str()))
            .collect();
        let launches: Vec<_> = names
            .iter()
            .enumerate()
            .map(|(i, &n)| (n, Part::Gradients, 0, 1 + i as u64))
            .collect();
        step(&launches, 0).add_to(&mut profile);
        profile.steps = 1;
        let text = profile.to_string();
        assert!(text.contains("(3 more kernels)"), "{text}");
        // Two summary lines, the parts' header and rows, the kernels' header and rows.
        assert_eq!(text.lines().count(), 2 + 1 + 3 + 1 + ROWS + 1, "{text}");
    }
}
