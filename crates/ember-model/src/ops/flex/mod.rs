//! ember's kernels on Burn's flex CPU backend: reaching flex tensors' `f32` buffers
//! ([`tensor`]), one helper for the autodiff plumbing (`op`), and one module per op.
//!
//! An op that does not take its input hands it back as `Err` for the reference path. A
//! `Tensor` is a few hundred bytes, the `Ok` side as large as the `Err` side, so boxing it (as
//! clippy's `result_large_err` suggests) would only add an allocation per call.
#![allow(clippy::result_large_err)]

pub(crate) mod attention;
#[cfg(test)]
pub(crate) mod check;
pub(crate) mod decode_attention;
pub(crate) mod gelu;
pub(crate) mod layer_norm;
pub(crate) mod matmul;
mod op;
pub(crate) mod rotary;
pub(crate) mod softmax;
pub mod tensor;
pub mod threads;
