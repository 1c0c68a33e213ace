//! What a training run is asked: its options and how it was launched.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::Device;

use crate::config::TrainingConfig;
use crate::distributed::World;
use crate::error::Result;
use crate::kernel_profile::KernelProfiler;

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
    /// Write no checkpoint at all, not even at the end (benchmarks that time steps alone).
    pub no_checkpoints: bool,
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
    /// This process's place in a run across processes ([`crate::distributed`]), if launched as
    /// one.
    pub world: Option<Arc<World>>,
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
    /// Write no checkpoint at all (benchmarks).
    pub no_checkpoints: bool,
    /// Draw a progress bar (when stderr is a terminal).
    pub progress: bool,
    /// Start from these weights instead of random ones (language models).
    pub init_from: Option<crate::init_from::InitFrom>,
    /// Stop at the end of the current step, with a checkpoint, once this is set.
    pub interrupt: Option<Arc<AtomicBool>>,
    /// Time every GPU kernel of the last this many steps (the summary's kernel profile).
    pub profile_steps: Option<u64>,
    /// This process's place in a run across processes, from the launcher's environment
    /// ([`crate::distributed::Ranks::from_env`]); `None` for one process.
    pub ranks: Option<crate::distributed::Ranks>,
}

/// What [`Launch::claim`] hands a task: its devices, the run folder (held by rank 0 alone
/// across processes) and the run's place across processes.
pub(crate) struct Claimed {
    pub devices: Vec<Device>,
    pub folder: Option<crate::run_folder::RunFolder>,
    pub world: Option<Arc<World>>,
}

impl Claimed {
    /// Whether this process logs, evaluates and writes the run folder (rank 0, or the only one).
    pub fn is_main(&self) -> bool {
        self.world.as_ref().is_none_or(|w| w.is_main())
    }

    /// The options of the run `launch` starts with `training`, its loss plot titled `title`,
    /// and the claimed folder (held until the run ends).
    pub fn run_options(
        self,
        launch: &Launch,
        training: TrainingConfig,
        title: String,
    ) -> (RunOptions, Option<crate::run_folder::RunFolder>) {
        let options = RunOptions {
            out_dir: launch.out_dir.clone(),
            training,
            devices: self.devices,
            world: self.world,
            resume: launch.resume,
            stop_after: launch.stop_after,
            no_checkpoints: launch.no_checkpoints,
            profile_steps: launch.profile_steps,
            progress: launch.progress,
            interrupt: launch.interrupt.clone(),
            title,
        };
        (options, self.folder)
    }
}

impl Launch {
    /// The step the run ends at: `max_steps`, or `stop_after` where that comes first.
    pub fn last_step(&self, max_steps: u64) -> u64 {
        self.stop_after.map_or(max_steps, |s| s.min(max_steps))
    }

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
    /// `training`, so the saved config names it), the meeting of the ranks where launched
    /// across processes (`fingerprint`: the run's config, equal on every rank), and the run
    /// folder, claimed by rank 0 before anything reads or writes it: locked for this process,
    /// and refused if it holds another run that this one would neither resume nor replace.
    pub(crate) fn claim(&self, training: &mut TrainingConfig, fingerprint: u64) -> Result<Claimed> {
        if let Some(name) = &self.device {
            training.device = name.clone();
        }
        if let Some(ranks) = &self.ranks {
            training.device = rank_device(&training.device, ranks)?;
        }
        let devices = training.devices(None)?;
        training.precision.check(&devices, &training.device)?;
        if let Some(warning) = training.precision.warning(&devices, &training.device) {
            eprintln!("{warning}");
        }
        if let Some(steps) = self.profile_steps {
            // Before the run folder is touched; a resumed run is checked again once its step
            // is known.
            let stop = self.last_step(training.max_steps);
            KernelProfiler::new(devices.clone(), &training.device, steps, 0, stop)?;
        }
        // Ranks meet before rank 0 claims the folder: a rank that fails then ends them all.
        let world = match &self.ranks {
            Some(ranks) => Some(Arc::new(World::join(
                ranks.clone(),
                &devices[0],
                &training.device,
                fingerprint,
            )?)),
            None => None,
        };
        let main = world.as_ref().is_none_or(|w| w.is_main());
        let folder = match main {
            true => Some(crate::run_folder::RunFolder::claim(
                &self.out_dir,
                self.reuse(),
            )?),
            false => None,
        };
        if let Some(world) = world.as_ref().filter(|w| w.is_main()) {
            eprintln!(
                "{} process{} ({}), collectives by {}",
                world.size(),
                if world.size() == 1 { "" } else { "es" },
                world.ranks.launcher,
                world.engine_name()
            );
        }
        Ok(Claimed {
            devices,
            folder,
            world,
        })
    }
}

/// The device of a rank: a CUDA device named without an index becomes `cuda:LOCAL_RANK` (one GPU
/// per process, as `torchrun` places them); several devices in one process are refused.
fn rank_device(name: &str, ranks: &crate::distributed::Ranks) -> Result<String> {
    if name.contains(',') {
        return Err(crate::error::TrainError::Distributed(format!(
            "device \"{name}\": a process launched by {} takes one device (each rank its own), \
             not a list",
            ranks.launcher
        )));
    }
    Ok(match name.trim() {
        "cuda" => format!("cuda:{}", ranks.local_rank),
        other => other.to_string(),
    })
}

impl RunOptions {
    /// Whether the interrupt flag (Ctrl-C, SIGTERM) is up.
    pub(super) fn interrupted(&self) -> bool {
        self.interrupt
            .as_ref()
            .is_some_and(|flag| flag.load(Ordering::Relaxed))
    }
}
