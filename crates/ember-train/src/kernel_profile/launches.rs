//! One profiled step's launches: each kernel's part and device times, the gaps between them.

use std::collections::HashMap;
use std::time::Duration;

use super::Part;
use super::report::{KernelProfile, KernelTime};

/// One launch of a profiled step: its kernel, the part that issued it, its window on the
/// device from the step's start (on the host clock) where the backend gave timestamps, and its
/// device time.
pub(super) type Launch = (&'static str, Part, Option<(Duration, Duration)>, Duration);

/// The launches of one profiled step, resolved.
#[derive(Default)]
pub(super) struct StepLaunches {
    pub(super) timed: Vec<Launch>,
    /// Work queued outside CubeCL (cuBLAS's products) with its device time: inside the windows
    /// of the CubeCL kernels around it, so it adds to the busy time, not to the span.
    pub(super) external: Vec<(&'static str, Part, Duration)>,
    pub(super) unmeasured: u64,
    /// How they were timed (`device`, `system`), each once.
    pub(super) methods: Vec<String>,
}

impl StepLaunches {
    #[cfg_attr(
        not(any(feature = "wgpu", feature = "vulkan", feature = "cuda")),
        allow(dead_code)
    )]
    pub(super) fn note(&mut self, method: String) {
        if !self.methods.contains(&method) {
            self.methods.push(method);
        }
    }

    pub(super) fn add_to(self, profile: &mut KernelProfile) {
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
pub(super) fn short_name(kernel: &str) -> String {
    let head = kernel.split('<').next().unwrap_or(kernel);
    head.rsplit("::").next().unwrap_or(head).trim().to_string()
}
