//! Rotary positions (RoPE, Su et al. 2021): queries and keys turned by an angle proportional to
//! their position, inside attention, so that their dot product depends on the offset alone.

use burn::tensor::Tensor;

use super::sinusoidal::angles;

/// Rotary position embedding applied to queries or keys.
///
/// Pairs dimension `i` with `i + K/2` (the "rotate half" layout of GPT-NeoX and LLaMA) and
/// rotates each pair by `pos * base^(-2i/K)`. Because a rotation by `a` then the transpose of a
/// rotation by `b` is a rotation by `a - b`, `q_m . k_n` depends only on `m - n`.
///
/// # Shapes
/// - x: `[B, H, T, K]` (K even), holding positions `start..start + T`
/// - output: `[B, H, T, K]`
pub fn apply_rotary(x: Tensor<4>, start: usize, base: f64) -> Tensor<4> {
    apply_rotary_from(x, start as i64, base)
}

/// [`apply_rotary`] from a position that may be negative (the padding before a left-padded
/// sequence, which attention masks out).
pub(crate) fn apply_rotary_from(x: Tensor<4>, start: i64, base: f64) -> Tensor<4> {
    let [_, _, t, k] = x.dims();
    let half = k / 2;
    let device = x.device();
    let angles = angles(start, t, half, base, k as f64, &device); // [T, K/2]
    rotate_by(x, angles.clone().cos(), angles.sin())
}

/// `x` turned by the angles whose `cos` and `sin` are given per position: what
/// [`apply_rotary`] does once it has them (a decoding step replayed at any position reads them
/// from tables of every position, [`super::StepPosition`]).
///
/// # Shapes
/// - x: `[B, H, T, K]` (K even)
/// - cos, sin: `[T, K/2]`
/// - output: `[B, H, T, K]`
pub fn rotate_by(x: Tensor<4>, cos: Tensor<2>, sin: Tensor<2>) -> Tensor<4> {
    let [b, h, t, k] = x.dims();
    let half = k / 2;
    let cos = cos.reshape([1, 1, t, half]);
    let sin = sin.reshape([1, 1, t, half]);
    let x1 = x.clone().slice([0..b, 0..h, 0..t, 0..half]);
    let x2 = x.slice([0..b, 0..h, 0..t, half..k]);
    let r1 = x1.clone().mul(cos.clone()).sub(x2.clone().mul(sin.clone()));
    let r2 = x1.mul(sin).add(x2.mul(cos));
    Tensor::cat(vec![r1, r2], 3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution};

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
