//! Rotary positions (RoPE, Su et al. 2021): queries and keys turned by an angle proportional to
//! their position, inside attention, so that their dot product depends on the offset alone.

// The rotation itself lives with the rotary op and its kernels, which apply it in place.
pub use crate::ops::rotation::{Rope, RopeScaling, apply_rotary, rotate_by};

use burn::tensor::Tensor;

use crate::ops::{self, RotaryAt};

/// A fused `[Q | K | V]` projection with the first `turned` dimensions of each query and key
/// head rotated by their positions (`at`), the rest of each head and the values as they were:
/// GPT-NeoX's partial rotation (`rotary_pct`; Pythia turns a quarter of each head). The leading
/// parts are gathered into a narrower `[Q | K | V]` (its V part a stand-in), rotated by the
/// rotary op as whole heads of that width (angles `pos * base^(-2i / turned)`, stretched where
/// `rope` says so), and put back.
///
/// # Shapes
/// - qkv, output: `[B, T, 3D]`, `H` heads of `K = D / H` each, `turned <= K` and even
pub fn rotate_leading(
    qkv: Tensor<3>,
    heads: usize,
    turned: usize,
    at: RotaryAt,
    rope: Rope,
) -> Tensor<3> {
    let [b, t, d3] = qkv.dims();
    let (d, h) = (d3 / 3, heads);
    let k = d / h;
    let part = |i: usize| {
        qkv.clone()
            .slice([0..b, 0..t, i * d..(i + 1) * d])
            .reshape([b, t, h, k])
    };
    let (q, key) = (part(0), part(1));
    let lead = |x: &Tensor<4>| {
        x.clone()
            .slice([0..b, 0..t, 0..h, 0..turned])
            .reshape([b, t, h * turned])
    };
    let narrow = Tensor::cat(vec![lead(&q), lead(&key), lead(&q)], 2);
    let rotated = ops::rotate_qk_at(narrow, h, at, rope);
    let back = |i: usize, x: Tensor<4>| {
        let turned_part = rotated
            .clone()
            .slice([0..b, 0..t, i * h * turned..(i + 1) * h * turned])
            .reshape([b, t, h, turned]);
        let rest = x.slice([0..b, 0..t, 0..h, turned..k]);
        Tensor::cat(vec![turned_part, rest], 3).reshape([b, t, d])
    };
    let v = qkv.slice([0..b, 0..t, 2 * d..3 * d]);
    Tensor::cat(vec![back(0, q), back(1, key), v], 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution, Tensor};

    fn norms(x: Tensor<4>) -> Vec<f32> {
        x.powi_scalar(2)
            .sum_dim(3)
            .sqrt()
            .try_into_vec_as::<f32>()
            .unwrap()
    }

    #[test]
    fn rotary_preserves_norms() {
        let device = Device::flex();
        let x = Tensor::<4>::random([2, 3, 5, 8], Distribution::Normal(0.0, 1.0), &device);
        let before = norms(x.clone());
        let after = norms(apply_rotary(x, 7, 10000.0));
        for (a, b) in before.iter().zip(&after) {
            assert!((a - b).abs() < 1e-4, "norm {a} became {b}");
        }
    }

    /// q . k after rotating q to position m and k to position n.
    fn rotated_dot(q: &Tensor<4>, k: &Tensor<4>, m: usize, n: usize) -> f32 {
        let q = apply_rotary(q.clone(), m, 10000.0);
        let k = apply_rotary(k.clone(), n, 10000.0);
        (q * k).sum().into_scalar::<f32>()
    }

    #[test]
    fn rotary_dot_product_depends_only_on_offset() {
        let device = Device::flex();
        let q = Tensor::<4>::random([1, 1, 1, 8], Distribution::Normal(0.0, 1.0), &device);
        let k = Tensor::<4>::random([1, 1, 1, 8], Distribution::Normal(0.0, 1.0), &device);
        let base = rotated_dot(&q, &k, 5, 2);
        for shift in [1, 10, 100] {
            let shifted = rotated_dot(&q, &k, 5 + shift, 2 + shift);
            assert!(
                (base - shifted).abs() < 1e-3,
                "offset 3: {base} vs {shifted}"
            );
        }
        // A different offset gives a different product: the rotation is not a no-op.
        let other = rotated_dot(&q, &k, 9, 2);
        assert!((base - other).abs() > 1e-4);
    }
}
