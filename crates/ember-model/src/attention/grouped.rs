//! Grouped-query attention (Ainslie et al. 2023; LLaMA 2's, Mistral's): `G` key/value heads,
//! each shared by `H / G` query heads, so the projections to keys and values and the KV cache
//! are `G / H` the size. It is multi-head attention whose heads of a group have the same keys
//! and values: the group's are repeated for its heads (head `h` reads key/value head
//! `h / (H / G)`, as transformers' `repeat_kv`), and from there every path is multi-head
//! attention's. The repeats are views and copies that autodiff tracks, so a shared key's
//! gradient is the sum of its heads'. The cache keeps one head per group, and attention reads
//! it as it is ([`crate::scaled_dot_product_attention`] takes grouped keys; a decoding step's
//! kernel reads each group's rows for its heads, copying nothing).

use std::borrow::Cow;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::Tensor;

use super::multi_head::MultiHeadAttention;

impl MultiHeadAttention {
    /// Whether key/value heads are shared (`G < H`).
    fn grouped(&self) -> bool {
        self.n_kv_heads != self.n_heads
    }

    /// `[Q | K | V]` along the last axis with every head's keys and values: the input itself,
    /// or `[Q | K_G | V_G]` with each group's `K` columns repeated `H / G` times.
    ///
    /// # Shapes
    /// - x: `[B, T, D + 2GK]`
    /// - output: `[B, T, 3D]`
    pub(crate) fn every_head(&self, x: Tensor<3>) -> Tensor<3> {
        if !self.grouped() {
            return x;
        }
        let (h, g) = (self.n_heads, self.n_kv_heads);
        let [b, t, width] = x.dims();
        let k = width / (h + 2 * g); // D + 2GK = (H + 2G) K
        let d = h * k;
        let repeat = |part: Tensor<3>| {
            part.reshape([b, t, g, 1, k])
                .expand([b, t, g, h / g, k])
                .reshape([b, t, d])
        };
        let q = x.clone().narrow(2, 0, d);
        let keys = repeat(x.clone().narrow(2, d, g * k));
        let values = repeat(x.narrow(2, d + g * k, g * k));
        Tensor::cat(vec![q, keys, values], 2)
    }

    /// The fused projection with keys and values for every head: `c_attn` itself, or its
    /// weights and biases `[D, D + 2GK] -> [D, 3D]` by [`Self::every_head`]; for the training
    /// attention's one op, which projects inside.
    pub(crate) fn every_head_projection(&self) -> Cow<'_, Linear> {
        if !self.grouped() {
            return Cow::Borrowed(&self.c_attn);
        }
        let weight = self.c_attn.weight.val(); // [D, D + 2GK]
        let [rows, width] = weight.dims();
        let weight = self.every_head(weight.reshape([1, rows, width]));
        let bias = self.c_attn.bias.as_ref().map(|b| {
            let shared = self.every_head(b.val().reshape([1, 1, width]));
            Param::initialized(b.id, shared.reshape([-1]))
        });
        Cow::Owned(Linear {
            weight: Param::initialized(self.c_attn.weight.id, weight.reshape([rows as i32, -1])),
            bias,
        })
    }

    /// Keys or values of every head down to one per group (the heads of a group hold the
    /// same), as the cache keeps them.
    ///
    /// # Shapes
    /// - x: `[B, H, T, K]`
    /// - output: `[B, G, T, K]`
    pub(crate) fn one_per_group(&self, x: Tensor<4>) -> Tensor<4> {
        if !self.grouped() {
            return x;
        }
        let [b, h, t, k] = x.dims();
        let g = self.n_kv_heads;
        x.reshape([b, g, h / g, t, k])
            .narrow(2, 0, 1)
            .reshape([b, g, t, k])
    }
}
