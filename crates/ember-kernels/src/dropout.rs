//! The dropout op: in training (a module whose flag is on, on an autodiff device), each element
//! zeroed with probability `p` and the others scaled by `1 / (1 - p)`; otherwise the input.
//!
//! Reference: Burn's `Dropout::forward`. Kernel (GPU backends, `f32` tensors tracked by
//! autodiff): one CubeCL kernel each way whose mask is a hash of a seed and each element's index,
//! so nothing but the seed is kept for the backward pass (`cube/dropout`). Flex runs the
//! reference (its random numbers and products are cheap next to a step on the CPU).

use burn::nn::Dropout;
use burn::tensor::Tensor;

/// `dropout` applied to `x`.
///
/// # Shapes
/// - x: any
/// - output: same as x
pub fn dropout<const D: usize>(dropout: &Dropout, x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "cube")]
    let x = match super::cube::dropout::dropout(dropout, x) {
        Ok(y) => return y,
        Err(x) => x,
    };
    dropout_reference(dropout, x)
}

/// [`dropout`] in Burn's tensor ops, on every backend.
pub fn dropout_reference<const D: usize>(dropout: &Dropout, x: Tensor<D>) -> Tensor<D> {
    dropout.forward(x)
}

/// `x + dropout(y)`: a sub-layer's output `y` dropped (where `dropout` is active) and added to
/// the residual stream `x`. On the GPU backends, in training, one kernel each way (the sum and
/// the mask in one pass: the dropped `y` is never written), with the same mask as [`dropout`]
/// would draw; otherwise [`dropout`], then the sum.
///
/// # Shapes
/// - x, y: any, the same
/// - output: same as x
pub fn add_dropout<const D: usize>(x: Tensor<D>, dropout: &Dropout, y: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "cube")]
    let (x, y) = match super::cube::dropout::add_dropout(x, dropout, y) {
        Ok(sum) => return sum,
        Err(xy) => xy,
    };
    x + self::dropout(dropout, y)
}
