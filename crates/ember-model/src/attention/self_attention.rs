//! Masked (causal) self-attention: each position of a sequence attends to itself and the
//! positions before it, through every head of a [`MultiHeadAttention`]. With a [`KvCache`], the
//! new positions also see the cached past: the decoding step of autoregressive generation.

use burn::tensor::{Bool, Tensor};

use super::kv_cache::KvCache;
use super::masks::{causal_mask, combine_masks, padding_mask};
use super::multi_head::{AttentionResult, MultiHeadAttention};
use super::scaled_dot_product::{AttentionOutput, causal_attention};
use crate::ops::{self, linear};

impl MultiHeadAttention {
    /// Self-attention of `x` on itself (plus the cached past, if a cache is given).
    ///
    /// `causal` masks the future; `pad` is `true` at padded keys, `[B, S]` over all keys
    /// including cached ones. With a cache, the new tokens sit at positions
    /// `cache.len()..cache.len() + T` and their keys and values are appended to it.
    ///
    /// # Shapes
    /// - x: `[B, T, D]`
    /// - pad: `[B, S]` with `S = cache.len() + T`
    /// - output: `[B, T, D]`, weights `[B, H, T, S]` (`S` = the buffer's capacity with a
    ///   [`KvCache::whole_buffer`] cache)
    pub fn forward_self(
        &self,
        x: Tensor<3>,
        causal: bool,
        pad: Option<Tensor<2, Bool>>,
        cache: Option<&mut KvCache>,
        return_weights: bool,
    ) -> AttentionResult {
        let [b, t, d] = x.dims();
        let dtype = x.dtype();
        let start = cache.as_ref().map_or(0, |c| c.len());
        let fused = cache.is_none() && causal && pad.is_none() && !return_weights;
        // For the fused attention (unrotated) the projection stays in mixed precision's product
        // type: the kernels read it widened and keep it as it is (half the bytes in bf16).
        let qkv = match fused && self.rotary_base == 0.0 {
            true => ops::linear_in_products(&self.c_attn, x),
            false => linear(&self.c_attn, x),
        }; // [B, T, 3D]
        let qkv = if self.rotary_base > 0.0 {
            // Rotary positions turn each head's query and key by their positions (in a
            // left-padded batch, each row's own; in a step whose position is on the device, by
            // its rows of the tables).
            let step = cache.as_ref().and_then(|c| c.position()).filter(|_| t == 1);
            match (
                step.and_then(|s| s.rotary()),
                cache.as_ref().and_then(|c| c.row_starts()),
            ) {
                (Some((cos, sin)), _) => ops::rotate_qk_by(qkv, self.n_heads, cos, sin),
                (None, Some(starts)) => {
                    ops::rotate_qk_rows(qkv, self.n_heads, &starts, self.rotary_base)
                }
                (None, None) => ops::rotate_qk(qkv, self.n_heads, start, self.rotary_base),
            }
        } else {
            qkv
        };
        let qkv = if fused {
            // The sequence on itself, nothing but the causal mask: one op from the projection
            // (dropout on the weights inside it where a kernel does that).
            match ops::causal_self_attention(qkv, self.n_heads, &self.attn_dropout) {
                Ok(context) => {
                    // In the projection's type; the residual stream's after the projection.
                    let y = linear(&self.c_proj, context);
                    return (ops::cast_to(y, dtype), None); // [B, T, D]
                }
                Err(qkv) => ops::cast_to(qkv, dtype),
            }
        } else {
            qkv
        };
        let q = self.split_heads(qkv.clone().slice([0..b, 0..t, 0..d]));
        let k = self.split_heads(qkv.clone().slice([0..b, 0..t, d..2 * d]));
        let v = self.split_heads(qkv.slice([0..b, 0..t, 2 * d..3 * d]));
        let (k, v) = match cache {
            Some(cache) if cache.reads_whole_buffer() && causal && pad.is_none() => {
                // Keys of the whole buffer: query i (at position start + i) sees keys up to
                // start + i, which also hides every position not written yet.
                let (k, v) = cache.append_whole(k, v);
                if !return_weights {
                    let context = match cache.position() {
                        Some(step) => ops::cached_causal_attention_at(
                            q,
                            k,
                            v,
                            &step.position,
                            &self.attn_dropout,
                        ),
                        None => ops::cached_causal_attention(q, k, v, start, &self.attn_dropout),
                    };
                    return self.project(AttentionOutput {
                        context,
                        weights: None,
                    });
                }
                let capacity = k.dims()[2];
                let mask = Tensor::<2, Bool>::tril_mask([t, capacity], start as i64, &q.device())
                    .reshape([1, 1, t, capacity]);
                return self.attend(q, k, v, Some(mask), return_weights);
            }
            Some(cache) => cache.append(k, v),
            None => (k, v),
        };
        if causal && pad.is_none() {
            let out = causal_attention(q, k, v, Some(&self.attn_dropout), return_weights);
            return self.project(out);
        }
        let s = start + t;
        let device = q.device();
        let causal = (causal && t > 1).then(|| causal_mask(t, s, &device));
        let mask = combine_masks(causal, pad.map(padding_mask));
        self.attend(q, k, v, mask, return_weights)
    }
}
