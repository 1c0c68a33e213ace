//! Rotary positions (RoPE, Su et al. 2021): queries and keys turned by an angle proportional to
//! their position, inside attention, so that their dot product depends on the offset alone.

// The rotation itself lives with the rotary op and its kernels, which apply it in place.
pub use crate::ops::rotation::{apply_rotary, rotate_by};

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
