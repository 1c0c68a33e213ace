//! What a training run is asked: its options and how it was launched.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::Device;

use crate::config::TrainingConfig;
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
    pub(super) fn interrupted(&self) -> bool {
        self.interrupt
            .as_ref()
            .is_some_and(|flag| flag.load(Ordering::Relaxed))
    }
}
