//! The training loop, shared by every task (language modelling, translation): AdamW, the
//! learning-rate schedule, gradient accumulation and clipping, evaluation, metrics, progress,
//! atomic checkpoints and resume.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::checkpoint::{self, CheckpointState, FORMAT_VERSION, MODEL_FILE, OPTIM_FILE};
use crate::config::TrainingConfig;
use crate::error::{Result, TrainError};
use crate::metrics::{Metrics, Record};
use crate::optimizer::{adamw, clip_global_norm};

/// Which part of the data an evaluation reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// The training split.
    Train,
    /// The held-out split.
    Val,
}

/// What the loop needs from a task: losses, evaluations and the files of a checkpoint.
pub trait Task: Sync {
    /// The model being trained.
    type Model: Module + Clone + Send;

    /// Loss of micro-batch `micro` of optimizer step `step`, with the batch built on `device`
    /// (the autodiff device `model` lives on), and the number of tokens it covers. The batch must
    /// depend only on `(seed, step, micro)`.
    fn train_loss(
        &self,
        model: &Self::Model,
        step: u64,
        micro: u64,
        device: &Device,
    ) -> (Tensor<1>, usize);

    /// Mean loss over `batches` batches of `split`, on a model without autodiff. The same
    /// batches every time, so evaluations are comparable.
    fn eval_loss(&self, model: &Self::Model, split: Split, batches: usize) -> f64;

    /// Extra figures printed at each evaluation (e.g. BLEU), as `(name, value)`.
    fn extra_eval(&self, _model: &Self::Model) -> Vec<(String, f64)> {
        Vec::new()
    }

    /// Writes the tokenizer(s) and the resolved config into a checkpoint folder.
    fn write_files(&self, dir: &Path) -> Result<()>;

    /// `decoder_only` or `encoder_decoder`, recorded in checkpoints.
    fn model_kind(&self) -> &'static str;
}

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
}

/// Salt that separates dropout seeds from batch seeds.
pub(crate) const DROPOUT_SALT: u64 = 0x0D20_0F00;

/// Trains `model` (built on `device.autodiff()`) on `task`. On resume, weights, optimizer state
/// and the step are read from the newest checkpoint in `options.out_dir`; batches, dropout and
/// the learning rate depend only on `(seed, step)`, so the resumed run continues exactly.
pub fn train<T: Task>(task: &T, mut model: T::Model, options: &RunOptions) -> Result<RunSummary> {
    let config = &options.training;
    let out = &options.out_dir;
    std::fs::create_dir_all(out).map_err(|e| crate::error::write_err(out, e))?;
    check_writable(out)?;
    let schedule = config.schedule();
    let mut state = CheckpointState {
        format_version: FORMAT_VERSION,
        model_kind: task.model_kind().to_string(),
        step: 0,
        seed: config.seed,
        tokens_seen: 0,
        elapsed_secs: 0.0,
        val_loss: None,
    };
    let mut last_checkpoint = PathBuf::new();
    // The optimizer is built from the model it will update: its weight-decay groups are keyed
    // by parameter id, and loading a checkpoint restores the ids its state was saved under.
    let mut optim;
    if options.resume {
        let dir = checkpoint::resolve(out)?;
        let saved = checkpoint::read_state(&dir)?;
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
        model = load_model(model, &dir)?;
        optim = load_optimizer(adamw(config, &model), &dir)?;
        eprintln!("resuming from {} (step {})", dir.display(), saved.step);
        state = saved;
        state.seed = config.seed;
        last_checkpoint = dir;
    } else {
        optim = adamw(config, &model);
    }
    let metrics = Metrics::open(out, options.resume.then_some(state.step))?;
    // The best validation loss so far and how many evaluations since have not beaten it; a
    // resumed run takes both from the `best` checkpoint and the metrics kept up to its step.
    let mut best = options
        .resume
        .then(|| checkpoint::best_val_loss(out))
        .flatten();
    let mut evals_since_best = match best {
        Some((_, best_step)) => crate::metrics::read(metrics.path())
            .iter()
            .filter(|r| r.kind == "eval" && r.step > best_step)
            .count() as u64,
        None => 0,
    };
    let mut stopped_early = false;
    let device = param_device(&model);
    let bar = progress_bar(config.max_steps, state.step, options.progress);

    let start = Instant::now();
    let start_step = state.step;
    let elapsed_before = state.elapsed_secs;
    let mut tokens_this_run = 0u64;
    let mut window = LogWindow::new(state.step);
    let (mut train_loss, mut val_loss) = (None, state.val_loss);
    let stop = options.stop_after.unwrap_or(u64::MAX).min(config.max_steps);

    while state.step < stop {
        let step = state.step;
        device.seed(ember_data::batch_seed(config.seed, step, DROPOUT_SALT));
        let (loss, tokens, mut grads) = if options.devices.len() > 1 {
            crate::parallel::accumulate(task, &model, step, config, &options.devices)
        } else {
            accumulate(task, &model, step, config.grad_accum)
        };
        let norm = clip_global_norm(&model, &mut grads, config.grad_clip);
        let lr = schedule.at(step);
        model = optim.step(lr, model, grads);
        state.step += 1;
        state.tokens_seen += tokens as u64;
        tokens_this_run += tokens as u64;
        window.push(loss, norm, tokens);

        let interrupted = options
            .interrupt
            .as_ref()
            .is_some_and(|flag| flag.load(Ordering::Relaxed));
        let done = state.step == stop;
        let mut checkpoint_due =
            state.step.is_multiple_of(config.checkpoint_interval) || done || interrupted;
        if state.step.is_multiple_of(config.log_interval) || checkpoint_due {
            let elapsed = elapsed_before + start.elapsed().as_secs_f64();
            let record = window.flush(state.step, lr, elapsed)?;
            bar.set_position(state.step);
            bar.set_message(format!(
                "loss {:.4} | {:.0} tok/s | lr {:.2e}",
                record.train_loss, record.tokens_per_sec, lr
            ));
            if bar.is_hidden() {
                // Off a terminal (a pipe, a file, nohup): a plain line instead of the bar.
                eprintln!(
                    "step {:>6}/{}: loss {:.4}, lr {lr:.2e}, {:.0} tok/s, {elapsed:.1} s",
                    state.step, config.max_steps, record.train_loss, record.tokens_per_sec
                );
            }
            metrics.append(&record)?;
        }
        let mut improved = false;
        if state.step.is_multiple_of(config.eval_interval) || state.step == config.max_steps {
            let eval_model = model.valid();
            let train = task.eval_loss(&eval_model, Split::Train, config.eval_batches);
            let val = task.eval_loss(&eval_model, Split::Val, config.eval_batches);
            let extra = task.extra_eval(&eval_model);
            let extra: String = extra.iter().map(|(k, v)| format!(", {k} {v:.2}")).collect();
            say(
                &bar,
                format!(
                    "step {:>6}: train loss {train:.4}, val loss {val:.4} (perplexity {:.2}){extra}",
                    state.step,
                    val.exp()
                ),
            );
            let elapsed = elapsed_before + start.elapsed().as_secs_f64();
            metrics.append(&Record {
                step: state.step,
                lr,
                train_loss: train,
                val_loss: Some(val),
                grad_norm: None,
                tokens_per_sec: tokens_this_run as f64 / start.elapsed().as_secs_f64().max(1e-9),
                elapsed_secs: elapsed,
                kind: "eval".into(),
            })?;
            (train_loss, val_loss) = (Some(train), Some(val));
            state.val_loss = val_loss;
            // Every improvement is saved, so the best model is on disk however late the run
            // overfits (nanoGPT's GPU config does after about 2000 of its 5000 steps).
            improved = best.is_none_or(|(b, _)| val < b);
            if improved {
                best = Some((val, state.step));
                evals_since_best = 0;
                checkpoint_due = true;
            } else {
                evals_since_best += 1;
            }
            if let Some(patience) = config.early_stop_patience
                && evals_since_best >= patience
            {
                let (b, at) = best.expect("an evaluation happened");
                say(
                    &bar,
                    format!(
                        "early stop: val loss has not improved on {b:.4} (step {at}) in {patience} evaluations"
                    ),
                );
                stopped_early = true;
                checkpoint_due = true;
            }
            draw_plot(&metrics, &options.title, out);
        }
        if checkpoint_due {
            ensure_finite(&model, state.step)?;
            state.elapsed_secs = elapsed_before + start.elapsed().as_secs_f64();
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
    let run_secs = start.elapsed().as_secs_f64();
    draw_plot(&metrics, &options.title, out);
    let steps = (state.step - start_step).max(1) as f64;
    Ok(RunSummary {
        step: state.step,
        train_loss,
        val_loss,
        elapsed_secs: elapsed_before + run_secs,
        tokens_per_sec: tokens_this_run as f64 / run_secs.max(1e-9),
        ms_per_step: 1000.0 * run_secs / steps,
        checkpoint: last_checkpoint,
        best: checkpoint::resolve_best(out)
            .ok()
            .zip(best.map(|(loss, _)| loss)),
        stopped_early,
    })
}

/// Redraws `loss.png` from the metrics so far (at every evaluation, so that a running or
/// killed job has a current plot).
fn draw_plot(metrics: &Metrics, title: &str, out: &Path) {
    let records = crate::metrics::read(metrics.path());
    if let Err(e) = crate::plot::loss_curves(&records, title, &out.join("loss.png")) {
        eprintln!("warning: no loss plot: {e}");
    }
}

/// Forward and backward over `n` micro-batches; the loss is their mean.
fn accumulate<T: Task>(
    task: &T,
    model: &T::Model,
    step: u64,
    n: usize,
) -> (Tensor<1>, usize, GradientsParams) {
    let device = param_device(model);
    if n == 1 {
        let (loss, tokens) = task.train_loss(model, step, 0, &device);
        let grads = GradientsParams::from_grads(loss.backward(), model);
        return (loss.detach(), tokens, grads);
    }
    combine(
        model,
        (0..n as u64).map(|micro| {
            let (loss, tokens) = task.train_loss(model, step, micro, &device);
            let loss = loss.div_scalar(n as f64);
            let grads = GradientsParams::from_grads(loss.backward(), model);
            (loss.detach(), tokens, grads)
        }),
    )
}

/// Sums micro-batches' (loss, tokens, gradients), in the order given: the step's loss (each
/// micro-batch loss already divided by their number), tokens and gradients.
pub(crate) fn combine<M: Module>(
    model: &M,
    micros: impl IntoIterator<Item = (Tensor<1>, usize, GradientsParams)>,
) -> (Tensor<1>, usize, GradientsParams) {
    let mut acc = GradientsAccumulator::<M>::new();
    let mut total: Option<Tensor<1>> = None;
    let mut tokens = 0;
    for (loss, t, grads) in micros {
        acc.accumulate(model, grads);
        total = Some(match total {
            Some(sum) => sum + loss,
            None => loss,
        });
        tokens += t;
    }
    (
        total.expect("at least one micro-batch"),
        tokens,
        acc.grads(),
    )
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
        let losses = read_all(std::mem::take(&mut self.losses));
        let norms = read_all(std::mem::take(&mut self.norms));
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

fn read_all(values: Vec<Tensor<1>>) -> Vec<f32> {
    if values.is_empty() {
        return Vec::new();
    }
    Tensor::cat(values, 0)
        .try_into_vec_as::<f32>()
        .unwrap_or_default()
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
    let total: f32 = read_all(finite.0).iter().sum();
    if total.is_finite() {
        Ok(())
    } else {
        Err(TrainError::Diverged { step, loss: total })
    }
}

fn param_device<M: Module>(model: &M) -> Device {
    model
        .devices()
        .into_iter()
        .next()
        .expect("a model has parameters on some device")
}

fn save_weights<M: Module>(model: &M, optim: &ModuleOptimizer, dir: &Path) -> Result<()> {
    let model_path = dir.join(MODEL_FILE);
    model
        .clone()
        .save_file(&model_path)
        .map_err(|e| crate::error::write_err(&model_path, e))?;
    let optim_path = dir.join(OPTIM_FILE);
    optim
        .save(&optim_path)
        .map_err(|e| crate::error::write_err(&optim_path, e))
}

/// Loads the optimizer state of checkpoint `dir`.
fn load_optimizer(optim: ModuleOptimizer, dir: &Path) -> Result<ModuleOptimizer> {
    let path = dir.join(OPTIM_FILE);
    optim.load(&path).map_err(|e| TrainError::Checkpoint {
        path: path.clone(),
        message: format!("cannot load optimizer state: {e}"),
    })
}

/// Loads the weights of checkpoint `dir` into a model built from the checkpoint's config.
pub fn load_model<M: Module>(model: M, dir: &Path) -> Result<M> {
    let path = dir.join(MODEL_FILE);
    if !path.is_file() {
        return Err(TrainError::Checkpoint {
            path,
            message: "missing model weights".into(),
        });
    }
    model.try_load_file(&path).map_err(|e| {
        let mut message = format!(
            "cannot load model weights: {}",
            summarize_record_error(&e.to_string())
        );
        if let Some(older) = crate::checkpoint::older_complete(dir) {
            message += &format!("; an older checkpoint is {}", older.display());
        }
        TrainError::Checkpoint { path, message }
    })
}

/// Burn's record errors list every tensor at fault; keep the count and the first one.
fn summarize_record_error(message: &str) -> String {
    let kinds = [
        ("Apply errors: ", "do not match this model"),
        ("Missing tensors: ", "are missing"),
        ("Unused tensors: ", "are not part of this model"),
    ];
    for (marker, what) in kinds {
        let Some(at) = message.find(marker) else {
            continue;
        };
        let list = message[at + marker.len()..]
            .trim()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let items: Vec<&str> = list
            .split("\", \"")
            .map(|item| item.trim_matches('"'))
            .filter(|item| !item.is_empty())
            .collect();
        let first = items
            .first()
            .unwrap_or(&"")
            .replace("Shape { dims: ", "")
            .replace(" }", "");
        return format!(
            "{} tensor(s) {what} (weights of another architecture, or a config.toml that does not belong to them?); first: {first}",
            items.len()
        );
    }
    message.to_string()
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
