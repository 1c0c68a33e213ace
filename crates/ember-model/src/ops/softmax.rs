//! The causal attention softmax op: scaling, the causal mask and the softmax of attention scores.
//!
//! Reference: three tensor ops (scale, mask fill, softmax). Kernel (flex `f32` tensors, tracked
//! by autodiff or not): one pass each way ([`crate::ops::flex::softmax`]), in which the masked
//! scores are never exponentiated.

use burn::tensor::Tensor;
use burn::tensor::activation::softmax;

use crate::attention::masks::{MASKED_SCORE, causal_mask};

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
    use crate::attention::{causal_attention, causal_mask, scaled_dot_product_attention};
    use burn::tensor::{Device, Tensor};

    /// `causal_attention` (on flex, the fused softmax) against the general path with
    /// `causal_mask`: forward, weights, and gradients of q, k, v with and without gradient
    /// checkpointing; without a cache (T = S) and with 6 cached positions (T < S).
    #[test]
    fn causal_attention_equals_the_masked_general_path() {
        use burn::tensor::{Distribution, TensorData};
        let draw = |dims: [usize; 4]| {
            Tensor::<4>::random(dims, Distribution::Normal(0.0, 2.0), &Device::flex()).into_data()
        };
        for (t, s) in [(7, 7), (5, 11)] {
            let (q, k, v) = (
                draw([2, 3, t, 16]),
                draw([2, 3, s, 16]),
                draw([2, 3, s, 16]),
            );
            let g = draw([2, 3, t, 16]);
            for device in [
                Device::flex(),
                Device::flex().autodiff(),
                Device::flex().autodiff().gradient_checkpointing(),
            ] {
                let tracked = device.is_autodiff();
                let run = |fused: bool| {
                    let load = |d: &TensorData| {
                        let x = Tensor::<4>::from_data(d.clone(), &device);
                        if tracked { x.require_grad() } else { x }
                    };
                    let (q, k, v) = (load(&q), load(&k), load(&v));
                    assert!(crate::ops::kernels_take(&q));
                    let out = if fused {
                        causal_attention(q.clone(), k.clone(), v.clone(), None, true)
                    } else {
                        let mask = causal_mask(t, s, &device);
                        let (a, b, c) = (q.clone(), k.clone(), v.clone());
                        scaled_dot_product_attention(a, b, c, Some(mask), None, true)
                    };
                    let weights = out.weights.unwrap();
                    let mut result = vec![out.context.clone().inner(), weights.clone().inner()];
                    if tracked {
                        let w = Tensor::<4>::from_data(g.clone(), &device);
                        let grads = (out.context * w).sum().backward();
                        for x in [q, k, v] {
                            result.push(x.grad(&grads).expect("a gradient"));
                        }
                    }
                    result
                };
                let (fused, general) = (run(true), run(false));
                assert_eq!(fused.len(), general.len());
                for (i, (a, b)) in fused.into_iter().zip(general).enumerate() {
                    let d = (a - b).abs().max().into_scalar::<f32>();
                    assert!(d < 2e-5, "T = {t}, S = {s}, output {i}: differs by {d}");
                }
            }
        }
    }

    /// The op against its reference, output and gradient, on flex with and without autodiff
    /// (and checkpointing); without cached keys (T = S) and with 4 (T < S).
    #[test]
    fn equals_its_reference() {
        use crate::ops::check::agrees_on;
        use crate::ops::{causal_softmax, causal_softmax_reference};
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
