//! The sum of the squares of every value of a list of tensors (a global gradient norm,
//! squared), without leaving the device.
//!
//! Reference: `sum(x^2)` of each tensor in Burn's ops, added up: three kernels or so per tensor
//! on a GPU (the squares, the sum, the addition), whatever a CPU backend does. Kernel (on the
//! GPU backends, on `f32` tensors not tracked by autodiff): one launch per 8 tensors, cubes
//! striding over each tensor of the 8 in turn, and one cube adding their partial sums
//! (`cube/sum_of_squares`). [`global_norm`] takes the square root and clipping's factor in that
//! last cube.

use burn::tensor::Tensor;

/// `sum(x^2)` over every value of every tensor of `xs` (flattened); `None` for no tensors.
///
/// # Shapes
/// - xs: each `[N_i]`
/// - output: `[1]`
pub fn sum_of_squares(xs: Vec<Tensor<1>>) -> Option<Tensor<1>> {
    #[cfg(feature = "cube")]
    let xs = match super::cube::sum_of_squares::sum(xs) {
        Ok(sum) => return Some(sum),
        Err(xs) => xs,
    };
    sum_of_squares_reference(xs)
}

/// [`sum_of_squares`] in Burn's tensor ops, on every backend.
pub fn sum_of_squares_reference(xs: Vec<Tensor<1>>) -> Option<Tensor<1>> {
    xs.into_iter()
        .map(|x| x.powi_scalar(2).sum())
        .reduce(|total, squares| total + squares)
}

/// The global L2 norm of every value of `xs` (`[1]`) and, with `max_norm`, the factor that
/// clips it to `max_norm`, `min(1, max_norm / (norm + 1e-6))` (`[1]`), both on the device
/// without a synchronisation; `None` for no tensors. On the GPU backends the launches of
/// [`sum_of_squares`] with the norm and the factor written by its last one.
///
/// # Shapes
/// - xs: each `[N_i]`
/// - outputs: `[1]`, `[1]`
pub fn global_norm(
    xs: Vec<Tensor<1>>,
    max_norm: Option<f32>,
) -> Option<(Tensor<1>, Option<Tensor<1>>)> {
    #[cfg(feature = "cube")]
    let xs = match super::cube::sum_of_squares::norm(xs, max_norm) {
        Ok(norm) => return Some(norm),
        Err(xs) => xs,
    };
    global_norm_reference(xs, max_norm)
}

/// [`global_norm`] in Burn's tensor ops, on every backend.
pub fn global_norm_reference(
    xs: Vec<Tensor<1>>,
    max_norm: Option<f32>,
) -> Option<(Tensor<1>, Option<Tensor<1>>)> {
    let norm = sum_of_squares_reference(xs)?.sqrt();
    let factor = max_norm.map(|max_norm| {
        norm.clone()
            .add_scalar(1e-6)
            .recip()
            .mul_scalar(max_norm)
            .clamp_max(1.0)
    });
    Some((norm, factor))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    /// By hand: 1 + 4 + 9 + 0.25, over tensors of two, one and no values; nothing for no tensors.
    #[test]
    fn sums_every_square_of_every_tensor() {
        let device = Device::flex();
        let xs = vec![
            Tensor::<1>::from_floats([1.0, -2.0], &device),
            Tensor::<1>::from_floats([3.0], &device),
            Tensor::<1>::from_floats([0.5], &device),
            Tensor::<1>::empty([0], &device),
        ];
        let sum = sum_of_squares(xs).expect("four tensors");
        assert_eq!(sum.dims(), [1]);
        assert_eq!(sum.into_scalar::<f32>(), 14.25);
        assert!(sum_of_squares(Vec::new()).is_none());
    }

    /// The norm of the same values, sqrt(14.25), and the factors that clip it to 2 (below 1)
    /// and to 10 (1: under the limit); no factor without a limit.
    #[test]
    fn the_norm_and_the_clipping_factor_by_hand() {
        let device = Device::flex();
        let xs = || {
            vec![
                Tensor::<1>::from_floats([1.0, -2.0], &device),
                Tensor::<1>::from_floats([3.0, 0.5], &device),
            ]
        };
        let norm = 14.25f32.sqrt();
        let (n, f) = global_norm(xs(), Some(2.0)).unwrap();
        assert!((n.into_scalar::<f32>() - norm).abs() < 1e-6);
        let f = f.unwrap().into_scalar::<f32>();
        assert!((f - 2.0 / (norm + 1e-6)).abs() < 1e-6, "{f}");
        let (_, f) = global_norm(xs(), Some(10.0)).unwrap();
        assert_eq!(f.unwrap().into_scalar::<f32>(), 1.0);
        assert!(global_norm(xs(), None).unwrap().1.is_none());
        assert!(global_norm(Vec::new(), Some(1.0)).is_none());
    }
}
