//! The GELU op, exact and tanh-approximated.
//!
//! Reference: Burn's `gelu` and `gelu_approximate`. Kernels (flex `f32` tensors, and on the GPU
//! backends `f32` tensors on a CubeCL device, tracked by autodiff or not):
//! [`crate::kernels::gelu`]'s vectorised loops with their own backward, and one CubeCL
//! kernel each way (`cube/gelu`).
//! Burn 0.22.1's flex backend computes GELU one element at a time through `libm::erff`, which
//! made it a quarter of a training step and 40% of a forward pass of the baby GPT; its tanh GELU
//! is five separate tensor ops.

use burn::tensor::{DType, FloatDType, Tensor};

/// Exact GELU, `x * Phi(x)`, element-wise.
///
/// # Shapes
/// - x: any
/// - output: same as x
///
/// A bf16 or f16 `x` (mixed precision's hidden layer) is computed in `f32` and rounded once to
/// its type.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "flex")]
    let x = match super::flex::gelu::gelu::<super::kernels::gelu::Exact, D>(x) {
        Ok(y) => return y,
        Err(x) => x,
    };
    #[cfg(feature = "cube")]
    let x = match super::cube::gelu::gelu(x, false) {
        Ok(y) => return y,
        Err(x) => x,
    };
    in_f32(x, gelu, gelu_reference)
}

/// GELU with the tanh approximation (GPT-2's `gelu_new`),
/// `x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, element-wise.
///
/// # Shapes
/// - x: any
/// - output: same as x
///
/// A bf16 or f16 `x` is computed in `f32` and rounded once to its type.
pub fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "flex")]
    let x = match super::flex::gelu::gelu::<super::kernels::gelu::Tanh, D>(x) {
        Ok(y) => return y,
        Err(x) => x,
    };
    #[cfg(feature = "cube")]
    let x = match super::cube::gelu::gelu(x, true) {
        Ok(y) => return y,
        Err(x) => x,
    };
    in_f32(x, gelu_tanh, gelu_tanh_reference)
}

/// `reference(x)` for an `f32` `x`; otherwise `op(x)` computed in `f32` (its kernels included)
/// and given back in `x`'s float type.
pub(crate) fn in_f32<const D: usize>(
    x: Tensor<D>,
    op: impl FnOnce(Tensor<D>) -> Tensor<D>,
    reference: impl FnOnce(Tensor<D>) -> Tensor<D>,
) -> Tensor<D> {
    match x.dtype() {
        DType::F32 => reference(x),
        dtype => super::cast_to(op(x.cast(FloatDType::F32)), dtype),
    }
}

/// [`gelu`] in Burn's tensor ops, on every backend.
pub fn gelu_reference<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    burn::tensor::activation::gelu(x)
}

/// [`gelu_tanh`] in Burn's tensor ops, on every backend.
pub fn gelu_tanh_reference<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    burn::tensor::activation::gelu_approximate(x)
}
