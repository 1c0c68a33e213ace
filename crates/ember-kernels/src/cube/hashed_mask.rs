//! Dropout masks that are never stored: element `index` of a call is kept when a hash of the
//! call's seed and the index reaches a threshold, so the backward pass computes the mask again
//! from the seed alone. Used by the attention kernels (their weights) and the dropout kernel.
//!
//! The seed is the first 24 bits of a uniform number in `[0, 1)` drawn from the device's random
//! numbers (so `Device::seed` makes a run repeatable); element `index` is kept when
//! `mix(mix(seed) ^ index) >= p * 2^32`, and then multiplied by `1 / (1 - p)`.

use burn::tensor::{Device, Distribution};
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;

/// A mask's seed for one call: a uniform number in `[0, 1)` from `device`'s random numbers.
pub(crate) fn draw_seed(device: &Device) -> burn::tensor::Tensor<1> {
    burn::tensor::Tensor::<1>::random([1], Distribution::Uniform(0.0, 1.0), device)
}

/// The hash threshold for dropping with probability `p`: `p * 2^32`, rounded.
pub(crate) fn threshold(p: f32) -> u32 {
    (p as f64 * 4_294_967_296.0).round().min(u32::MAX as f64) as u32
}

/// Chris Wellons' `lowbias32` integer hash (a bijection of `u32`).
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
/// computed on the host.
#[cfg(test)]
#[cfg_attr(not(feature = "wgpu"), allow(dead_code))] // the tests that use it run on lavapipe
pub(crate) fn host_factors(seed: f32, p: f32, n: usize) -> Vec<f32> {
    fn mix(mut x: u32) -> u32 {
        x ^= x >> 16;
        x = x.wrapping_mul(0x7feb_352d);
        x ^= x >> 15;
        x = x.wrapping_mul(0x846c_a68b);
        x ^= x >> 16;
        x
    }
    let hashed = mix((seed * 16_777_216.0) as u32);
    let threshold = threshold(p);
    (0..n)
        .map(|index| {
            let keep = mix(hashed ^ index as u32) >= threshold;
            if keep { 1.0 / (1.0 - p) } else { 0.0 }
        })
        .collect()
}
