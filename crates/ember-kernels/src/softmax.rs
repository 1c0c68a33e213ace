//! The causal attention softmax op: scaling, the causal mask and the softmax of attention scores.
//!
//! Reference: three tensor ops (scale, mask fill, softmax). Kernel (flex `f32` tensors, tracked
//! by autodiff or not): one pass each way ([`crate::flex::softmax`]), in which the masked
//! scores are never exponentiated.

use burn::tensor::Tensor;
use burn::tensor::activation::softmax;

use crate::masks::{MASKED_SCORE, causal_mask};

/// `softmax(scale * scores)` over the last axis with the causal mask: query `i` sees keys
/// `..= S - T + i` (the `S - T` cached ones and those up to itself).
///
/// # Shapes
/// - scores: `[B, H, T, S]`, `T <= S`
/// - output: `[B, H, T, S]`, zero at hidden keys
pub fn causal_softmax(scores: Tensor<4>, scale: f64) -> Tensor<4> {
    #[cfg(feature = "flex")]
    let scores = match super::flex::softmax::causal_softmax(scores, scale as f32) {
        Ok(weights) => return weights,
        Err(scores) => scores,
    };
    causal_softmax_reference(scores, scale)
}

/// [`causal_softmax`] in Burn's tensor ops, on every backend.
pub fn causal_softmax_reference(scores: Tensor<4>, scale: f64) -> Tensor<4> {
    let [_, _, t, s] = scores.dims();
    let mask = causal_mask(t, s, &scores.device());
    softmax(scores.mul_scalar(scale).mask_fill(mask, MASKED_SCORE), 3)
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::tensor::{Device, Tensor};

    /// The op against its reference, output and gradient, on flex with and without autodiff
    /// (and checkpointing); without cached keys (T = S) and with 4 (T < S).
    #[test]
    fn equals_its_reference() {
        use crate::check::agrees_on;
        use crate::{causal_softmax, causal_softmax_reference};
        use burn::tensor::Distribution;
        for (t, s) in [(6, 6), (3, 7)] {
            let draw = |dims: [usize; 3]| {
                Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &Device::flex())
                    .into_data()
            };
            let (x, g) = (draw([4, t, s]), draw([4, t, s]));
            let as4 = |x: Tensor<3>| x.reshape([2, 2, t, s]);
            agrees_on(
                &Device::flex(),
                &x,
                &g,
                |x| causal_softmax(as4(x), 0.5).reshape([4, t, s]),
                |x| causal_softmax_reference(as4(x), 0.5).reshape([4, t, s]),
                1e-5,
                &format!("T = {t}, S = {s}"),
            );
        }
    }
}
