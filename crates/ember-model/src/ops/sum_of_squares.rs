//! The running sum of squares of a list of tensors (a global gradient norm, squared), one tensor
//! at a time, without leaving the device.
//!
//! Reference: `total + sum(x^2)` in Burn's ops, three kernels or so per tensor on a GPU (the
//! squares, the sum, the addition), whatever a CPU backend does. Kernel (on the GPU backends, on
//! `f32` tensors not tracked by autodiff): one launch per tensor, one cube whose units stride
//! over the tensor and add their partial sums in shared memory (`ops/cube/sum_of_squares`).

use burn::tensor::Tensor;

/// `total + sum(x^2)` (`sum(x^2)` for the first tensor, `total` `None`).
///
/// # Shapes
/// - total, output: `[1]`
pub fn add_sum_of_squares<const D: usize>(total: Option<Tensor<1>>, x: Tensor<D>) -> Tensor<1> {
    #[cfg(feature = "cube")]
    let (total, x) = match super::cube::sum_of_squares::add(total, x) {
        Ok(sum) => return sum,
        Err(inputs) => inputs,
    };
    add_sum_of_squares_reference(total, x)
}

/// [`add_sum_of_squares`] in Burn's tensor ops, on every backend.
pub fn add_sum_of_squares_reference<const D: usize>(
    total: Option<Tensor<1>>,
    x: Tensor<D>,
) -> Tensor<1> {
    let squares = x.powi_scalar(2).sum();
    match total {
        Some(total) => total + squares,
        None => squares,
    }
}
