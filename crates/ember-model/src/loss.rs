//! Token-level cross-entropy, with padding ignored and optional label smoothing.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor};

/// Mean cross-entropy over the non-padding positions.
///
/// With `smoothing = e`, the target distribution puts `1 - e` on the true token and spreads `e`
/// uniformly over the vocabulary (Szegedy et al.; the transformer paper uses 0.1).
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
    let log_probs = log_softmax(logits.reshape([b * t, v]), 1); // [N, V]
    let targets = targets.reshape([b * t, 1]); // [N, 1]
    let picked = log_probs.clone().gather(1, targets.clone()); // [N, 1]
    let mut nll = picked.neg();
    if smoothing > 0.0 {
        let uniform = log_probs.mean_dim(1).neg(); // [N, 1]
        nll = nll.mul_scalar(1.0 - smoothing) + uniform.mul_scalar(smoothing);
    }
    match pad {
        Some(pad) => {
            let keep = targets.not_equal_elem(pad as i64).float(); // [N, 1]
            let count = keep.clone().sum().clamp_min(1.0);
            (nll * keep).sum().div(count)
        }
        None => nll.mean(),
    }
}
