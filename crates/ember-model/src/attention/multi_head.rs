//! Multi-head attention: `H` heads of width `K = D / H`, each a scaled dot-product attention
//! over its own projections of the input, concatenated and projected back to `D`.

use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Initializer, Linear, LinearConfig};
use burn::tensor::{Bool, Device, Tensor};

use crate::attention::{
    AttentionOutput, causal_attention, causal_mask, combine_masks, scaled_dot_product_attention,
};
use crate::kv_cache::KvCache;
use crate::linear::{affine, linear};
use crate::positional::apply_rotary;

/// Configuration of a [`MultiHeadAttention`].
#[derive(Debug, Clone)]
pub struct MultiHeadAttentionConfig {
    /// Model width `D`.
    pub d_model: usize,
    /// Number of heads `H`; must divide `D`.
    pub n_heads: usize,
    /// Dropout on the attention weights.
    pub dropout: f64,
    /// Whether the projections have biases.
    pub bias: bool,
    /// Rotate queries and keys with RoPE of this base (`None`: no rotation).
    pub rotary_base: Option<f64>,
    /// Standard deviation of the output projection's initial weights. GPT-2 scales it by
    /// `1/sqrt(2 * layers)` so the residual stream's variance does not grow with depth.
    pub proj_std: f64,
}

impl MultiHeadAttentionConfig {
    /// `H` heads over width `D`, with biases, no dropout and no rotation.
    pub fn new(d_model: usize, n_heads: usize) -> Self {
        Self {
            d_model,
            n_heads,
            dropout: 0.0,
            bias: true,
            rotary_base: None,
            proj_std: 0.02,
        }
    }

    /// Builds the module. `D % H == 0` is checked by the model configs that call this.
    pub fn init(&self, device: &Device) -> MultiHeadAttention {
        let linear = |d_out, std| {
            LinearConfig::new(self.d_model, d_out)
                .with_bias(self.bias)
                .with_initializer(Initializer::Normal { mean: 0.0, std })
                .init(device)
        };
        MultiHeadAttention {
            c_attn: linear(3 * self.d_model, 0.02),
            c_proj: linear(self.d_model, self.proj_std),
            attn_dropout: DropoutConfig::new(self.dropout).init(),
            n_heads: self.n_heads,
            rotary_base: self.rotary_base.unwrap_or(0.0),
        }
    }
}

/// Multi-head self- or cross-attention.
///
/// The query, key and value projections are one `[D, 3D]` matrix (GPT-2's `c_attn`): one
/// matrix multiply for self-attention; cross-attention uses its first third on the queries
/// and the rest on the encoder output.
#[derive(Module, Debug)]
pub struct MultiHeadAttention {
    /// Fused Q, K, V projection `[D, 3D]`, columns `[Q | K | V]`.
    pub c_attn: Linear,
    /// Output projection `[D, D]`.
    pub c_proj: Linear,
    /// Dropout on the attention weights.
    pub attn_dropout: Dropout,
    /// Number of heads `H`.
    pub n_heads: usize,
    /// RoPE base; 0 when queries and keys are not rotated.
    pub rotary_base: f64,
}

/// Result of an attention call: the output `[B, T, D]` and, if asked, the weights `[B, H, T, S]`.
pub type AttentionResult = (Tensor<3>, Option<Tensor<4>>);

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
        let start = cache.as_ref().map_or(0, |c| c.len());
        let qkv = linear(&self.c_attn, x); // [B, T, 3D]
        // On flex, rotary positions turn queries and keys in one op on the fused projection
        // (`flex_rotary`); elsewhere `rotate` turns them after the heads are split.
        let (qkv, rotated) = self.rotate_fused(qkv, start);
        let unrotated = self.rotary_base > 0.0 && !rotated;
        #[cfg(feature = "flex")]
        if cache.is_none()
            && causal
            && pad.is_none()
            && self.attn_dropout.prob == 0.0
            && !return_weights
            && !unrotated
            && let Some(context) =
                crate::flex_attention::causal_self_attention(qkv.clone(), self.n_heads)
        {
            // On flex: the heads' attention in one op (see `flex_attention`).
            return (linear(&self.c_proj, context), None);
        }
        let q = self.split_heads(qkv.clone().slice([0..b, 0..t, 0..d]));
        let k = self.split_heads(qkv.clone().slice([0..b, 0..t, d..2 * d]));
        let v = self.split_heads(qkv.slice([0..b, 0..t, 2 * d..3 * d]));
        let (q, k) = if unrotated {
            self.rotate(q, k, start)
        } else {
            (q, k)
        };
        let (k, v) = match cache {
            Some(cache) if cache.reads_whole_buffer() && causal && pad.is_none() => {
                // Keys of the whole buffer: query i (at position start + i) sees keys up to
                // start + i, which also hides every position not written yet.
                let (k, v) = cache.append_whole(k, v);
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
        let mask = combine_masks(causal, pad.map(crate::attention::padding_mask));
        self.attend(q, k, v, mask, return_weights)
    }

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
        let mask = memory_pad.map(crate::attention::padding_mask);
        self.attend(q, k, v, mask, return_weights)
    }

    fn attend(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        mask: Option<Tensor<4, Bool>>,
        return_weights: bool,
    ) -> AttentionResult {
        let out =
            scaled_dot_product_attention(q, k, v, mask, Some(&self.attn_dropout), return_weights);
        self.project(out)
    }

    /// Merges the heads and projects back: context `[B, H, T, K]` -> `[B, T, D]`.
    fn project(&self, out: AttentionOutput) -> AttentionResult {
        let [b, h, t, k] = out.context.dims();
        let context = out.context.swap_dims(1, 2).reshape([b, t, h * k]); // [B, T, D]
        (linear(&self.c_proj, context), out.weights)
    }

    /// The fused projection `[B, T, 3D]` of positions `start..start + T`, with its queries and
    /// keys rotated where one op does it (rotary positions on flex), and whether it did.
    fn rotate_fused(&self, qkv: Tensor<3>, start: usize) -> (Tensor<3>, bool) {
        #[cfg(feature = "flex")]
        if self.rotary_base > 0.0
            && let Some(turned) =
                crate::flex_rotary::rotate_qk(qkv.clone(), self.n_heads, start, self.rotary_base)
        {
            return (turned, true);
        }
        #[cfg(not(feature = "flex"))]
        let _ = start;
        (qkv, false)
    }

    fn rotate(&self, q: Tensor<4>, k: Tensor<4>, start: usize) -> (Tensor<4>, Tensor<4>) {
        if self.rotary_base > 0.0 {
            (
                apply_rotary(q, start, self.rotary_base),
                apply_rotary(k, start, self.rotary_base),
            )
        } else {
            (q, k)
        }
    }

    /// `[B, T, D] -> [B, H, T, K]`
    fn split_heads(&self, x: Tensor<3>) -> Tensor<4> {
        let [b, t, d] = x.dims();
        x.reshape([b, t, self.n_heads, d / self.n_heads])
            .swap_dims(1, 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::nn::attention::{MhaInput, MultiHeadAttentionConfig as BurnMhaConfig};
    use burn::tensor::{Distribution, Int};

    fn max_diff(a: Tensor<3>, b: Tensor<3>) -> f32 {
        (a - b).abs().max().into_scalar::<f32>()
    }

    /// Burn's MHA and ours with identical weights: Burn's separate Q/K/V matrices go side by
    /// side into our fused one.
    fn twin(
        d: usize,
        h: usize,
        device: &Device,
    ) -> (burn::nn::attention::MultiHeadAttention, MultiHeadAttention) {
        let theirs = BurnMhaConfig::new(d, h).with_dropout(0.0).init(device);
        let mut ours = MultiHeadAttentionConfig::new(d, h).init(device);
        let w = Tensor::cat(
            vec![
                theirs.query.weight.val(),
                theirs.key.weight.val(),
                theirs.value.weight.val(),
            ],
            1,
        );
        let b = Tensor::cat(
            vec![
                theirs.query.bias.as_ref().unwrap().val(),
                theirs.key.bias.as_ref().unwrap().val(),
                theirs.value.bias.as_ref().unwrap().val(),
            ],
            0,
        );
        ours.c_attn.weight = Param::from_tensor(w);
        ours.c_attn.bias = Some(Param::from_tensor(b));
        ours.c_proj.weight = Param::from_tensor(theirs.output.weight.val());
        ours.c_proj.bias = Some(Param::from_tensor(
            theirs.output.bias.as_ref().unwrap().val(),
        ));
        (theirs, ours)
    }

    #[test]
    fn self_attention_equals_burn_mha() {
        let device = Device::flex();
        let (theirs, ours) = twin(16, 4, &device);
        let x = Tensor::<3>::random([2, 5, 16], Distribution::Normal(0.0, 1.0), &device);
        let pad = Tensor::<2, Bool>::from_bool(
            [
                [false, false, false, false, false],
                [false, false, false, true, true],
            ],
            &device,
        );
        let want = theirs.forward(MhaInput::self_attn(x.clone()).mask_pad(pad.clone()));
        let (got, weights) = ours.forward_self(x, false, Some(pad), None, true);
        assert!(max_diff(want.context, got) < 1e-5);
        let diff = (want.weights - weights.unwrap())
            .abs()
            .max()
            .into_scalar::<f32>();
        assert!(diff < 1e-5, "weights differ by {diff}");
    }

    #[test]
    fn causal_self_attention_equals_burn_mha_with_autoregressive_mask() {
        let device = Device::flex();
        let (theirs, ours) = twin(12, 3, &device);
        let x = Tensor::<3>::random([2, 6, 12], Distribution::Normal(0.0, 1.0), &device);
        let mask = burn::nn::attention::generate_autoregressive_mask(2, 6, &device);
        let want = theirs.forward(MhaInput::self_attn(x.clone()).mask_attn(mask));
        let (got, _) = ours.forward_self(x, true, None, None, false);
        assert!(max_diff(want.context, got) < 1e-5);
    }

    #[test]
    fn cross_attention_equals_burn_mha() {
        let device = Device::flex();
        let (theirs, ours) = twin(8, 2, &device);
        let x = Tensor::<3>::random([2, 3, 8], Distribution::Normal(0.0, 1.0), &device);
        let memory = Tensor::<3>::random([2, 7, 8], Distribution::Normal(0.0, 1.0), &device);
        let pad =
            Tensor::<2, Int>::from_ints([[0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 1, 1, 1]], &device)
                .equal_elem(1);
        let want = theirs.forward(
            MhaInput::new(x.clone(), memory.clone(), memory.clone()).mask_pad(pad.clone()),
        );
        let (got, _) = ours.forward_cross(x, memory, Some(pad), None, false);
        assert!(max_diff(want.context, got) < 1e-5);
    }

    /// Output rows after permuting the input rows, and the permuted output rows.
    /// Weights are drawn at unit scale so attention is far from uniform.
    fn permuted_pair(mha: &mut MultiHeadAttention, device: &Device) -> (Tensor<3>, Tensor<3>) {
        mha.c_attn.weight = Param::from_tensor(Tensor::random(
            [8, 24],
            Distribution::Normal(0.0, 1.0),
            device,
        ));
        let x = Tensor::<3>::random([1, 5, 8], Distribution::Normal(0.0, 1.0), device);
        let perm = Tensor::<1, Int>::from_ints([3, 0, 4, 1, 2], device);
        let (out, _) = mha.forward_self(x.clone(), false, None, None, false);
        let (out_of_permuted, _) =
            mha.forward_self(x.select(1, perm.clone()), false, None, None, false);
        (out_of_permuted, out.select(1, perm))
    }

    #[test]
    fn self_attention_without_positions_is_permutation_equivariant() {
        let device = Device::flex();
        let mut mha = MultiHeadAttentionConfig::new(8, 2).init(&device);
        let (a, b) = permuted_pair(&mut mha, &device);
        assert!(max_diff(a, b) < 1e-5);
    }

    #[test]
    fn self_attention_with_rotary_positions_is_not_permutation_equivariant() {
        let device = Device::flex();
        let mut config = MultiHeadAttentionConfig::new(8, 2);
        config.rotary_base = Some(10000.0);
        let mut mha = config.init(&device);
        let (a, b) = permuted_pair(&mut mha, &device);
        assert!(max_diff(a, b) > 1e-4);
    }
}
