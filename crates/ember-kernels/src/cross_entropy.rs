//! The cross-entropy op: the mean negative log-likelihood of each row's target under the
//! softmax of its logits, with padding ignored and optional label smoothing.
//!
//! Reference: Burn's tensor ops (`log_softmax`, `gather`, the padding mask and the mean), about
//! ten kernel launches forward and seventeen backward on a GPU, with the `[N, V]` log-probabilities
//! kept for the backward pass. Kernel (on the GPU backends, `f32` logits, tracked by autodiff or
//! not): one cube per row for each row's log-sum-exp and loss, one cube for the mean, and one
//! launch backward that writes `softmax - target` straight from the logits and the kept
//! log-sum-exps (`cube/cross_entropy`). On flex (`f32` logits): each row's log-sum-exp and loss
//! in two reads of the row, the gradient in one pass (`flex/cross_entropy`).

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor};

/// Mean cross-entropy of `logits` against `targets`, over the rows whose target is not `pad`.
///
/// With `smoothing = e`, the target distribution puts `1 - e` on the true token and spreads `e`
/// uniformly over the vocabulary (Szegedy et al.; the transformer paper uses 0.1). Every
/// target must be below `V`. A batch of padding alone gives a loss of 0.
///
/// # Shapes
/// - logits: `[N, V]`
/// - targets: `[N]`
/// - output: `[1]`
pub fn cross_entropy(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    pad: Option<u32>,
    smoothing: f64,
) -> Tensor<1> {
    #[cfg(feature = "cube")]
    let (logits, targets) =
        match super::cube::cross_entropy::cross_entropy(logits, targets, pad, smoothing) {
            Ok(loss) => return loss,
            Err(inputs) => inputs,
        };
    #[cfg(feature = "flex")]
    let (logits, targets) =
        match super::flex::cross_entropy::cross_entropy(logits, targets, pad, smoothing) {
            Ok(loss) => return loss,
            Err(inputs) => inputs,
        };
    cross_entropy_reference(logits, targets, pad, smoothing)
}

/// [`cross_entropy`] in Burn's tensor ops, on every backend.
pub fn cross_entropy_reference(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    pad: Option<u32>,
    smoothing: f64,
) -> Tensor<1> {
    let [n] = targets.dims();
    let log_probs = log_softmax(logits, 1); // [N, V]
    let targets = targets.reshape([n, 1]); // [N, 1]
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
