//! The training loop, shared by every task (language modelling, translation): AdamW, the
//! learning-rate schedule, gradient accumulation and clipping, evaluation, metrics, progress,
//! atomic checkpoints and resume.
//!
//! Layout: [`options`] what a run is asked (`RunOptions`, `Launch`), [`summary`] what it reports
//! (`RunSummary`, `DeviceMemory`), this file the loop itself, [`progress`] the progress bar,
//! log lines and the plot, [`saving`] the checkpoints written beside the steps, [`guards`] the
//! checks that stop a run cleanly (a non-finite loss or weight, an unwritable folder) and the
//! best checkpoint's bookkeeping.

mod guards;
mod options;
mod progress;
mod saving;
mod summary;

pub use options::{Launch, RunOptions};
pub use summary::{DeviceMemory, RunSummary, TimeSpent};

use guards::{Best, check_writable, ensure_finite};
use progress::{Clock, LogWindow, draw_plot, log_line, progress_bar, say};
use saving::Saving;

use std::path::PathBuf;

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::{Device, Tensor};
use indicatif::ProgressBar;

use crate::adamw::GradScale;
use crate::checkpoint::{
    self, CheckpointState, FORMAT_VERSION, Snapshot, load_model, load_optimizer,
};
use crate::distributed::World;
use crate::error::{Result, TrainError};
use crate::kernel_profile::{self, KernelProfiler, Part};
use crate::metrics::Metrics;
use crate::optimizer::{adamw_scaled, clip_factor};
use crate::task::{Split, Task, accumulate, param_device};

/// Trains `model` (built on `device.autodiff()`) on `task`. On resume, weights, optimizer state
/// and the step are read from the newest checkpoint in `options.out_dir`; batches, dropout and
/// the learning rate depend only on `(seed, step)`, so the resumed run continues exactly.
pub fn train<T: Task>(task: &T, model: T::Model, options: &RunOptions) -> Result<RunSummary> {
    // The weights' bf16 copies the run's steps keep (`ember_kernels::weight_in`) are its own.
    let _copies = ForgetWeightCopies;
    let config = &options.training;
    let out = &options.out_dir;
    let world = options.world.as_deref();
    // Rank 0 of a run across processes (or the one process) logs, evaluates and saves.
    let main = world.is_none_or(World::is_main);
    if main {
        std::fs::create_dir_all(out).map_err(|e| crate::error::write_err(out, e))?;
        check_writable(out)?;
    }
    let schedule = config.schedule();
    // Clipping's factor, applied by the optimizer as it reads each gradient.
    let grad_scale = GradScale::default();
    let (mut state, mut model, mut optim, resumed) = start(task, model, options, &grad_scale)?;
    // Checkpoints are written on a thread of their own while the next steps train.
    let mut saving = Saving::new(resumed);
    let device = param_device(&model);
    if let Some(world) = world {
        // Burn initialises parameters lazily, from the process-wide generator, when they are
        // first read. Every rank reads them here, from the generator as the first micro-batch
        // sets it (where one process initialises them: its first forward pass), so that every
        // rank starts from one process's weights; then that is checked.
        ember_kernels::seed_random(&device, crate::task::micro_seed(config.seed, state.step, 0));
        ember_model::precision::initialize(&model);
        world.check_same_weights(&model)?;
    }
    let (rank, ranks) = world.map_or((0, 1), |w| (w.ranks.rank as u64, w.size() as u64));
    let per_rank = micro_batches_per_rank(&state, config.grad_accum as u64, ranks, main)?;
    state.micro_batches = per_rank * ranks;
    state.world_size = ranks;
    let metrics = match main {
        true => Some(Metrics::open(out, options.resume.then_some(state.step))?),
        false => None,
    };
    let mut best = match &metrics {
        Some(metrics) => Best::open(out, metrics, options.resume),
        None => Best::default(),
    };
    if main && options.resume && state.step >= config.max_steps {
        eprintln!(
            "note: the run is at step {} already, training.max_steps = {}: nothing to train \
             (a larger training.max_steps trains on, e.g. --set training.max_steps={})",
            state.step,
            config.max_steps,
            state.step * 2
        );
    }
    let bar = progress_bar(config.max_steps, state.step, options.progress && main);
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
    // Across processes: each step's tokens and stop flags, summed over the ranks.
    let mut summed = Summed::default();

    // The most bytes live before a backward pass in this process's first two steps (0 where
    // not measured: a measured step holds at least the weights).
    let (first, mut live) = (state.step, 0u64);
    while state.step < stop {
        let step = state.step;
        let lr = schedule.at(step);
        let mut profiled = match &profiler {
            Some(profiler) => profiler.begin(step + 1)?,
            None => None,
        };
        // Across processes the gradients are summed over the ranks as part of the step's
        // gradients, in one collective with the step's tokens and stop flags.
        let gradients = kernel_profile::part(&mut profiled, Part::Gradients, || -> Result<_> {
            let (loss, tokens, grads) = if options.devices.len() > 1 {
                crate::parallel::accumulate(task, &model, step, config, &options.devices)
            } else {
                let probe = (step < first + 2).then_some(&mut live);
                let micros = rank * per_rank..(rank + 1) * per_rank;
                accumulate(
                    task,
                    &model,
                    step,
                    micros,
                    per_rank * ranks,
                    config.seed,
                    config.precision,
                    probe,
                )
            };
            match world {
                Some(world) => {
                    let flags = [tokens as f32, options.interrupted() as u8 as f32];
                    let (loss, sums, grads) = world.all_reduce_step(&model, loss, &flags, grads)?;
                    Ok((loss, tokens, Some(sums), grads))
                }
                None => Ok((loss, tokens, None, grads)),
            }
        })?;
        let (loss, tokens, sums, grads) = gradients?;
        // Across processes the summed tokens and stop flags are read a step late (the host need
        // not wait for the step it has just queued), or at once where the step evaluates or
        // saves; every rank reads them at the same steps, so all stop together.
        let (mut tokens, mut interrupted) = match sums {
            Some(sums) => summed.push(sums)?,
            None => (tokens, options.interrupted()),
        };
        let norm = kernel_profile::part(&mut profiled, Part::Clip, || {
            let (norm, factor) = clip_factor(&model, &grads, config.grad_clip).unzip();
            grad_scale.set(factor.flatten());
            norm
        })?;
        model = kernel_profile::part(&mut profiled, Part::Optimizer, || {
            // On GPUs the parameters' steps are launched three at a time, all before this returns.
            let _grouped = ember_kernels::AdamWGroups::open();
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
        let done = state.step == stop;
        let eval_due =
            state.step.is_multiple_of(config.eval_interval) || state.step == config.max_steps;
        let saves = state.step.is_multiple_of(config.checkpoint_interval) || done;
        if world.is_some() && (saves || eval_due) {
            let (more, stop) = summed.drain()?;
            tokens += more;
            interrupted |= stop;
        }
        state.tokens_seen += tokens as u64;
        clock.tokens += tokens as u64;
        let mut checkpoint_due = (saves || interrupted) && !options.no_checkpoints;
        if let Some(metrics) = &metrics {
            // A checkpoint that failed on its thread stops the run now.
            saving.poll()?;
            window.push(loss, norm, tokens);
            if state.step.is_multiple_of(config.log_interval) || checkpoint_due {
                let record = window.flush(state.step, lr, clock.elapsed())?;
                log_line(&bar, &record, config.max_steps);
                metrics.append(&record)?;
            }
            let mut improved = false;
            if eval_due {
                let valid = model.valid();
                let eval_model = config.precision.compute(&valid);
                let (train, val) = clock
                    .evaluations
                    .time(|| evaluate(task, &eval_model, config.eval_batches, state.step, &bar));
                metrics.append(&clock.eval_record(state.step, lr, train, val))?;
                (train_loss, val_loss) = (Some(train), Some(val));
                state.val_loss = val_loss;
                // Every improvement is saved, so the best model is on disk however late the
                // run overfits (nanoGPT's GPU config does after about 2000 of its 5000 steps).
                improved = best.record(val, state.step);
                stopped_early = best.patience_spent(config.early_stop_patience, &bar);
                checkpoint_due |= (improved || stopped_early) && !options.no_checkpoints;
                draw_plot(metrics, &options.title, out);
            }
            if checkpoint_due {
                ensure_finite(&model, state.step)?;
                state.elapsed_secs = clock.elapsed();
                clock.checkpoints.time(|| {
                    let snapshot = Snapshot::of(&model, &optim);
                    let keep = config.keep_checkpoints;
                    saving.start(out, &state, keep, improved, snapshot, |dir| {
                        task.write_files(dir)
                    })
                })?;
            }
        }
        // The other ranks wait for rank 0's evaluation and save, and learn whether it stops
        // the run early.
        if let Some(world) = world
            && (eval_due || checkpoint_due)
        {
            stopped_early =
                world.decide(&[stopped_early as u8 as f32], &device.clone().inner())?[0] > 0.0;
        }
        if interrupted && !done {
            bar.finish_and_clear();
            if let Some(metrics) = &metrics {
                draw_plot(metrics, &options.title, out);
            }
            if let Some(world) = world {
                world.finish();
            }
            return Err(TrainError::Interrupted {
                step: state.step,
                checkpoint: saving.wait()?,
            });
        }
        if stopped_early {
            break;
        }
    }
    bar.finish_and_clear();
    if let Some(metrics) = &metrics {
        draw_plot(metrics, &options.title, out);
    }
    if let Some(world) = world {
        world.finish();
    }
    let last_checkpoint = clock.checkpoints.time_more(|| saving.wait())?;
    let mut summary = clock.summary(state.step, last_checkpoint);
    summary.train_loss = train_loss;
    summary.val_loss = val_loss;
    summary.best = match main {
        true => checkpoint::resolve_best(out).ok().zip(best.loss()),
        false => None,
    };
    summary.stopped_early = stopped_early;
    summary.kernel_profile = profiler.and_then(KernelProfiler::finish);
    summary.device_memory = DeviceMemory::of(&device, (live > 0).then_some(live));
    Ok(summary)
}

/// A step's tokens and stop flags summed over the ranks (`[tokens, stop]` on the device), kept
/// until read.
#[derive(Default)]
struct Summed {
    unread: Option<Tensor<1>>,
}

impl Summed {
    /// Keeps this step's sums and reads the step before's: (tokens, whether any rank stops).
    fn push(&mut self, sums: Tensor<1>) -> Result<(usize, bool)> {
        let earlier = self.unread.replace(sums);
        Self::read(earlier)
    }

    /// Reads what is kept.
    fn drain(&mut self) -> Result<(usize, bool)> {
        Self::read(self.unread.take())
    }

    fn read(sums: Option<Tensor<1>>) -> Result<(usize, bool)> {
        let Some(sums) = sums else {
            return Ok((0, false));
        };
        let values = sums
            .try_into_vec_as::<f32>()
            .map_err(|e| TrainError::Distributed(format!("read the summed step: {e:?}")))?;
        Ok((values[0] as usize, values[1] > 0.0))
    }
}

/// Micro-batches each process runs a step: `grad_accum`, unless a checkpoint trained by another
/// number of processes is resumed, whose global batch is kept (`micro_batches / ranks` each,
/// which must divide evenly).
fn micro_batches_per_rank(
    state: &CheckpointState,
    grad_accum: u64,
    ranks: u64,
    say: bool,
) -> Result<u64> {
    let (saved, saved_ranks) = (state.micro_batches, state.world_size);
    if saved == 0 || saved_ranks == 0 || saved_ranks == ranks || saved == grad_accum * ranks {
        return Ok(grad_accum);
    }
    if !saved.is_multiple_of(ranks) {
        return Err(TrainError::Distributed(format!(
            "the checkpoint was trained by {saved_ranks} process(es) on {saved} micro-batches a \
             step, which {ranks} process(es) cannot share evenly: resume with a number of \
             processes that divides {saved}"
        )));
    }
    let per_rank = saved / ranks;
    if say {
        eprintln!(
            "note: the checkpoint was trained by {saved_ranks} process(es) on {saved} micro-batches \
             a step; {ranks} process(es) keep that batch with grad_accum {per_rank} each"
        );
    }
    Ok(per_rank)
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

/// Drops the weights' copies kept by mixed precision's steps when a run ends (returns or fails),
/// so that a process that goes on does not hold its weights' buffers.
struct ForgetWeightCopies;

impl Drop for ForgetWeightCopies {
    fn drop(&mut self) {
        ember_kernels::forget_weight_copies();
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
        micro_batches: 0,
        world_size: 0,
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
    if options.world.as_ref().is_none_or(|w| w.is_main()) {
        eprintln!("resuming from {} (step {})", dir.display(), saved.step);
    }
    saved.seed = config.seed;
    Ok((saved, model, optim, dir))
}
