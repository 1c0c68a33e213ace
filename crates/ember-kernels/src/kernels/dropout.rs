//! Dropout with a hashed mask, over plain `f32` slices: element `index` of a call is kept when
//! `mix(mix(seed) ^ index) >= p * 2^32` and then multiplied by `1 / (1 - p)`, dropped (zeroed)
//! otherwise. The mask is a function of the call's seed and each element's index, so nothing
//! but the seed is kept for the backward pass, which applies the same factors to the gradient
//! (dropout is linear in its input). It is the GPU kernels' mask (`cube::hashed_mask`), the same
//! hash of the same 24-bit seed, so one seed drops the same elements on every backend.
//!
//! Burn's `Dropout` draws a Bernoulli tensor (a ChaCha random number per element), multiplies
//! by it and by `1 / (1 - p)`, and keeps the mask and a product for the backward pass: on a
//! 2-core CPU about a sixth of a training step of `configs/multi30k-de-en-2h.toml`
//! (docs/benchmarks.md). Here a few integer operations per element, in one pass each way.

use crate::kernels::vector_math::multiversion;

/// Chris Wellons' `lowbias32` integer hash (a bijection of `u32`), as `cube::hashed_mask::mix`.
#[inline(always)]
pub fn mix(x: u32) -> u32 {
    let mut x = x;
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// The hash threshold for dropping with probability `p`: `p * 2^32`, rounded.
pub fn threshold(p: f32) -> u32 {
    (p as f64 * 4_294_967_296.0).round().min(u32::MAX as f64) as u32
}

/// The seed of a mask from a uniform number `u` in `[0, 1)`: its first 24 bits, as the GPU
/// kernels read their seed.
pub fn seed_of(u: f32) -> u32 {
    (u * 16_777_216.0) as u32
}

/// One call's mask: which elements are kept, and the factor they are multiplied by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mask {
    /// The seed, hashed once.
    seed: u32,
    threshold: u32,
    keep_scale: f32,
}

impl Mask {
    /// The mask of `seed` dropping with probability `p` (in `(0, 1)`).
    pub fn new(seed: u32, p: f32) -> Self {
        Self {
            seed: mix(seed),
            threshold: threshold(p),
            keep_scale: 1.0 / (1.0 - p),
        }
    }

    /// What element `index` is multiplied by: 0, or `1 / (1 - p)`.
    #[inline(always)]
    pub fn factor(&self, index: usize) -> f32 {
        match mix(self.seed ^ index as u32) >= self.threshold {
            true => self.keep_scale,
            false => 0.0,
        }
    }

    /// `xs[i] *= factor(first + i)`: the forward pass on an input, or the backward pass on its
    /// gradient, in place.
    pub fn apply_in_place(&self, xs: &mut [f32], first: usize) {
        apply_in_place(*self, xs, first)
    }

    /// `out[i] = xs[i] * factor(first + i)`; the slices have the same length.
    pub fn apply_into(&self, xs: &[f32], out: &mut [f32], first: usize) {
        apply_into(*self, xs, out, first)
    }
}

multiversion! {
    /// [`Mask::apply_in_place`].
    pub fn apply_in_place(mask: Mask, xs: &mut [f32], first: usize) {
        for (i, x) in xs.iter_mut().enumerate() {
            *x *= mask.factor(first + i);
        }
    }
}

multiversion! {
    /// [`Mask::apply_into`].
    pub fn apply_into(mask: Mask, xs: &[f32], out: &mut [f32], first: usize) {
        for (i, (o, &x)) in out.iter_mut().zip(xs).enumerate() {
            *o = x * mask.factor(first + i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hash a bijection on a sample; each mask dropping about `p`, scaling the rest, the
    /// same through both paths and element by element; other seeds and offsets, other masks.
    #[test]
    fn the_mask_drops_about_p_and_scales_the_rest() {
        let mut seen: Vec<u32> = (0..10_000).map(mix).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 10_000);

        for p in [0.1f32, 0.5, 0.9] {
            let mask = Mask::new(seed_of(0.3725), p);
            let n = 200_000;
            let xs: Vec<f32> = (0..n).map(|i| 1.0 + i as f32 * 1e-6).collect();
            let mut ys = xs.clone();
            mask.apply_in_place(&mut ys, 7);
            let mut into = vec![f32::NAN; n];
            mask.apply_into(&xs, &mut into, 7);
            assert_eq!(ys, into);
            let dropped = ys.iter().filter(|&&y| y == 0.0).count() as f32 / n as f32;
            assert!((dropped - p).abs() < 0.01, "p {p}: dropped {dropped}");
            for (i, (&x, &y)) in xs.iter().zip(&ys).enumerate() {
                assert!(y == 0.0 || y == x * (1.0 / (1.0 - p)), "element {i}");
                assert_eq!(y, x * mask.factor(7 + i));
            }
        }
        // Another seed, another mask; the offset moves the mask along the elements.
        let (a, b) = (Mask::new(1, 0.5), Mask::new(2, 0.5));
        let differ = (0..1000).filter(|&i| a.factor(i) != b.factor(i)).count();
        assert!(differ > 400, "{differ}");
        let mut shifted = vec![1.0f32; 100];
        a.apply_in_place(&mut shifted, 50);
        assert!((0..100).all(|i| shifted[i] == a.factor(50 + i)));
    }
}
