//! Multi-head attention: `H` heads of width `K = D / H`, each a scaled dot-product attention
//! over its own projections of the input, concatenated and projected back to `D`.
//!
//! The module and its parts live here; what it computes is in [`super::self_attention`]
//! (masked self-attention) and [`super::cross_attention`] (encoder-decoder attention).

use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Initializer, Linear, LinearConfig};
use burn::tensor::{Bool, Device, Tensor};

use super::scaled_dot_product::{AttentionOutput, scaled_dot_product_attention};
use crate::ops::linear;
use crate::ops::rotation::Rope;

/// Configuration of a [`MultiHeadAttention`].
#[derive(Debug, Clone)]
pub struct MultiHeadAttentionConfig {
    /// Model width `D`.
    pub d_model: usize,
    /// Number of heads `H`; must divide `D`.
    pub n_heads: usize,
    /// Key/value heads `G`, dividing `H`: each shared by `H / G` query heads (grouped-query
    /// attention, Ainslie et al. 2023; LLaMA 2's and Mistral's). `H` for multi-head attention.
    pub n_kv_heads: usize,
    /// Dropout on the attention weights.
    pub dropout: f64,
    /// Whether the projections have biases.
    pub bias: bool,
    /// Rotate queries and keys with this rotation (`None`: no rotation).
    pub rotary: Option<Rope>,
    /// How many leading dimensions of each head the rotation turns (`None`: all; GPT-NeoX's
    /// `rotary_pct`, a quarter in Pythia); the rest pass unturned.
    pub rotary_dims: Option<usize>,
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
            n_kv_heads: n_heads,
            dropout: 0.0,
            bias: true,
            rotary: None,
            rotary_dims: None,
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
        let kv_width = self.d_model / self.n_heads * self.n_kv_heads;
        MultiHeadAttention {
            c_attn: linear(self.d_model + 2 * kv_width, 0.02),
            c_proj: linear(self.d_model, self.proj_std),
            attn_dropout: DropoutConfig::new(self.dropout).init(),
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            rotary: self.rotary,
            rotary_dims: self.rotary_dims.unwrap_or(0),
        }
    }
}

/// Multi-head self- or cross-attention.
///
/// The query, key and value projections are one `[D, 3D]` matrix (GPT-2's `c_attn`): one
/// matrix multiply for self-attention; cross-attention uses its first third on the queries
/// and the rest on the encoder output. With `G < H` key/value heads (grouped-query
/// attention) it is `[D, D + 2GK]`, and each key/value head serves `H / G` query heads.
#[derive(Module, Debug)]
pub struct MultiHeadAttention {
    /// Fused Q, K, V projection `[D, 3D]`, columns `[Q | K | V]` (`[D, D + 2GK]` grouped).
    pub c_attn: Linear,
    /// Output projection `[D, D]`.
    pub c_proj: Linear,
    /// Dropout on the attention weights.
    pub attn_dropout: Dropout,
    /// Number of heads `H`.
    pub n_heads: usize,
    /// Key/value heads `G` (`H` but in grouped-query attention).
    pub n_kv_heads: usize,
    /// How queries and keys are rotated; `None` when they are not.
    #[module(skip)]
    pub rotary: Option<Rope>,
    /// Leading dimensions of each head the rotation turns; 0 for the whole head.
    pub rotary_dims: usize,
}

/// Result of an attention call: the output `[B, T, D]` and, if asked, the weights `[B, H, T, S]`.
pub type AttentionResult = (Tensor<3>, Option<Tensor<4>>);

impl MultiHeadAttention {
    pub(super) fn attend(
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
    pub(super) fn project(&self, out: AttentionOutput) -> AttentionResult {
        let [b, h, t, k] = out.context.dims();
        let context = out.context.swap_dims(1, 2).reshape([b, t, h * k]); // [B, T, D]
        (linear(&self.c_proj, context), out.weights)
    }

    /// `[B, T, D] -> [B, H, T, K]`
    pub(super) fn split_heads(&self, x: Tensor<3>) -> Tensor<4> {
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
        config.rotary = Some(10000.0.into());
        let mut mha = config.init(&device);
        let (a, b) = permuted_pair(&mut mha, &device);
        assert!(max_diff(a, b) > 1e-4);
    }
}
