//! ember's kernels on Burn's flex CPU backend: reaching flex tensors' `f32` buffers
//! ([`tensor`]), one helper for the autodiff plumbing (`op`), and one module per op.

pub(crate) mod adamw;
pub(crate) mod attention;
mod attention_blocks;
pub(crate) mod cross_entropy;
pub(crate) mod decode_attention;
pub(crate) mod dropout;
pub(crate) mod gated;
pub(crate) mod gelu;
pub(crate) mod layer_norm;
pub(crate) mod op;
pub(crate) mod rotary;
pub(crate) mod softmax;
pub mod tensor;
pub mod threads;
