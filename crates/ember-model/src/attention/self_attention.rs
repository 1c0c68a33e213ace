//! Masked (causal) self-attention: each position of a sequence attends to itself and the
//! positions before it, through every head of a [`MultiHeadAttention`]. With a [`KvCache`], the
//! new positions also see the cached past: the decoding step of autoregressive generation.

use burn::tensor::{Bool, Tensor};

use super::kv_cache::{Keys, KvCache};
use super::multi_head::{AttentionResult, MultiHeadAttention};
use super::scaled_dot_product::attend_keys;
use crate::ops::{self, linear};
use crate::positions::rotary::rotate_leading;

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
        // The training attention, the sequence on itself under the causal mask alone, is one
        // op from the input to the output projection where a kernel takes it.
        let one_op = cache.is_none() && causal && pad.is_none() && !return_weights;
        // (The op turns whole heads; a partial rotation takes the steps below.)
        let qkv = match one_op && self.partial_rotary().is_none() {
            true => match ops::fused_causal_self_attention(
                x,
                // Grouped keys and values repeated for their heads in the weights.
                &self.every_head_projection(),
                &self.c_proj,
                self.n_heads,
                self.rotary,
                &self.attn_dropout,
            ) {
                Ok(y) => return (y, None),
                Err(qkv) => qkv,
            },
            // Project: every head's query, key and value (grouped ones repeated for their
            // heads); rotate the queries and keys by their positions.
            false => self.rotate(self.every_head(linear(&self.c_attn, x)), cache.as_deref()),
        }; // [B, T, 3D]
        // Split the heads: [B, H, T, K] each.
        let [b, t, d3] = qkv.dims();
        let d = d3 / 3;
        let q = self.split_heads(qkv.clone().slice([0..b, 0..t, 0..d]));
        let k = self.split_heads(qkv.clone().slice([0..b, 0..t, d..2 * d]));
        let v = self.split_heads(qkv.slice([0..b, 0..t, 2 * d..3 * d]));
        // Append to the cache (grouped: one head of each group, which attention shares among
        // the group's query heads): the queries see the past positions' keys and values too.
        let keys = match cache {
            Some(cache) => {
                let (k, v) = (self.one_per_group(k), self.one_per_group(v));
                cache.append_keys(k, v, causal && pad.is_none())
            }
            None => Keys::Seen(k, v),
        };
        // Attend under the masks, merge the heads, project.
        let out = attend_keys(q, keys, causal, pad, &self.attn_dropout, return_weights);
        self.project(out)
    }

    /// `qkv` with its queries and keys rotated by their positions (rotary models), which the
    /// cache's state gives ([`KvCache::rotary_at`]).
    ///
    /// # Shapes
    /// - qkv: `[B, T, 3D]`
    fn rotate(&self, qkv: Tensor<3>, cache: Option<&KvCache>) -> Tensor<3> {
        let Some(rope) = self.rotary else {
            return qkv;
        };
        let at = KvCache::rotary_at(cache, qkv.dims()[1]);
        match self.partial_rotary() {
            None => ops::rotate_qk_at(qkv, self.n_heads, at, rope),
            Some(turned) => rotate_leading(qkv, self.n_heads, turned, at, rope),
        }
    }

    /// The dimensions of each head a partial rotation turns (`None` when the rotation turns
    /// whole heads, or there is none).
    pub(crate) fn partial_rotary(&self) -> Option<usize> {
        if self.rotary.is_none() || self.rotary_dims == 0 {
            return None;
        }
        let head = self.c_attn.weight.dims()[0] / self.n_heads;
        (self.rotary_dims < head).then_some(self.rotary_dims)
    }
}
