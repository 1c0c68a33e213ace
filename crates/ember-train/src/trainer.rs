//! The training loop, shared by every task (language modelling, translation): AdamW, the
//! learning-rate schedule, gradient accumulation and clipping, evaluation, metrics, progress,
//! atomic checkpoints and resume.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::ModuleOptimizer;
use burn::tensor::{Device, Tensor};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::adamw::GradScale;
use crate::checkpoint::{
    self, CheckpointState, FORMAT_VERSION, load_model, load_optimizer, save_weights,
};
use crate::config::TrainingConfig;
use crate::error::{Result, TrainError};
use crate::kernel_profile::{self, KernelProfile, KernelProfiler, Part};
use crate::metrics::{Metrics, Record};
use crate::optimizer::{adamw_scaled, clip_factor};
use crate::task::{DROPOUT_SALT, Split, Task, accumulate, param_device};

/// Where and how a run goes.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The run folder: checkpoints, metrics, loss plot.
    pub out_dir: PathBuf,
    /// Optimisation settings.
    pub training: TrainingConfig,
    /// The devices that share each step's micro-batches (data parallel), the model's own first;
    /// empty or one device: everything runs where the model is.
    pub devices: Vec<Device>,
    /// Continue from the newest checkpoint in `out_dir`.
    pub resume: bool,
    /// Stop (with a checkpoint) after this step, as if interrupted; for tests and benchmarks.
    pub stop_after: Option<u64>,
    /// Draw a progress bar on stderr (only when it is a terminal); without one, a plain line
    /// is printed every `log_interval` steps instead.
    pub progress: bool,
    /// Title of the loss plot.
    pub title: String,
    /// Set (by a signal handler, say) to stop at the end of the current step, with a
    /// checkpoint: `train` then returns [`TrainError::Interrupted`].
    pub interrupt: Option<Arc<AtomicBool>>,
    /// Time every GPU kernel of the last this many steps ([`crate::kernel_profile`]).
    pub profile_steps: Option<u64>,
}

/// How `ember train` starts a run: where, on what, and whether it continues an earlier one.
#[derive(Debug, Clone, Default)]
pub struct Launch {
    /// The run folder.
    pub out_dir: PathBuf,
    /// Continue from the newest checkpoint in `out_dir`.
    pub resume: bool,
    /// Remove a run that `out_dir` already holds first (otherwise such a folder is refused,
    /// unless `resume`).
    pub overwrite: bool,
    /// Device name overriding the config's `training.device`.
    pub device: Option<String>,
    /// Stop (with a checkpoint) after this step, as if interrupted.
    pub stop_after: Option<u64>,
    /// Draw a progress bar (when stderr is a terminal).
    pub progress: bool,
    /// Start from these weights instead of random ones (language models).
    pub init_from: Option<crate::init_from::InitFrom>,
    /// Stop at the end of the current step, with a checkpoint, once this is set.
    pub interrupt: Option<Arc<AtomicBool>>,
    /// Time every GPU kernel of the last this many steps (the summary's kernel profile).
    pub profile_steps: Option<u64>,
}

impl Launch {
    /// A fresh run in `out_dir` on the config's device, to the end, without a progress bar.
    pub fn new(out_dir: impl Into<PathBuf>) -> Self {
        Self {
            out_dir: out_dir.into(),
            ..Self::default()
        }
    }

    /// What to do with a run the folder already holds.
    pub fn reuse(&self) -> crate::run_folder::Reuse {
        use crate::run_folder::Reuse;
        match (self.resume, self.overwrite) {
            (true, _) => Reuse::Resume,
            (false, true) => Reuse::Overwrite,
            (false, false) => Reuse::Refuse,
        }
    }

    /// The start every task shares: the devices (this launch's `--device` written into
    /// `training`, so the saved config names it) and the run folder, claimed before anything
    /// reads or writes it: locked for this process, and refused if it holds another run that
    /// this one would neither resume nor replace.
    pub(crate) fn claim(
        &self,
        training: &mut TrainingConfig,
    ) -> Result<(Vec<Device>, crate::run_folder::RunFolder)> {
        let devices = training.devices(self.device.as_deref())?;
        if let Some(name) = &self.device {
            training.device = name.clone();
        }
        training.precision.check(&devices, &training.device)?;
        if let Some(steps) = self.profile_steps {
            // Before the run folder is touched; a resumed run is checked again once its step
            // is known.
            let stop = self.stop_after.unwrap_or(u64::MAX).min(training.max_steps);
            KernelProfiler::new(devices.clone(), &training.device, steps, 0, stop)?;
        }
        let folder = crate::run_folder::RunFolder::claim(&self.out_dir, self.reuse())?;
        Ok((devices, folder))
    }
}

impl RunOptions {
    /// Whether the interrupt flag (Ctrl-C, SIGTERM) is up.
    fn interrupted(&self) -> bool {
        self.interrupt
            .as_ref()
            .is_some_and(|flag| flag.load(Ordering::Relaxed))
    }
}

/// What a finished (or stopped) run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// Steps completed.
    pub step: u64,
    /// Last evaluated training loss.
    pub train_loss: Option<f64>,
    /// Last evaluated validation loss.
    pub val_loss: Option<f64>,
    /// Training seconds (resumed runs include earlier segments).
    pub elapsed_secs: f64,
    /// Tokens per second over this process's steps.
    pub tokens_per_sec: f64,
    /// Milliseconds per optimizer step over this process's steps.
    pub ms_per_step: f64,
    /// The newest checkpoint.
    pub checkpoint: PathBuf,
    /// The checkpoint with the lowest validation loss, and that loss.
    pub best: Option<(PathBuf, f64)>,
    /// Training ended before `max_steps` because the validation loss stopped improving
    /// (`training.early_stop_patience`).
    pub stopped_early: bool,
    /// Where the profiled steps' GPU time went (`profile_steps`).
    pub kernel_profile: Option<KernelProfile>,
    /// What the GPU's allocator held (`None` on CPU devices, whose backends do not report it).
    pub device_memory: Option<DeviceMemory>,
}

/// The memory a GPU device's allocator (CubeCL's pools, every stream) held for a run: what
/// `torch.cuda.max_memory_reserved` is to PyTorch. The driver's context and buffers outside the
/// pools (which `nvidia-smi` counts too) are not in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Each pool's most pages held at once, times its page size, summed over the pools (the
    /// pools may have peaked at different moments, so this may exceed what was held at once).
    pub peak_reserved: u64,
    /// Bytes reserved when the run ended.
    pub reserved: u64,
    /// Bytes of live tensors when the run ended (the weights, the optimizer's moments).
    pub in_use: u64,
    /// The most bytes of live tensors just before a backward pass, over the run's first two
    /// steps (the second is the first with the optimizer's moments): the weights, the moments
    /// and one forward pass's saved activations. Against `peak_reserved`, what the pools hold
    /// beyond what the step keeps alive. `None` where not measured (runs over several devices).
    pub live_before_backward: Option<u64>,
}

impl DeviceMemory {
    /// What `device`'s allocator holds now, and its pools' peaks, with the live bytes measured
    /// before a backward pass; `None` where the backend does not report them.
    pub fn of(device: &Device, live_before_backward: Option<u64>) -> Option<Self> {
        let usage = device.memory_pool_usage()?;
        let pools = device.memory_pool_report()?;
        let peak = pools
            .iter()
            .map(|p| p.pages_peak * p.page_size)
            .sum::<u64>();
        Some(Self {
            peak_reserved: peak.max(usage.bytes_reserved),
            reserved: usage.bytes_reserved,
            in_use: usage.bytes_in_use,
            live_before_backward,
        })
    }
}

impl std::fmt::Display for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        write!(
            f,
            "peak {:.1} MiB reserved by the allocator's pools, {:.1} MiB reserved and {:.1} MiB \
             in use at the end",
            mib(self.peak_reserved),
            mib(self.reserved),
            mib(self.in_use),
        )?;
        match self.live_before_backward {
            Some(live) => write!(f, "; {:.1} MiB live before a backward pass", mib(live)),
            None => Ok(()),
        }
    }
}

/// Trains `model` (built on `device.autodiff()`) on `task`. On resume, weights, optimizer state
/// and the step are read from the newest checkpoint in `options.out_dir`; batches, dropout and
/// the learning rate depend only on `(seed, step)`, so the resumed run continues exactly.
pub fn train<T: Task>(task: &T, model: T::Model, options: &RunOptions) -> Result<RunSummary> {
    let config = &options.training;
    let out = &options.out_dir;
    std::fs::create_dir_all(out).map_err(|e| crate::error::write_err(out, e))?;
    check_writable(out)?;
    let schedule = config.schedule();
    // Clipping's factor, applied by the optimizer as it reads each gradient.
    let grad_scale = GradScale::default();
    let (mut state, mut model, mut optim, mut last_checkpoint) =
        start(task, model, options, &grad_scale)?;
    let metrics = Metrics::open(out, options.resume.then_some(state.step))?;
    let mut best = Best::open(out, &metrics, options.resume);
    let device = param_device(&model);
    let bar = progress_bar(config.max_steps, state.step, options.progress);
    let mut clock = Clock::new(&state);
    let mut window = LogWindow::new(state.step);
    let (mut train_loss, mut val_loss) = (None, state.val_loss);
    let mut stopped_early = false;
    let stop = options.stop_after.unwrap_or(u64::MAX).min(config.max_steps);
    let profiler = match options.profile_steps {
        Some(steps) => {
            let devices = match options.devices.is_empty() {
                true => vec![device.clone()],
                false => options.devices.clone(),
            };
            Some(KernelProfiler::new(
                devices,
                &config.device,
                steps,
                state.step,
                stop,
            )?)
        }
        None => None,
    };

    // The most bytes live before a backward pass in this process's first two steps (0 where
    // not measured: a measured step holds at least the weights).
    let (first, mut live) = (state.step, 0u64);
    while state.step < stop {
        let step = state.step;
        device.seed(ember_data::batch_seed(config.seed, step, DROPOUT_SALT));
        let lr = schedule.at(step);
        let mut profiled = match &profiler {
            Some(profiler) => profiler.begin(step + 1)?,
            None => None,
        };
        let (loss, tokens, grads) = kernel_profile::part(&mut profiled, Part::Gradients, || {
            if options.devices.len() > 1 {
                crate::parallel::accumulate(task, &model, step, config, &options.devices)
            } else {
                let probe = (step < first + 2).then_some(&mut live);
                accumulate(
                    task,
                    &model,
                    step,
                    config.grad_accum,
                    config.precision,
                    probe,
                )
            }
        })?;
        let norm = kernel_profile::part(&mut profiled, Part::Clip, || {
            let (norm, factor) = clip_factor(&model, &grads, config.grad_clip).unzip();
            grad_scale.set(factor.flatten());
            norm
        })?;
        model = kernel_profile::part(&mut profiled, Part::Optimizer, || {
            optim.step(lr, model, grads)
        })?;
        grad_scale.set(None);
        if let Some(profiled) = profiled {
            profiled.end();
        }
        if step == first {
            release_replaced_weights(&device, &options.devices);
        }
        state.step += 1;
        state.tokens_seen += tokens as u64;
        clock.tokens += tokens as u64;
        window.push(loss, norm, tokens);

        let interrupted = options.interrupted();
        let done = state.step == stop;
        let mut checkpoint_due =
            state.step.is_multiple_of(config.checkpoint_interval) || done || interrupted;
        if state.step.is_multiple_of(config.log_interval) || checkpoint_due {
            let record = window.flush(state.step, lr, clock.elapsed())?;
            log_line(&bar, &record, config.max_steps);
            metrics.append(&record)?;
        }
        let mut improved = false;
        if state.step.is_multiple_of(config.eval_interval) || state.step == config.max_steps {
            let valid = model.valid();
            let eval_model = config.precision.compute(&valid);
            let (train, val) = evaluate(task, &eval_model, config.eval_batches, state.step, &bar);
            metrics.append(&clock.eval_record(state.step, lr, train, val))?;
            (train_loss, val_loss) = (Some(train), Some(val));
            state.val_loss = val_loss;
            // Every improvement is saved, so the best model is on disk however late the run
            // overfits (nanoGPT's GPU config does after about 2000 of its 5000 steps).
            improved = best.record(val, state.step);
            stopped_early = best.patience_spent(config.early_stop_patience, &bar);
            checkpoint_due |= improved || stopped_early;
            draw_plot(&metrics, &options.title, out);
        }
        if checkpoint_due {
            ensure_finite(&model, state.step)?;
            state.elapsed_secs = clock.elapsed();
            let (m, o) = (&model, &optim);
            last_checkpoint = checkpoint::save(out, &state, config.keep_checkpoints, |dir| {
                save_weights(m, o, dir)?;
                task.write_files(dir)
            })?;
            if improved {
                checkpoint::mark_best(out, &last_checkpoint)?;
            }
        }
        if interrupted && !done {
            bar.finish_and_clear();
            draw_plot(&metrics, &options.title, out);
            return Err(TrainError::Interrupted {
                step: state.step,
                checkpoint: last_checkpoint,
            });
        }
        if stopped_early {
            break;
        }
    }
    bar.finish_and_clear();
    draw_plot(&metrics, &options.title, out);
    let mut summary = clock.summary(state.step, last_checkpoint);
    summary.train_loss = train_loss;
    summary.val_loss = val_loss;
    summary.best = checkpoint::resolve_best(out).ok().zip(best.loss());
    summary.stopped_early = stopped_early;
    summary.kernel_profile = profiler.and_then(KernelProfiler::finish);
    summary.device_memory = DeviceMemory::of(&device, (live > 0).then_some(live));
    Ok(summary)
}

/// Hands back to the GPU driver the memory of the weights the first optimizer step replaced. Burn
/// builds and loads parameters in its allocator's persistent pool (and the initializers'
/// temporaries with them), which returns memory only when asked: on lavapipe, twice the weights'
/// bytes stayed reserved, free, for the whole run (docs/benchmarks.md). A no-op on CPU devices.
fn release_replaced_weights(device: &Device, devices: &[Device]) {
    device.memory_cleanup();
    for other in devices.iter().filter(|d| *d != device) {
        other.memory_cleanup();
    }
}

/// Training and validation loss of `eval_model` (without autodiff, at the run's precision) over
/// `batches` batches each (the task's extra figures too), printed as the evaluation line of
/// `step`.
fn evaluate<T: Task>(
    task: &T,
    eval_model: &T::Model,
    batches: usize,
    step: u64,
    bar: &ProgressBar,
) -> (f64, f64) {
    let train = task.eval_loss(eval_model, Split::Train, batches);
    let val = task.eval_loss(eval_model, Split::Val, batches);
    let extra = task.extra_eval(eval_model);
    let extra: String = extra.iter().map(|(k, v)| format!(", {k} {v:.2}")).collect();
    say(
        bar,
        format!(
            "step {step:>6}: train loss {train:.4}, val loss {val:.4} (perplexity {:.2}){extra}",
            val.exp()
        ),
    );
    (train, val)
}

/// The run's starting point: on resume the newest checkpoint's state, weights and optimizer
/// (and its folder), else step 0 with a fresh optimizer.
fn start<T: Task>(
    task: &T,
    model: T::Model,
    options: &RunOptions,
    grad_scale: &GradScale,
) -> Result<(CheckpointState, T::Model, ModuleOptimizer, PathBuf)> {
    let config = &options.training;
    let fresh = CheckpointState {
        format_version: FORMAT_VERSION,
        model_kind: task.model_kind().to_string(),
        step: 0,
        seed: config.seed,
        tokens_seen: 0,
        elapsed_secs: 0.0,
        val_loss: None,
    };
    // The optimizer is built from the model it will update: its weight-decay groups are keyed
    // by parameter id, and loading a checkpoint restores the ids its state was saved under.
    if !options.resume {
        let optim = adamw_scaled(config, &model, grad_scale);
        return Ok((fresh, model, optim, PathBuf::new()));
    }
    let dir = checkpoint::resolve(&options.out_dir)?;
    let mut saved = checkpoint::read_state(&dir)?;
    if saved.model_kind != task.model_kind() {
        return Err(TrainError::Checkpoint {
            path: dir,
            message: format!(
                "holds a {}, but this config trains a {}",
                checkpoint::describe_kind(&saved.model_kind),
                checkpoint::describe_kind(task.model_kind())
            ),
        });
    }
    let model = load_model(model, &dir)?;
    let optim = load_optimizer(adamw_scaled(config, &model, grad_scale), &dir)?;
    eprintln!("resuming from {} (step {})", dir.display(), saved.step);
    saved.seed = config.seed;
    Ok((saved, model, optim, dir))
}

/// A log record on the progress bar, or as a plain line off a terminal (a pipe, a file, nohup).
fn log_line(bar: &ProgressBar, record: &Record, max_steps: u64) {
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

/// The best validation loss so far with its step, and how many evaluations since have not
/// beaten it.
struct Best {
    best: Option<(f64, u64)>,
    evals_since: u64,
}

impl Best {
    /// A fresh run starts with none; a resumed run takes the loss from its `best` checkpoint and
    /// counts the evaluations after it in the metrics kept up to the resumed step.
    fn open(out: &Path, metrics: &Metrics, resume: bool) -> Self {
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
    fn record(&mut self, val: f64, step: u64) -> bool {
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
    fn patience_spent(&self, patience: Option<u64>, bar: &ProgressBar) -> bool {
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

    fn loss(&self) -> Option<f64> {
        self.best.map(|(loss, _)| loss)
    }
}

/// The time and tokens of this process's part of a run.
struct Clock {
    start: Instant,
    start_step: u64,
    /// Training seconds of earlier segments of a resumed run.
    before: f64,
    tokens: u64,
}

impl Clock {
    fn new(state: &CheckpointState) -> Self {
        Self {
            start: Instant::now(),
            start_step: state.step,
            before: state.elapsed_secs,
            tokens: 0,
        }
    }

    /// Training seconds, earlier segments included.
    fn elapsed(&self) -> f64 {
        self.before + self.start.elapsed().as_secs_f64()
    }

    fn eval_record(&self, step: u64, lr: f64, train: f64, val: f64) -> Record {
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
    fn summary(&self, step: u64, checkpoint: PathBuf) -> RunSummary {
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
        }
    }
}

fn draw_plot(metrics: &Metrics, title: &str, out: &Path) {
    let records = crate::metrics::read(metrics.path());
    if let Err(e) = crate::plot::loss_curves(&records, title, &out.join("loss.png")) {
        eprintln!("warning: no loss plot: {e}");
    }
}

/// Losses and norms since the last log line, kept on the device until the log reads them all
/// at once (one synchronisation per log line, not per step).
struct LogWindow {
    first_step: u64,
    losses: Vec<Tensor<1>>,
    norms: Vec<Tensor<1>>,
    tokens: usize,
    since: Instant,
}

impl LogWindow {
    fn new(step: u64) -> Self {
        Self {
            first_step: step,
            losses: Vec::new(),
            norms: Vec::new(),
            tokens: 0,
            since: Instant::now(),
        }
    }

    fn push(&mut self, loss: Tensor<1>, norm: Option<Tensor<1>>, tokens: usize) {
        self.losses.push(loss);
        self.norms.extend(norm);
        self.tokens += tokens;
    }

    /// Reads the window, fails on the first non-finite loss (naming its step), and resets.
    fn flush(&mut self, step: u64, lr: f64, elapsed: f64) -> Result<Record> {
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

/// The values of `values`, one read from the device; a failed read (the kernels that were to
/// compute them did not run) is an error naming `what`, never an empty or zero result.
fn read_all(values: Vec<Tensor<1>>, what: &str) -> Result<Vec<f32>> {
    if values.is_empty() {
        return Ok(Vec::new());
    }
    Tensor::cat(values, 0)
        .try_into_vec_as::<f32>()
        .map_err(|e| crate::error::device_read_err(what, &e))
}

/// Sum of |w| over all parameters, to catch a NaN/inf before it is saved.
struct Finite(Vec<Tensor<1>>);

impl ModuleVisitor for Finite {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.push(param.val().abs().sum());
    }
}

fn ensure_finite<M: Module>(model: &M, step: u64) -> Result<()> {
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
fn check_writable(dir: &Path) -> Result<()> {
    let probe = dir.join(format!(".write-test-{}", std::process::id()));
    std::fs::write(&probe, b"ok").map_err(|e| crate::error::write_err(dir, e))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

/// Prints a line above the progress bar, or plainly when there is no bar (not a terminal).
fn say(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

fn progress_bar(total: u64, position: u64, enabled: bool) -> ProgressBar {
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
