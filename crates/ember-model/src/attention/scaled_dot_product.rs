//! Scaled dot-product attention: `softmax(Q K^T / sqrt(K)) V`.
//!
//! Shape letters used across the crate: `B` batch, `H` heads, `T` query (target) length,
//! `S` key/value (source) length, `K` head size, `D` model width, `V` vocabulary.

use burn::nn::Dropout;
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor};

/// The score given to masked positions before the softmax.
///
/// Finite on purpose: a row whose keys are *all* masked then gets uniform weights and a
/// finite output, where `-inf` would give `0/0 = NaN`. `exp(-1e9 - max)` underflows to exactly
/// zero in f32, so a masked key next to any unmasked one gets weight 0.
pub const MASKED_SCORE: f32 = -1.0e9;

/// Output of [`scaled_dot_product_attention`].
#[derive(Debug, Clone)]
pub struct AttentionOutput {
    /// The attended values, `[B, H, T, K]`.
    pub context: Tensor<4>,
    /// The attention weights `[B, H, T, S]` (each row sums to 1), when asked for.
    /// These are the weights before attention dropout: the distribution the model computed.
    pub weights: Option<Tensor<4>>,
}

/// `softmax(Q K^T / sqrt(K) + masking) V`.
///
/// `mask` is `true` where a query may **not** look at a key. It broadcasts to `[B, H, T, S]`:
/// a causal mask can be `[1, 1, T, S]`, a padding mask `[B, 1, 1, S]`.
/// `dropout` (if any) applies to the weights before they multiply `V`, as in the paper.
///
/// On flex, one query position with no mask and no weights asked for (the decoding step with a
/// KV cache) runs [`crate::attention_kernel`]'s loops over the keys where they lie instead of
/// two one-row matrix multiplies.
///
/// # Shapes
/// - q: `[B, H, T, K]`
/// - k: `[B, H, S, K]`
/// - v: `[B, H, S, K]`
/// - mask: broadcastable to `[B, H, T, S]`
/// - output: context `[B, H, T, K]`, weights `[B, H, T, S]`
pub fn scaled_dot_product_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    dropout: Option<&Dropout>,
    return_weights: bool,
) -> AttentionOutput {
    // Decoding with a KV cache on flex: one query, loops over the cache in place.
    #[cfg(feature = "flex")]
    if mask.is_none()
        && !return_weights
        && let Some(context) = crate::decode_attention::single_query(&q, &k, &v)
    {
        return AttentionOutput {
            context,
            weights: None,
        };
    }
    let [_, _, _, head_size] = q.dims();
    let scale = 1.0 / (head_size as f64).sqrt();
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale); // [B, H, T, S]
    let scores = match mask {
        Some(mask) => scores.mask_fill(mask, MASKED_SCORE),
        None => scores,
    };
    weigh_values(softmax(scores, 3), v, dropout, return_weights)
}

/// [`scaled_dot_product_attention`] with the causal mask and no other: query `t` sees keys
/// `..= S - T + t` (the `S - T` cached ones and those up to itself).
///
/// On flex the scaling, the mask and the softmax are one pass ([`crate::softmax_kernel`],
/// with its own backward) and the masked scores are never exponentiated.
///
/// # Shapes
/// - q: `[B, H, T, K]`
/// - k, v: `[B, H, S, K]`, `S >= T`
/// - output: context `[B, H, T, K]`, weights `[B, H, T, S]`
pub fn causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    dropout: Option<&Dropout>,
    return_weights: bool,
) -> AttentionOutput {
    let [_, _, t, _] = q.dims();
    let s = k.dims()[2];
    if t == 1 {
        // One query sees every key: nothing to mask.
        return scaled_dot_product_attention(q, k, v, None, dropout, return_weights);
    }
    #[cfg(feature = "flex")]
    if crate::kernels_take(&q) {
        let scale = 1.0 / (q.dims()[3] as f64).sqrt();
        let scores = q.matmul(k.swap_dims(2, 3)); // [B, H, T, S]
        let weights = crate::flex_softmax::causal_softmax(scores, scale as f32, |scores| {
            let mask = causal_mask(t, s, &scores.device());
            softmax(scores.mul_scalar(scale).mask_fill(mask, MASKED_SCORE), 3)
        });
        return weigh_values(weights, v, dropout, return_weights);
    }
    let mask = causal_mask(t, s, &q.device());
    scaled_dot_product_attention(q, k, v, Some(mask), dropout, return_weights)
}

/// `dropout(weights) @ v`, keeping the weights if asked.
fn weigh_values(
    weights: Tensor<4>,
    v: Tensor<4>,
    dropout: Option<&Dropout>,
    return_weights: bool,
) -> AttentionOutput {
    let attended = match dropout {
        Some(dropout) => dropout.forward(weights.clone()),
        None => weights.clone(),
    };
    AttentionOutput {
        context: attended.matmul(v),
        weights: return_weights.then_some(weights),
    }
}

/// The causal mask `[1, 1, T, S]`: query `t` (at absolute position `offset + t`) may look at
/// keys `0..=offset + t`. `S = offset + T` is the number of keys including cached ones.
pub fn causal_mask(t: usize, s: usize, device: &burn::tensor::Device) -> Tensor<4, Bool> {
    let offset = s.saturating_sub(t) as i64;
    // tril_mask is true strictly above diagonal `offset`: the future.
    Tensor::<2, Bool>::tril_mask([t, s], offset, device).reshape([1, 1, t, s])
}

/// The padding mask `[B, 1, 1, S]` from a `[B, S]` mask that is `true` at padding.
pub fn padding_mask(pad: Tensor<2, Bool>) -> Tensor<4, Bool> {
    let [b, s] = pad.dims();
    pad.reshape([b, 1, 1, s])
}

/// Combines two optional masks with a logical OR, broadcasting.
pub fn combine_masks(
    a: Option<Tensor<4, Bool>>,
    b: Option<Tensor<4, Bool>>,
) -> Option<Tensor<4, Bool>> {
    match (a, b) {
        (Some(a), Some(b)) => {
            let shape = broadcast_shape(a.dims(), b.dims());
            Some(a.expand(shape).bool_or(b.expand(shape)))
        }
        (a, None) => a,
        (None, b) => b,
    }
}

fn broadcast_shape(a: [usize; 4], b: [usize; 4]) -> [usize; 4] {
    std::array::from_fn(|i| a[i].max(b[i]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn tensor(rows: &[[f32; 2]], device: &Device) -> Tensor<4> {
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        Tensor::<1>::from_floats(flat.as_slice(), device).reshape([1, 1, rows.len(), 2])
    }

    /// softmax(q k^T / sqrt(2)) v by plain loops, in f64; `masked[i][j]` hides key j from query i.
    fn by_hand(
        q: &[[f32; 2]],
        k: &[[f32; 2]],
        v: &[[f32; 2]],
        masked: impl Fn(usize, usize) -> bool,
    ) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
        let mut weights = vec![];
        let mut out = vec![];
        for (i, qi) in q.iter().enumerate() {
            let scores: Vec<f64> = k
                .iter()
                .map(|kj| (qi[0] as f64 * kj[0] as f64 + qi[1] as f64 * kj[1] as f64) / 2f64.sqrt())
                .collect();
            let max = (0..k.len())
                .filter(|&j| !masked(i, j))
                .map(|j| scores[j])
                .fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = (0..k.len())
                .map(|j| {
                    if masked(i, j) {
                        0.0
                    } else {
                        (scores[j] - max).exp()
                    }
                })
                .collect();
            let total: f64 = exps.iter().sum();
            let w: Vec<f64> = exps.iter().map(|e| e / total).collect();
            let o = (0..2)
                .map(|c| (0..v.len()).map(|j| w[j] * v[j][c] as f64).sum())
                .collect();
            weights.push(w);
            out.push(o);
        }
        (weights, out)
    }

    const Q: [[f32; 2]; 3] = [[1.0, 0.0], [0.5, -1.0], [2.0, 1.5]];
    const K: [[f32; 2]; 3] = [[0.0, 1.0], [1.0, 1.0], [-1.0, 0.5]];
    const V: [[f32; 2]; 3] = [[1.0, 2.0], [3.0, -1.0], [0.0, 4.0]];

    fn check(mask: Option<Tensor<4, Bool>>, masked: impl Fn(usize, usize) -> bool) {
        let device = Device::flex();
        let out = scaled_dot_product_attention(
            tensor(&Q, &device),
            tensor(&K, &device),
            tensor(&V, &device),
            mask,
            None,
            true,
        );
        let (want_w, want_o) = by_hand(&Q, &K, &V, masked);
        let got_w = out.weights.unwrap().try_into_vec_as::<f32>().unwrap();
        let got_o = out.context.try_into_vec_as::<f32>().unwrap();
        for i in 0..3 {
            let row_sum: f32 = got_w[i * 3..i * 3 + 3].iter().sum();
            assert!((row_sum - 1.0).abs() < 1e-6, "row {i} sums to {row_sum}");
            for j in 0..3 {
                let (got, want) = (got_w[i * 3 + j] as f64, want_w[i][j]);
                assert!(
                    (got - want).abs() < 1e-6,
                    "weight[{i}][{j}] = {got}, by hand {want}"
                );
            }
            for c in 0..2 {
                let (got, want) = (got_o[i * 2 + c] as f64, want_o[i][c]);
                assert!(
                    (got - want).abs() < 1e-5,
                    "out[{i}][{c}] = {got}, by hand {want}"
                );
            }
        }
    }

    #[test]
    fn matches_hand_computed_values() {
        check(None, |_, _| false);
    }

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
                    #[cfg(feature = "flex")]
                    assert!(crate::flex_tensor::takes_kernels(&q));
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

    /// One query over a cache-like view (the first 37 of 50 positions, as `KvCache` returns
    /// them): the decoding path (on flex, ember's loops) against the general one.
    #[test]
    fn single_query_equals_the_general_path() {
        use burn::tensor::Distribution;
        let device = Device::flex();
        let normal = Distribution::Normal(0.0, 1.0);
        let buffer = |seed| {
            device.seed(seed);
            Tensor::<4>::random([2, 3, 50, 32], normal, &device)
        };
        let (k, v) = (buffer(1), buffer(2));
        let (k, v) = (
            k.slice([0..2, 0..3, 0..37, 0..32]),
            v.slice([0..2, 0..3, 0..37, 0..32]),
        );
        let q = Tensor::<4>::random([2, 3, 1, 32], normal, &device) * 3.0;
        #[cfg(feature = "flex")]
        assert!(crate::decode_attention::single_query(&q, &k, &v).is_some());
        let fast = scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), None, None, false);
        // Asking for the weights takes the general path.
        let general = scaled_dot_product_attention(q, k, v, None, None, true);
        let diff = (fast.context - general.context)
            .abs()
            .max()
            .into_scalar::<f32>();
        assert!(diff < 1e-5, "differs by {diff}");
    }

    #[test]
    fn causal_mask_matches_hand_computed_values() {
        let mask = causal_mask(3, 3, &Device::flex());
        check(Some(mask), |i, j| j > i);
    }

    #[test]
    fn padding_mask_matches_hand_computed_values() {
        let pad = Tensor::<2, Bool>::from_bool([[false, true, false]], &Device::flex());
        check(Some(padding_mask(pad)), |_, j| j == 1);
    }

    #[test]
    fn causal_mask_with_cached_keys_sees_the_past() {
        // 2 new queries after 3 cached keys: query 0 is at position 3, sees keys 0..=3.
        let mask = causal_mask(2, 5, &Device::flex());
        let got = mask.try_into_vec_as::<bool>().unwrap();
        let want = [
            false, false, false, false, true, //
            false, false, false, false, false,
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn fully_masked_row_is_finite() {
        let device = Device::flex();
        let mask = Tensor::<2, Bool>::from_bool([[true, true, true]], &device);
        let out = scaled_dot_product_attention(
            tensor(&Q, &device),
            tensor(&K, &device),
            tensor(&V, &device),
            Some(padding_mask(mask)),
            None,
            true,
        );
        for x in out.context.try_into_vec_as::<f32>().unwrap() {
            assert!(x.is_finite(), "fully masked row gave {x}");
        }
        for x in out.weights.unwrap().try_into_vec_as::<f32>().unwrap() {
            assert!(x.is_finite());
        }
    }
}
