//! The host memory a training run on CPU devices is sure to need, checked before the model's
//! parameters are allocated. A run that cannot fit is refused in one line naming the settings
//! that size it; without the check it would grind through swap-less memory until the operating
//! system's out-of-memory killer ended it (or another process) minutes later.
//!
//! The estimate is a lower bound, not a forecast: what Burn's autodiff certainly keeps. A run
//! under it may still not fit; a run over it cannot.

use crate::error::{Result, TrainError};

/// What a training run holds at least, in bytes, split for the message.
#[derive(Debug, Clone, PartialEq)]
pub struct Needs {
    /// Parameters of the model.
    pub params: usize,
    /// Parameters whose weights are already in memory (a model loaded from a checkpoint):
    /// counted for their gradients and moments only.
    pub loaded: bool,
    /// AdamW's moments are held while a forward pass keeps its activations: the run takes
    /// more than one step, or resumes with its moments loaded.
    pub moments_in_forward: bool,
    /// Activations the backward pass of one micro-batch reads, on each device at once.
    pub activations: u64,
    /// CPU devices training at once ([`cpu_devices`]), each with its own micro-batch's
    /// activations; none: nothing to check.
    pub devices: usize,
    /// What sizes the activations, in config keys (for the message).
    pub batch: String,
    /// The config keys that size the run, for the message's advice.
    pub keys: String,
}

impl Needs {
    /// Weights, gradients and AdamW's two moments, all `f32`: 16 bytes a parameter.
    pub fn state_bytes(&self) -> u64 {
        self.params as u64 * 16
    }

    /// The least the run's peak can be, less the weights already loaded. All `f32`, 4 bytes a
    /// value: when AdamW first steps, the weights, gradients and two moments (16 a parameter);
    /// while a later step's backward pass starts, the weights and moments (12) and every
    /// device's activations. (The gradients grow as the activations are freed, so the two
    /// need not meet.) Without moments yet, the weights and the activations.
    pub fn bytes(&self) -> u64 {
        let p = self.params as u64;
        let held = if self.moments_in_forward {
            12 * p
        } else {
            4 * p
        };
        let peak = self
            .state_bytes()
            .max(held + self.activations * self.devices as u64);
        if self.loaded { peak - 4 * p } else { peak }
    }
}

/// A lower bound on what the backward pass of a stack of transformer layers reads, in bytes:
/// for each of `tokens` positions and each of `layers`, the input of the first LayerNorm (`f32`),
/// the queries, keys and values and the MLP's hidden activations (in the products' type,
/// `product_bytes` a value); and the logits over `vocab` (`f32`) the loss's gradient starts
/// from. Attention scores are not counted (flex runs them in blocks of query rows).
pub fn activation_bytes(
    tokens: u64,
    layers: usize,
    d_model: usize,
    d_ff: usize,
    vocab: usize,
    product_bytes: u64,
) -> u64 {
    let per_layer = 4 * d_model as u64 + product_bytes * (3 * d_model + d_ff) as u64;
    tokens * (layers as u64 * per_layer + 4 * vocab as u64)
}

/// Refuses a run whose lower bound exceeds what `available` bytes can hold (`None`: unknown,
/// nothing checked).
pub fn check(needs: &Needs, available: Option<u64>) -> Result<()> {
    let Some(available) = available else {
        return Ok(());
    };
    if needs.bytes() <= available {
        return Ok(());
    }
    let devices = match needs.devices {
        1 => String::new(),
        n => format!(" on each of {n} devices"),
    };
    let loaded = if needs.loaded {
        " (its weights already loaded)"
    } else {
        ""
    };
    Err(TrainError::Memory(format!(
        "this run needs at least {} more memory{loaded} and {} is free: its {} parameters \
         take {} with their gradients and AdamW's two moments, and a micro-batch{devices} of \
         {} keeps at least {} of activations beside the weights and moments; lower {}",
        gb(needs.bytes()),
        gb(available),
        ember_model::summary::thousands(needs.params),
        gb(needs.state_bytes()),
        needs.batch,
        gb(needs.activations),
        needs.keys,
    )))
}

/// How many of `devices` are CPU devices, the ones whose memory this check is about: a GPU's
/// memory is its own, and a GPU backend reports its own allocation failures.
pub fn cpu_devices(devices: &[burn::tensor::Device]) -> usize {
    devices
        .iter()
        .filter(|d| !ember_kernels::on_cubecl(d))
        .count()
}

/// Checks `needs` against the memory free now, where the run trains on CPU devices.
pub fn check_run(needs: &Needs) -> Result<()> {
    match needs.devices {
        0 => Ok(()),
        _ => check(needs, available()),
    }
}

/// `bytes` in gigabytes (10^9), or in megabytes or kilobytes below one.
fn gb(bytes: u64) -> String {
    match bytes {
        1_000_000_000.. => format!("{:.1} GB", bytes as f64 / 1e9),
        1_000_000.. => format!("{:.0} MB", bytes as f64 / 1e6),
        _ => format!("{:.0} KB", bytes as f64 / 1e3),
    }
}

/// The host memory this process can still take, in bytes: the kernel's `MemAvailable` and free
/// swap, no more than its control group's limit less what the group uses (cgroup v2 or v1).
/// `None` where `/proc/meminfo` cannot be read (not Linux).
pub fn available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let free =
        meminfo_bytes(&meminfo, "MemAvailable")? + meminfo_bytes(&meminfo, "SwapFree").unwrap_or(0);
    Some(match cgroup_room() {
        Some(room) => free.min(room),
        None => free,
    })
}

/// The value of `key` in `/proc/meminfo`'s text, in bytes (the file says kB).
fn meminfo_bytes(meminfo: &str, key: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kb * 1024)
    })
}

/// The control group's limit less its usage, where the group has a limit.
fn cgroup_room() -> Option<u64> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let read =
        |path: String| -> Option<u64> { std::fs::read_to_string(path).ok()?.trim().parse().ok() };
    for line in groups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let (limit, usage) = match controllers {
            // v2: "max" (no limit) does not parse.
            "" => (
                read(format!("/sys/fs/cgroup{path}/memory.max")),
                read(format!("/sys/fs/cgroup{path}/memory.current")),
            ),
            c if c.split(',').any(|c| c == "memory") => (
                read(format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")),
                read(format!("/sys/fs/cgroup/memory{path}/memory.usage_in_bytes")),
            ),
            _ => continue,
        };
        // v1 writes "no limit" as a number near 2^63.
        if let (Some(limit), Some(usage)) = (limit, usage)
            && limit < 1 << 60
        {
            return Some(limit.saturating_sub(usage));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn needs(params: usize, activations: u64) -> Needs {
        Needs {
            params,
            loaded: false,
            moments_in_forward: true,
            activations,
            devices: 1,
            batch: "training.batch_size = 8 x model.context_len = 32 tokens".into(),
            keys: "model.d_model or training.batch_size".into(),
        }
    }

    #[test]
    fn a_run_over_the_free_memory_is_refused_with_its_sizes() {
        // 3G parameters: 48 GB with gradients and moments; 36 GB of weights and moments
        // beside 20 GB of activations.
        let n = needs(3_000_000_000, 20_000_000_000);
        assert_eq!(n.bytes(), 56_000_000_000);
        assert!(check(&n, Some(56_000_000_000)).is_ok());
        let message = check(&n, Some(55_999_999_999)).unwrap_err().to_string();
        assert_eq!(
            message,
            "this run needs at least 56.0 GB more memory and 56.0 GB is free: its \
             3,000,000,000 parameters take 48.0 GB with their gradients and AdamW's two \
             moments, and a micro-batch of training.batch_size = 8 x model.context_len = 32 \
             tokens keeps at least 20.0 GB of activations beside the weights and moments; lower \
             model.d_model or training.batch_size"
        );
        // Unknown free memory: nothing to check against.
        assert!(check(&n, None).is_ok());
    }

    #[test]
    fn the_peak_is_the_larger_of_the_first_update_and_a_later_forward_pass() {
        // Few activations: AdamW's first step, 16 bytes a parameter, is the peak.
        assert_eq!(needs(1_000, 100).bytes(), 16_000);
        // Many: weights and moments (12 bytes a parameter) beside them.
        assert_eq!(needs(1_000, 10_000).bytes(), 22_000);
        // A run of one step from scratch holds no moments in its forward pass.
        let mut once = needs(1_000, 20_000);
        assert_eq!(once.bytes(), 32_000);
        once.moments_in_forward = false;
        assert_eq!(once.bytes(), 24_000);
        // Weights already loaded are in use already, not needed anew.
        let mut loaded = needs(1_000, 10_000);
        loaded.loaded = true;
        assert_eq!(loaded.bytes(), 18_000);
        assert!(
            check(&loaded, Some(17_999))
                .unwrap_err()
                .to_string()
                .contains("needs at least 18 KB more memory (its weights already loaded)")
        );
        // Each device keeps its own micro-batch's activations.
        let mut three = needs(1_000, 10_000);
        three.devices = 3;
        assert_eq!(three.bytes(), 42_000);
        let message = check(&three, Some(41_999)).unwrap_err().to_string();
        assert!(
            message.contains("a micro-batch on each of 3 devices of"),
            "{message}"
        );
    }

    #[test]
    fn activations_count_each_layer_and_the_logits() {
        // 2 tokens, 3 layers of width 4 and MLP 16, vocabulary 10, f32 products:
        // per layer 4*4 + 4*(12 + 16) = 128 bytes a token; logits 40.
        assert_eq!(activation_bytes(2, 3, 4, 16, 10, 4), 2 * (3 * 128 + 40));
        // bf16 products halve the queries, keys, values and hidden activations only.
        assert_eq!(
            activation_bytes(2, 3, 4, 16, 10, 2),
            2 * (3 * (16 + 56) + 40)
        );
    }

    #[test]
    fn meminfo_values_are_read_in_bytes() {
        let text = "MemTotal:       24576000 kB\nMemAvailable:   1000 kB\nSwapFree:  0 kB\n";
        assert_eq!(meminfo_bytes(text, "MemAvailable"), Some(1_024_000));
        assert_eq!(meminfo_bytes(text, "SwapFree"), Some(0));
        assert_eq!(meminfo_bytes(text, "Mem"), None);
        assert_eq!(meminfo_bytes(text, "Cached"), None);
    }

    #[test]
    fn this_machine_reports_some_free_memory() {
        if cfg!(target_os = "linux") {
            let free = available().expect("/proc/meminfo on Linux");
            assert!(free > 0);
        }
    }
}
