//! The sum of the squares of every value of a list of tensors (a global gradient norm,
//! squared), without leaving the device.
//!
//! Reference: `sum(x^2)` of each tensor in Burn's ops, added up: three kernels or so per tensor
//! on a GPU (the squares, the sum, the addition), whatever a CPU backend does. Kernel (on the
//! GPU backends, on `f32` tensors not tracked by autodiff): one launch per 8 tensors, cubes
//! striding over each tensor of the 8 in turn, and one cube adding their partial sums
//! (`cube/sum_of_squares`).

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
}
