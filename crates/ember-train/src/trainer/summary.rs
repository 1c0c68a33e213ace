//! What a training run reports when it ends: its summary and the device's memory.

use std::path::PathBuf;

use burn::tensor::Device;

use crate::kernel_profile::KernelProfile;

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
    /// The evaluations this process ran, and their wall time (inside `elapsed_secs`).
    pub evaluations: TimeSpent,
    /// The checkpoints this process saved, and the wall time training waited for them (inside
    /// `elapsed_secs`: reading the weights from the device, and waiting for a checkpoint that
    /// its thread was still writing; the writing itself goes on beside the steps).
    pub checkpoints: TimeSpent,
}

/// How many times something ran in a run, and the wall seconds it took in all.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TimeSpent {
    /// Times it ran.
    pub count: u64,
    /// Wall seconds, all of them together.
    pub secs: f64,
}

impl TimeSpent {
    /// `work`, counted and timed.
    pub(crate) fn time<R>(&mut self, work: impl FnOnce() -> R) -> R {
        self.count += 1;
        self.time_more(work)
    }

    /// `work`, timed as part of what ran before (not counted again).
    pub(crate) fn time_more<R>(&mut self, work: impl FnOnce() -> R) -> R {
        let start = std::time::Instant::now();
        let done = work();
        self.secs += start.elapsed().as_secs_f64();
        done
    }
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
