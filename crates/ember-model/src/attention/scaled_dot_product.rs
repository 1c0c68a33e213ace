//! Scaled dot-product attention: `softmax(Q K^T / sqrt(K)) V`.
//!
//! Shape letters used across the crate: `B` batch, `H` heads, `T` query (target) length,
//! `S` key/value (source) length, `K` head size, `D` model width, `V` vocabulary.

use burn::nn::Dropout;
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor};

use super::kv_cache::Keys;
use super::masks::{MASKED_SCORE, causal_mask, combine_masks, padding_mask};
use crate::ops;

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
/// One query with no weights asked for (a decoding step with a KV cache) is
/// [`ops::single_query_attention`].
///
/// Keys and values may have fewer heads than the queries (grouped-query attention, `G`
/// dividing `H`): query head `h` reads head `h / (H / G)` ([`ops::repeat_kv`]; a decoding step
/// reads them in place).
///
/// # Shapes
/// - q: `[B, H, T, K]`
/// - k: `[B, G, S, K]` (`G = H` but for grouped-query attention)
/// - v: `[B, G, S, K]`
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
    if !return_weights && q.dims()[2] == 1 {
        // A decoding step: one query, over the keys cached so far or a source's.
        return AttentionOutput {
            context: ops::single_query_attention(q, k, v, mask, dropout),
            weights: None,
        };
    }
    let [_, heads, _, head_size] = q.dims();
    let (k, v) = (ops::repeat_kv(k, heads), ops::repeat_kv(v, heads));
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
/// The scaling, the mask and the softmax are one op, [`ops::causal_softmax`].
///
/// # Shapes
/// - q: `[B, H, T, K]`
/// - k, v: `[B, G, S, K]`, `S >= T` (`G` as in [`scaled_dot_product_attention`])
/// - output: context `[B, H, T, K]`, weights `[B, H, T, S]`
pub fn causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    dropout: Option<&Dropout>,
    return_weights: bool,
) -> AttentionOutput {
    let [_, heads, t, head_size] = q.dims();
    if t == 1 {
        // One query sees every key: nothing to mask.
        return scaled_dot_product_attention(q, k, v, None, dropout, return_weights);
    }
    let (k, v) = (ops::repeat_kv(k, heads), ops::repeat_kv(v, heads));
    let scale = 1.0 / (head_size as f64).sqrt();
    let scores = q.matmul(k.swap_dims(2, 3)); // [B, H, T, S]
    weigh_values(
        ops::causal_softmax(scores, scale),
        v,
        dropout,
        return_weights,
    )
}

/// Attention of the queries `q` to `keys` under the causal mask (where `causal`) and the
/// padding mask `pad` (`true` at padded keys, `[B, S]` over every key seen): the causal mask
/// alone is [`causal_attention`]; over a cache's whole buffer it also hides the positions not
/// written yet ([`ops::cached_causal_attention`] where no weights are asked for); otherwise
/// [`scaled_dot_product_attention`] with the masks combined.
///
/// The keys may be grouped (`G` heads, as a grouped-query model's cache keeps them): a cache's
/// whole buffer is repeated for every head, the rest read in groups by
/// [`scaled_dot_product_attention`].
///
/// # Shapes
/// - q: `[B, H, T, K]`
/// - keys: `[B, G, S, K]` each
/// - output: context `[B, H, T, K]`, weights `[B, H, T, S]` (`S` the buffer's capacity for
///   [`Keys::Buffer`])
pub fn attend_keys(
    q: Tensor<4>,
    keys: Keys,
    causal: bool,
    pad: Option<Tensor<2, Bool>>,
    dropout: &Dropout,
    return_weights: bool,
) -> AttentionOutput {
    let [_, heads, t, _] = q.dims();
    // The buffers' attention takes every head's keys; the rest reads groups as they are.
    let keys = match keys {
        Keys::Buffer { k, v, start, step } => Keys::Buffer {
            k: ops::repeat_kv(k, heads),
            v: ops::repeat_kv(v, heads),
            start,
            step,
        },
        seen => seen,
    };
    match keys {
        Keys::Buffer { k, v, start, step } if !return_weights => AttentionOutput {
            context: match step {
                Some(step) => ops::cached_causal_attention_at(q, k, v, &step.position, dropout),
                None => ops::cached_causal_attention(q, k, v, start, dropout),
            },
            weights: None,
        },
        Keys::Buffer { k, v, start, .. } => {
            // Query i (at position start + i) sees keys up to start + i, which also hides
            // every position not written yet.
            let capacity = k.dims()[2];
            let mask = Tensor::<2, Bool>::tril_mask([t, capacity], start as i64, &q.device())
                .reshape([1, 1, t, capacity]);
            scaled_dot_product_attention(q, k, v, Some(mask), Some(dropout), return_weights)
        }
        Keys::Seen(k, v) if causal && pad.is_none() => {
            causal_attention(q, k, v, Some(dropout), return_weights)
        }
        Keys::Seen(k, v) => {
            let s = k.dims()[2];
            let causal = (causal && t > 1).then(|| causal_mask(t, s, &q.device()));
            let mask = combine_masks(causal, pad.map(padding_mask));
            scaled_dot_product_attention(q, k, v, mask, Some(dropout), return_weights)
        }
    }
}

/// `dropout(weights) @ v`, keeping the weights if asked.
fn weigh_values(
    weights: Tensor<4>,
    v: Tensor<4>,
    dropout: Option<&Dropout>,
    return_weights: bool,
) -> AttentionOutput {
    let attended = match dropout {
        Some(dropout) => crate::ops::dropout(dropout, weights.clone()),
        None => weights.clone(),
    };
    AttentionOutput {
        context: attended.matmul(v),
        weights: return_weights.then_some(weights),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::{causal_mask, padding_mask};
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
