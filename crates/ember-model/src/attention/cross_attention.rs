//! Encoder-decoder (cross) attention: the decoder's positions are the queries; the encoder
//! output, projected once, gives the keys and values. A [`KvCache`] keeps that projection for
//! every later decoding step.

use burn::tensor::{Bool, Tensor};

use super::kv_cache::KvCache;
use super::masks::padding_mask;
use super::multi_head::{AttentionResult, MultiHeadAttention};
use crate::ops::affine;

impl MultiHeadAttention {
    /// Cross-attention of `x` (queries) on `memory` (keys and values), e.g. the encoder output.
    ///
    /// With a cache, the memory's keys and values are projected on the first call and reused
    /// afterwards (`memory` is then ignored).
    ///
    /// # Shapes
    /// - x: `[B, T, D]`
    /// - memory: `[B, S, D]`
    /// - memory_pad: `[B, S]`, `true` at padded source positions
    /// - output: `[B, T, D]`, weights `[B, H, T, S]`
    pub fn forward_cross(
        &self,
        x: Tensor<3>,
        memory: Tensor<3>,
        memory_pad: Option<Tensor<2, Bool>>,
        cache: Option<&mut KvCache>,
        return_weights: bool,
    ) -> AttentionResult {
        let d = x.dims()[2];
        let weight = self.c_attn.weight.val(); // [D, 3D]
        let bias = self.c_attn.bias.as_ref().map(|b| b.val()); // [3D]
        let q = affine(
            x,
            weight.clone().slice([0..d, 0..d]),
            bias.clone().map(|b| b.narrow(0, 0, d)),
        );
        let q = self.split_heads(q);
        let project_memory = |memory: Tensor<3>| {
            let kv = affine(
                memory,
                weight.clone().slice([0..d, d..3 * d]),
                bias.clone().map(|b| b.narrow(0, d, 2 * d)),
            ); // [B, S, 2D]
            let [b, s, _] = kv.dims();
            let k = self.split_heads(kv.clone().slice([0..b, 0..s, 0..d]));
            let v = self.split_heads(kv.slice([0..b, 0..s, d..2 * d]));
            (k, v)
        };
        let (k, v) = match cache {
            Some(cache) => match cache.get() {
                Some(kv) => kv,
                None => {
                    let (k, v) = project_memory(memory);
                    cache.set(k.clone(), v.clone());
                    (k, v)
                }
            },
            None => project_memory(memory),
        };
        let mask = memory_pad.map(padding_mask);
        self.attend(q, k, v, mask, return_weights)
    }
}
