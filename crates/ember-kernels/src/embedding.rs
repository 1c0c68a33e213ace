//! The embedding op: rows of a table picked by token (or position) ids.
//!
//! Reference: Burn's `Embedding::forward` ([`embed_reference`]). It is an op because of mixed
//! precision (`ember_model::precision`): a table held in bf16 for the products it also serves (the
//! tied output head) gives its rows widened to `f32`, the type activations keep. Kernel (GPU
//! backends, an `f32` table tracked by autodiff, a small vocabulary): the table's gradient with
//! one unit per table element instead of Burn's one per column (`cube/embedding`).

use burn::nn::Embedding;
use burn::tensor::{DType, FloatDType, Int, Tensor};

/// `table.forward(ids)`, in `f32` whatever type the table is held in.
///
/// # Shapes
/// - ids: `[B, T]`
/// - table: `[V, D]`
/// - output: `[B, T, D]`
pub fn embed(table: &Embedding, ids: Tensor<2, Int>) -> Tensor<3> {
    #[cfg(feature = "cube")]
    let ids = match super::cube::embedding::embed(table.weight.val(), ids) {
        Ok(rows) => return rows,
        Err(ids) => ids,
    };
    embed_reference(table, ids)
}

/// [`embed`] through Burn's `Embedding::forward`, on every backend.
pub fn embed_reference(table: &Embedding, ids: Tensor<2, Int>) -> Tensor<3> {
    widened(table.forward(ids))
}

/// Rows `start..start + T` of `table`, in `f32` whatever type the table is held in: [`embed`]
/// of the consecutive ids `start..start + T`, as a view of the table. Looking the ids up would
/// upload them and gather the rows: on a GPU, a transfer and a kernel launch per decoding step.
///
/// # Shapes
/// - table: `[V, D]`, `start + T <= V`
/// - output: `[1, T, D]`
pub fn embed_range(table: &Embedding, start: usize, t: usize) -> Tensor<3> {
    widened(table.weight.val().narrow(0, start, t).unsqueeze())
}

/// A table's rows in `f32`, the type activations keep.
fn widened(rows: Tensor<3>) -> Tensor<3> {
    match rows.dtype() {
        DType::F32 => rows,
        _ => rows.cast(FloatDType::F32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::EmbeddingConfig;
    use burn::tensor::{Device, Distribution};

    /// The rows of a range against looking their ids up: the same values, and the same gradient
    /// for the table (rows outside the range get none) under autodiff.
    #[test]
    fn a_range_of_rows_equals_looking_up_its_ids() {
        let device = Device::flex().autodiff();
        let table = EmbeddingConfig::new(10, 6).init(&device);
        let g = Tensor::<3>::random([1, 4, 6], Distribution::Normal(0.0, 1.0), &device);
        let run = |by_range: bool| {
            let rows = match by_range {
                true => embed_range(&table, 3, 4),
                false => embed(
                    &table,
                    Tensor::<1, Int>::arange(3..7, &device).reshape([1, 4]),
                ),
            };
            let grads = (rows.clone() * g.clone()).sum().backward();
            let grad = table.weight.val().grad(&grads).unwrap();
            (rows.inner(), grad)
        };
        let ((rows, grad), (want_rows, want_grad)) = (run(true), run(false));
        assert_eq!(rows.dims(), [1, 4, 6]);
        rows.into_data().assert_eq(&want_rows.into_data(), true);
        grad.clone()
            .into_data()
            .assert_eq(&want_grad.into_data(), true);
        let outside = grad.narrow(0, 0, 3).abs().sum().into_scalar::<f32>();
        assert_eq!(outside, 0.0);
    }
}
