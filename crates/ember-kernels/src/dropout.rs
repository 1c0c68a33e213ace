//! The dropout op: in training (a module whose flag is on, on an autodiff device), each element
//! zeroed with probability `p` and the others scaled by `1 / (1 - p)`; otherwise the input.
//!
//! Reference: Burn's `Dropout::forward`. Kernels (`f32` tensors tracked by autodiff): one pass
//! each way whose mask is a hash of a seed and each element's index, so nothing but the seed is
//! kept for the backward pass; one CubeCL kernel on the GPU backends (`cube/dropout`), a loop
//! over the values on flex ([`crate::kernels::dropout`], the same mask). The seed is a uniform
//! number drawn from the device's random numbers, so seeding the device repeats the masks.

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
    #[cfg(feature = "flex")]
    let x = match flex_dropout(dropout, x) {
        Ok(y) => return y,
        Err(x) => x,
    };
    dropout_reference(dropout, x)
}

/// [`dropout`] through the flex kernel where it drops at all (in training: its flag on, `x`
/// tracked by autodiff, a probability strictly between 0 and 1) and `x` is a non-empty flex
/// `f32` tensor; `x` back otherwise, no random number drawn.
#[cfg(feature = "flex")]
fn flex_dropout<const D: usize>(dropout: &Dropout, x: Tensor<D>) -> Result<Tensor<D>, Tensor<D>> {
    let p = dropout.prob;
    let drops = dropout.training.is_enabled()
        && x.device().is_autodiff()
        && p > 0.0
        && p < 1.0
        && x.shape().num_elements() > 0;
    if !drops || !super::flex::tensor::is_flex_f32(&x) {
        return Err(x);
    }
    let mask = drawn_mask(&x.device(), p as f32);
    super::flex::dropout::dropout(x, mask)
}

/// The flex kernels' mask dropping with probability `p`, its seed the next uniform number of
/// `device`'s random numbers (so seeding the device repeats it).
#[cfg(feature = "flex")]
pub(crate) fn drawn_mask(device: &burn::tensor::Device, p: f32) -> crate::kernels::dropout::Mask {
    use crate::kernels::dropout::{Mask, seed_of};
    let uniform = burn::tensor::Distribution::Uniform(0.0, 1.0);
    let u = Tensor::<1>::random([1], uniform, device).into_scalar::<f32>();
    Mask::new(seed_of(u), p)
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
