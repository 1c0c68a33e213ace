//! Token-level cross-entropy, with padding ignored and optional label smoothing.

use burn::tensor::{Int, Tensor};

/// Mean cross-entropy over the non-padding positions.
///
/// With `smoothing = e`, the target distribution puts `1 - e` on the true token and spreads `e`
/// uniformly over the vocabulary (Szegedy et al.; the transformer paper uses 0.1). The work is
/// [`crate::ops::cross_entropy`]'s, over the `B * T` positions as rows.
///
/// # Shapes
/// - logits: `[B, T, V]`
/// - targets: `[B, T]`
/// - output: `[1]`
pub fn cross_entropy(
    logits: Tensor<3>,
    targets: Tensor<2, Int>,
    pad: Option<u32>,
    smoothing: f64,
) -> Tensor<1> {
    let [b, t, v] = logits.dims();
    crate::ops::cross_entropy(
        logits.reshape([b * t, v]),
        targets.reshape([b * t]),
        pad,
        smoothing,
    )
}
