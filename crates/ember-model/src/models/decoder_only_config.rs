//! Configuration of the GPT-style [`DecoderOnly`] language model.

use burn::serde::{Deserialize, Serialize};
use burn::tensor::Device;

use crate::blocks::config::BlockConfig;
use crate::blocks::mlp::Activation;
use crate::blocks::norm::NormKind;
use crate::error::{ConfigError, epsilon, positive, probability};
use crate::models::decoder_only::DecoderOnly;
use crate::positions::{PositionInit, PositionalKind, Rope, RopeScaling};

/// Every setting of a [`DecoderOnly`] model. Missing TOML keys take the defaults shown; unknown
/// keys are rejected.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(crate = "burn::serde", default, deny_unknown_fields)]
pub struct DecoderOnlyConfig {
    /// Vocabulary size `V` (set from the tokenizer by the trainer). Default 0: must be set.
    pub vocab_size: usize,
    /// Model width `D`. Default 128.
    pub d_model: usize,
    /// Attention heads `H`; must divide `d_model`. Default 4.
    pub n_heads: usize,
    /// Key/value heads `G` of grouped-query attention (LLaMA 2's, Mistral's): each shared by
    /// `H / G` query heads, so the projections to keys and values are `G / H` the size. Must
    /// divide `n_heads`. Default `n_heads` (multi-head attention).
    pub n_kv_heads: Option<usize>,
    /// Number of decoder blocks. Default 4.
    pub n_layers: usize,
    /// MLP hidden width `F`. Default `4 * d_model`.
    pub d_ff: Option<usize>,
    /// A gated MLP, `proj(act(gate(x)) * up(x))` (with `activation = "silu"` LLaMA's SwiGLU):
    /// three `D x F` matrices where the plain MLP has two. Default false.
    pub gated_mlp: bool,
    /// Longest sequence the model is trained on and attends over. Default 64.
    pub context_len: usize,
    /// Size of the positional table; at least `context_len`. Default `context_len`.
    pub max_positions: Option<usize>,
    /// `learned` (default), `sinusoidal`, `rotary` or `none`.
    pub positional: PositionalKind,
    /// How a learned position table starts: `normal` (default, `N(0, 0.02)` as in GPT-2) or
    /// `sinusoidal` (the sinusoidal table scaled to RMS 0.02). Only for `positional = "learned"`.
    pub position_init: PositionInit,
    /// Base of the rotary angles. Default 10000.
    pub rotary_base: f64,
    /// The rotary frequencies stretched for a longer context: `{ kind = "linear", factor = F }`
    /// or Llama 3.1's `{ kind = "llama3", factor = 32.0, low_freq_factor = 1.0,
    /// high_freq_factor = 4.0, original_max_positions = 8192 }`. Default none (RoPE's own).
    /// Only for `positional = "rotary"`.
    pub rotary_scaling: Option<RopeScaling>,
    /// How many leading dimensions of each head the rotation turns (even, at most the head
    /// size), the rest passing unturned: GPT-NeoX's `rotary_pct` (Pythia turns a quarter).
    /// Default the whole head. Only for `positional = "rotary"`.
    pub rotary_dims: Option<usize>,
    /// Pre-norm (`true`, default, GPT-2) or post-norm (`false`, the original paper).
    pub norm_first: bool,
    /// Attention and MLP side by side on each block's input, `x + attn(ln_1(x)) +
    /// mlp(ln_2(x))` (GPT-J's, GPT-NeoX's and Pythia's blocks), instead of the MLP after the
    /// attention. Default false. Pre-norm only.
    pub parallel_blocks: bool,
    /// `gelu` (default), `gelu_tanh`, `relu` or `silu`.
    pub activation: Activation,
    /// `layer_norm` (default) or `rms_norm` (LLaMA's: no centring, no bias).
    pub norm: NormKind,
    /// Dropout probability in `[0, 1)` on the embedded input, the attention weights, each
    /// sub-layer's output and the MLP (where GPT-2 and nanoGPT drop). Default 0.
    pub dropout: f64,
    /// Biases in linear layers. Default true.
    pub bias: bool,
    /// Share the token embedding with the output head (weight tying). Default true.
    pub tie_weights: bool,
    /// The norms' epsilon. Default 1e-5.
    pub layer_norm_eps: f64,
}

impl Default for DecoderOnlyConfig {
    fn default() -> Self {
        Self {
            vocab_size: 0,
            d_model: 128,
            n_heads: 4,
            n_kv_heads: None,
            n_layers: 4,
            d_ff: None,
            gated_mlp: false,
            context_len: 64,
            max_positions: None,
            positional: PositionalKind::Learned,
            position_init: PositionInit::Normal,
            rotary_base: 10000.0,
            rotary_scaling: None,
            rotary_dims: None,
            norm_first: true,
            parallel_blocks: false,
            activation: Activation::Gelu,
            norm: NormKind::LayerNorm,
            dropout: 0.0,
            bias: true,
            tie_weights: true,
            layer_norm_eps: 1e-5,
        }
    }
}

impl DecoderOnlyConfig {
    /// MLP width: `d_ff`, or `4 * d_model`.
    pub fn d_ff(&self) -> usize {
        self.d_ff.unwrap_or(4 * self.d_model)
    }

    /// Key/value heads: `n_kv_heads`, or `n_heads`.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// The rotation of rotary positions: `rotary_base`, stretched by `rotary_scaling`.
    pub fn rope(&self) -> Rope {
        Rope {
            base: self.rotary_base,
            scaling: self.rotary_scaling,
        }
    }

    /// Positional table size: `max_positions`, or `context_len`.
    pub fn max_positions(&self) -> usize {
        self.max_positions.unwrap_or(self.context_len)
    }

    /// Checks every field; the error names the first one at fault.
    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("vocab_size", self.vocab_size)?;
        positive("n_layers", self.n_layers)?;
        positive("context_len", self.context_len)?;
        validate_attention(self.d_model, self.n_heads, self.positional)?;
        positive("d_ff", self.d_ff())?;
        if let Some(groups) = self.n_kv_heads
            && (groups == 0 || !self.n_heads.is_multiple_of(groups))
        {
            return Err(ConfigError::new(
                "n_kv_heads",
                format!(
                    "= {groups} must divide n_heads = {}: each key/value head serves the same \
                     number of query heads",
                    self.n_heads
                ),
            ));
        }
        positive("max_positions", self.max_positions())?;
        if self.context_len > self.max_positions() {
            return Err(ConfigError::new(
                "context_len",
                format!(
                    "is {} but the positional table has only {} positions (max_positions)",
                    self.context_len,
                    self.max_positions()
                ),
            ));
        }
        if self.position_init != PositionInit::Normal && self.positional != PositionalKind::Learned
        {
            return Err(ConfigError::new(
                "position_init",
                "is \"sinusoidal\", which starts a learned position table: it needs \
                 positional = \"learned\"",
            ));
        }
        if let Some(dims) = self.rotary_dims {
            let head = self.d_model / self.n_heads;
            if self.positional != PositionalKind::Rotary {
                return Err(ConfigError::new(
                    "rotary_dims",
                    "sizes the rotation of rotary positions: it needs positional = \"rotary\"",
                ));
            }
            if dims == 0 || !dims.is_multiple_of(2) || dims > head {
                return Err(ConfigError::new(
                    "rotary_dims",
                    format!("must be even, from 2 to the head size {head}, got {dims}"),
                ));
            }
        }
        if let Some(scaling) = self.rotary_scaling {
            if self.positional != PositionalKind::Rotary {
                return Err(ConfigError::new(
                    "rotary_scaling",
                    "stretches the frequencies of rotary positions: it needs positional = \
                     \"rotary\"",
                ));
            }
            if let Some(message) = scaling.invalid() {
                return Err(ConfigError::new("rotary_scaling", message));
            }
        }
        if self.parallel_blocks && !self.norm_first {
            return Err(ConfigError::new(
                "parallel_blocks",
                "needs pre-norm blocks (norm_first = true): side by side, attention and MLP \
                 each normalise the block's input",
            ));
        }
        probability("dropout", self.dropout)?;
        epsilon("layer_norm_eps", self.layer_norm_eps)?;
        epsilon("rotary_base", self.rotary_base)
    }

    /// Validates the config and builds the model with fresh weights on `device`.
    pub fn init(&self, device: &Device) -> Result<DecoderOnly, ConfigError> {
        self.validate()?;
        Ok(DecoderOnly::new(self.clone(), device))
    }

    pub(crate) fn block(&self) -> BlockConfig {
        BlockConfig {
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads(),
            d_ff: self.d_ff(),
            dropout: self.dropout,
            activation: self.activation,
            gated_mlp: self.gated_mlp,
            norm: self.norm,
            norm_first: self.norm_first,
            bias: self.bias,
            layer_norm_eps: self.layer_norm_eps,
            rotary: (self.positional == PositionalKind::Rotary).then(|| self.rope()),
            rotary_dims: self.rotary_dims,
            parallel: self.parallel_blocks,
            proj_std: 0.02 / (2.0 * self.n_layers as f64).sqrt(),
        }
    }
}

/// Width and heads: both positive, `H` divides `D`, and rotary needs an even head size.
pub(crate) fn validate_attention(
    d_model: usize,
    n_heads: usize,
    positional: PositionalKind,
) -> Result<(), ConfigError> {
    positive("d_model", d_model)?;
    positive("n_heads", n_heads)?;
    if !d_model.is_multiple_of(n_heads) {
        return Err(ConfigError::new(
            "n_heads",
            format!("= {n_heads} does not divide d_model = {d_model}"),
        ));
    }
    if positional == PositionalKind::Rotary && !(d_model / n_heads).is_multiple_of(2) {
        return Err(ConfigError::new(
            "positional",
            format!(
                "= rotary needs an even head size, but d_model / n_heads = {}",
                d_model / n_heads
            ),
        ));
    }
    Ok(())
}
