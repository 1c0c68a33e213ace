//! Configuration of the [`EncoderDecoder`] translation model.

use burn::serde::{Deserialize, Serialize};
use burn::tensor::Device;

use crate::blocks::config::BlockConfig;
use crate::blocks::mlp::Activation;
use crate::error::{ConfigError, epsilon, positive, probability};
use crate::models::decoder_only_config::validate_attention;
use crate::models::encoder_decoder::EncoderDecoder;
use crate::positions::PositionalKind;

/// Every setting of an [`EncoderDecoder`] model. Defaults follow the original transformer's
/// choices (sinusoidal positions, ReLU, scaled embeddings) at a small size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(crate = "burn::serde", default, deny_unknown_fields)]
pub struct EncoderDecoderConfig {
    /// Source vocabulary size (set from the tokenizer by the trainer).
    pub src_vocab_size: usize,
    /// Target vocabulary size (set from the tokenizer by the trainer).
    pub tgt_vocab_size: usize,
    /// One embedding table for source and target (needs equal vocabularies). Default false.
    pub shared_embeddings: bool,
    /// Tie the output projection to the target embedding. Default true.
    pub tie_output: bool,
    /// Model width `D`. Default 256.
    pub d_model: usize,
    /// Attention heads `H`. Default 8.
    pub n_heads: usize,
    /// Encoder blocks. Default 3.
    pub n_encoder_layers: usize,
    /// Decoder blocks. Default 3.
    pub n_decoder_layers: usize,
    /// MLP hidden width. Default `4 * d_model`.
    pub d_ff: Option<usize>,
    /// Longest source or target sequence. Default 256.
    pub max_positions: usize,
    /// `sinusoidal` (default), `learned`, `rotary` or `none`.
    pub positional: PositionalKind,
    /// Base of the rotary angles. Default 10000.
    pub rotary_base: f64,
    /// Pre-norm (`true`, default) or post-norm (`false`, the original paper).
    pub norm_first: bool,
    /// `relu` (default), `gelu` or `gelu_tanh`.
    pub activation: Activation,
    /// Dropout probability. Default 0.1.
    pub dropout: f64,
    /// Biases in linear layers. Default true.
    pub bias: bool,
    /// Multiply embeddings by `sqrt(D)` as the paper does. Default true.
    pub scale_embeddings: bool,
    /// LayerNorm epsilon. Default 1e-5.
    pub layer_norm_eps: f64,
}

impl Default for EncoderDecoderConfig {
    fn default() -> Self {
        Self {
            src_vocab_size: 0,
            tgt_vocab_size: 0,
            shared_embeddings: false,
            tie_output: true,
            d_model: 256,
            n_heads: 8,
            n_encoder_layers: 3,
            n_decoder_layers: 3,
            d_ff: None,
            max_positions: 256,
            positional: PositionalKind::Sinusoidal,
            rotary_base: 10000.0,
            norm_first: true,
            activation: Activation::Relu,
            dropout: 0.1,
            bias: true,
            scale_embeddings: true,
            layer_norm_eps: 1e-5,
        }
    }
}

impl EncoderDecoderConfig {
    /// MLP width: `d_ff`, or `4 * d_model`.
    pub fn d_ff(&self) -> usize {
        self.d_ff.unwrap_or(4 * self.d_model)
    }

    /// Checks every field; the error names the first one at fault.
    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("src_vocab_size", self.src_vocab_size)?;
        positive("tgt_vocab_size", self.tgt_vocab_size)?;
        positive("n_encoder_layers", self.n_encoder_layers)?;
        positive("n_decoder_layers", self.n_decoder_layers)?;
        validate_attention(self.d_model, self.n_heads, self.positional)?;
        positive("d_ff", self.d_ff())?;
        positive("max_positions", self.max_positions)?;
        if self.shared_embeddings && self.src_vocab_size != self.tgt_vocab_size {
            return Err(ConfigError::new(
                "shared_embeddings",
                format!(
                    "needs equal vocabularies, but src_vocab_size = {} and tgt_vocab_size = {}",
                    self.src_vocab_size, self.tgt_vocab_size
                ),
            ));
        }
        probability("dropout", self.dropout)?;
        epsilon("layer_norm_eps", self.layer_norm_eps)?;
        epsilon("rotary_base", self.rotary_base)
    }

    /// Validates the config and builds the model with fresh weights on `device`.
    pub fn init(&self, device: &Device) -> Result<EncoderDecoder, ConfigError> {
        self.validate()?;
        Ok(EncoderDecoder::new(self.clone(), device))
    }

    pub(crate) fn block(&self) -> BlockConfig {
        let layers = self.n_encoder_layers.max(self.n_decoder_layers);
        BlockConfig {
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_kv_heads: self.n_heads,
            d_ff: self.d_ff(),
            dropout: self.dropout,
            activation: self.activation,
            gated_mlp: false,
            norm: crate::NormKind::LayerNorm,
            norm_first: self.norm_first,
            bias: self.bias,
            layer_norm_eps: self.layer_norm_eps,
            rotary: (self.positional == PositionalKind::Rotary).then_some(self.rotary_base.into()),
            rotary_dims: None,
            parallel: false,
            proj_std: 0.02 / (2.0 * layers as f64).sqrt(),
        }
    }
}
