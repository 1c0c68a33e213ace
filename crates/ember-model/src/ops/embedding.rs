//! The embedding op: rows of a table picked by token (or position) ids.
//!
//! Reference and only path: Burn's `Embedding::forward`. It is an op because of mixed precision
//! ([`crate::precision`]): a table held in bf16 for the products it also serves (the tied
//! output head) gives its rows widened to `f32`, the type activations keep.

use burn::nn::Embedding;
use burn::tensor::{DType, FloatDType, Int, Tensor};

/// `table.forward(ids)`, in `f32` whatever type the table is held in.
///
/// # Shapes
/// - ids: `[B, T]`
/// - table: `[V, D]`
/// - output: `[B, T, D]`
pub fn embed(table: &Embedding, ids: Tensor<2, Int>) -> Tensor<3> {
    let rows = table.forward(ids);
    match rows.dtype() {
        DType::F32 => rows,
        _ => rows.cast(FloatDType::F32),
    }
}
