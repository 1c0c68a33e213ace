//! Dropout masks that are never stored: element `index` of a call is kept when a hash of the
//! call's seed and the index reaches a threshold, so the backward pass computes the mask again
//! from the seed alone. Used by the attention kernels (their weights) and the dropout kernel.
//!
//! The seed is the first 24 bits of a uniform number in `[0, 1)` drawn from the device's random
//! numbers (so [`crate::seed_random`] makes a run repeatable); element `index` is kept when
//! `mix(mix(seed) ^ index) >= p * 2^32`, and then multiplied by `1 / (1 - p)`.
//!
//! The seeds are drawn [`POOL_ROWS`] at a time, one random launch for that many calls (a
//! forward pass of nanoGPT's GPU config has 19 dropout and attention calls, which each
//! launched a draw of one number): each call reads the first value of its own row of the pool,
//! a view (rows as wide as the device's buffer alignment), so taking one launches nothing.
//! Seeding the random numbers through [`crate::seed_random`] empties the pools, so the calls
//! after it get the same seeds however many were taken before.

use burn::tensor::{Device, Distribution};
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use std::sync::Mutex;

/// Burn's tensor (CubeCL's prelude has a `Tensor` of its own, for the kernels below).
type Values = burn::tensor::Tensor<1>;

/// Seeds drawn per launch.
pub(crate) const POOL_ROWS: usize = 64;

/// One device's pool: its values (`[POOL_ROWS * width]`), the row width, and the next row.
struct Pool {
    device: Device,
    values: Values,
    width: usize,
    next: usize,
}

/// The devices' pools.
static POOLS: Mutex<Vec<Pool>> = Mutex::new(Vec::new());

/// A mask's seed for one call: a tensor whose first value is a uniform number in `[0, 1)` from
/// `device`'s random numbers (a row of the device's pool; `[1]` where a row would not be a view).
pub(crate) fn draw_seed(device: &Device) -> Values {
    let uniform = Distribution::Uniform(0.0, 1.0);
    let draw = |width: usize| Values::random([POOL_ROWS * width], uniform, device);
    let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    let pool = match pools.iter().position(|pool| &pool.device == device) {
        Some(at) => &mut pools[at],
        None => {
            let Some(width) = row_width(device) else {
                return Values::random([1], uniform, device);
            };
            pools.push(Pool {
                device: device.clone(),
                values: draw(width),
                width,
                next: 0,
            });
            pools.last_mut().expect("just pushed")
        }
    };
    if pool.next == POOL_ROWS {
        pool.values = draw(pool.width);
        pool.next = 0;
    }
    let (at, width) = (pool.next, pool.width);
    pool.next += 1;
    pool.values.clone().slice(at * width..(at + 1) * width)
}

/// Forgets every device's pool: the next seed on each is drawn afresh from the random numbers
/// (Burn's CubeCL backends keep one generator for the process, which seeding any device seeds).
pub(crate) fn forget_pools() {
    POOLS.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// Values of an `f32` row whose start and end are aligned as the device aligns buffers (so a
/// slice of whole rows is a view of the pool, not a copy); `None` off CubeCL.
fn row_width(device: &Device) -> Option<usize> {
    let gpu = super::cube_device(device)?;
    let alignment = gpu.client().properties().memory.alignment as usize;
    Some(alignment.div_ceil(4).max(1))
}

/// The hash threshold for dropping with probability `p`: `p * 2^32`, rounded (the CPU
/// kernel's).
pub(crate) use crate::kernels::dropout::threshold;

/// Chris Wellons' `lowbias32` integer hash (a bijection of `u32`), as the CPU kernel's
/// [`crate::kernels::dropout::mix`].
#[cube]
pub(crate) fn mix(x: u32) -> u32 {
    let mut x = x;
    x ^= x >> 16;
    x *= 0x7feb_352d;
    x ^= x >> 15;
    x *= 0x846c_a68b;
    x ^= x >> 16;
    x
}

/// The dropout mask of one kernel call.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct Mask<F: Float> {
    /// The seed's 24 bits, hashed.
    seed: u32,
    threshold: u32,
    keep_scale: F,
}

#[cube]
impl<F: Float> Mask<F> {
    /// The mask of `seed`'s first value, dropping below `threshold`, scaling the rest by
    /// `keep_scale`; without `dropout` (comptime) the seed is never read.
    pub(crate) fn new(
        seed: &Tensor<F>,
        threshold: u32,
        keep_scale: f32,
        #[comptime] dropout: bool,
    ) -> Mask<F> {
        let mut hashed = 0u32;
        if dropout {
            hashed = mix(u32::cast_from(seed[0] * F::new(16_777_216.0)));
        }
        Mask::<F> {
            seed: hashed,
            threshold,
            keep_scale: F::cast_from(keep_scale),
        }
    }

    /// What element `index` is multiplied by: 1 without dropout, else 0 or `keep_scale`.
    pub(crate) fn factor(&self, index: usize, #[comptime] dropout: bool) -> F {
        let mut factor = F::new(1.0);
        if dropout {
            factor = F::new(0.0);
            if mix(self.seed ^ (index as u32)) >= self.threshold {
                factor = self.keep_scale;
            }
        }
        factor
    }
}

/// For tests: the factors (0 or `1 / (1 - p)`) of elements `0..n` of the mask of `seed`,
/// computed on the host (the CPU kernel's mask: the same hash of the same seed).
#[cfg(test)]
#[cfg_attr(not(feature = "wgpu"), allow(dead_code))] // the tests that use it run on lavapipe
pub(crate) fn host_factors(seed: f32, p: f32, n: usize) -> Vec<f32> {
    use crate::kernels::dropout::{Mask, seed_of};
    let mask = Mask::new(seed_of(seed), p);
    (0..n).map(|index| mask.factor(index)).collect()
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn::backend::{BackendTensor, DispatchTensorKind};
    use burn::tensor::DeviceKind;

    /// The seeds of a run of calls: the first value of each, in `[0, 1)`, all different, the
    /// same after the same `seed_random` however many were drawn before (past a pool's end
    /// too), others after another seed; rows after the first are views of the pool (an offset
    /// into its buffer, not a copy).
    #[test]
    fn seeds_come_from_a_pool_and_repeat_after_seeding() {
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let n = POOL_ROWS + 6;
        let run = |seed: u64, before: usize| -> Vec<f32> {
            for _ in 0..before {
                draw_seed(&device);
            }
            crate::seed_random(&device, seed);
            (0..n)
                .map(|_| draw_seed(&device).slice(0..1).into_scalar::<f32>())
                .collect()
        };
        // Burn's CubeCL backends keep one generator for the process: a test drawing beside this
        // one between the seeding and the draws changes them (see `cube::dropout`'s tests).
        let (a, b) = (0..3)
            .map(|_| (run(3, 0), run(3, 5)))
            .find(|(a, b)| a == b)
            .expect("the same seed, other seeds, three times");
        assert_eq!(a, b);
        assert_ne!(a, run(4, 0), "another seed, the same seeds");
        assert!(a.iter().all(|s| (0.0..1.0).contains(s)), "{a:?}");
        let mut sorted = a.clone();
        sorted.sort_by(f32::total_cmp);
        sorted.dedup();
        assert_eq!(sorted.len(), n, "repeated seeds");
        crate::seed_random(&device, 3);
        let _first = draw_seed(&device);
        let second = draw_seed(&device);
        let width = row_width(&device).unwrap();
        let offset = match second.into_dispatch().kind {
            DispatchTensorKind::Autodiff(inner) => match *inner {
                DispatchTensorKind::Cube(BackendTensor::Autodiff(t)) => {
                    t.primitive().handle.offset_start
                }
                _ => panic!("a wgpu autodiff tensor"),
            },
            _ => panic!("a wgpu autodiff tensor"),
        };
        assert_eq!(offset, Some((width * 4) as u64), "the second row, a view");
    }
}
