//! Decoder block: masked (causal) self-attention, then attention over the encoder output
//! (absent in decoder-only models), then the MLP; each in a residual connection with LayerNorm.
//! A decoder-only model's block may instead take attention and MLP side by side on its input
//! (`parallel`, GPT-J's and Pythia's: `x + attn(ln_1(x)) + mlp(ln_2(x))`).

use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig};
use burn::tensor::{Bool, Device, Tensor};

use crate::attention::kv_cache::KvCache;
use crate::attention::multi_head::MultiHeadAttention;
use crate::blocks::config::BlockConfig;
use crate::blocks::mlp::Mlp;
use crate::blocks::residual::Residual;

/// What the decoder attends to in cross-attention: the encoder output and its padding.
#[derive(Debug, Clone)]
pub struct Memory {
    /// Encoder output `[B, S, D]`.
    pub states: Tensor<3>,
    /// `[B, S]`, `true` at padded source positions.
    pub pad: Option<Tensor<2, Bool>>,
}

/// Attention weights of one block, when asked for.
#[derive(Debug, Clone, Default)]
pub struct BlockWeights {
    /// Self-attention weights `[B, H, T, T + cached]`.
    pub self_attn: Option<Tensor<4>>,
    /// Cross-attention weights `[B, H, T, S]`.
    pub cross_attn: Option<Tensor<4>>,
}

/// One decoder layer.
#[derive(Module, Debug)]
pub struct DecoderBlock {
    /// Norm around the self-attention.
    pub ln_1: Residual,
    /// Causal self-attention.
    pub attn: MultiHeadAttention,
    /// Norm around the cross-attention (encoder-decoder models only).
    pub ln_cross: Option<Residual>,
    /// Encoder-decoder attention (encoder-decoder models only).
    pub cross_attn: Option<MultiHeadAttention>,
    /// Norm around the MLP.
    pub ln_2: Residual,
    /// Position-wise feed-forward network.
    pub mlp: Mlp,
    /// Dropout on attention outputs before the residual sum.
    pub dropout: Dropout,
    /// Attention and MLP side by side on the block's input (`x + attn(ln_1(x)) +
    /// mlp(ln_2(x))`) rather than one after the other.
    pub parallel: bool,
}

impl DecoderBlock {
    /// Builds a block; `cross_attention` adds the encoder-decoder attention.
    pub fn new(config: &BlockConfig, cross_attention: bool, device: &Device) -> Self {
        Self {
            ln_1: config.residual(device),
            attn: config.attention(true, device),
            ln_cross: cross_attention.then(|| config.residual(device)),
            cross_attn: cross_attention.then(|| config.attention(false, device)),
            ln_2: config.residual(device),
            mlp: config.mlp(device),
            dropout: DropoutConfig::new(config.dropout).init(),
            parallel: config.parallel && !cross_attention,
        }
    }

    /// Runs the block on `T` new positions.
    ///
    /// `pad` is `true` at padded target positions, over all `S_self = cached + T` keys.
    /// With caches, keys and values of the new positions are appended to `self_cache` and the
    /// encoder's are projected once into `cross_cache`.
    ///
    /// # Shapes
    /// - x: `[B, T, D]`
    /// - output: `[B, T, D]`
    pub fn forward(
        &self,
        x: Tensor<3>,
        pad: Option<Tensor<2, Bool>>,
        memory: Option<&Memory>,
        caches: Option<(&mut KvCache, &mut KvCache)>,
        return_weights: bool,
    ) -> (Tensor<3>, BlockWeights) {
        let (self_cache, cross_cache) = match caches {
            Some((s, c)) => (Some(s), Some(c)),
            None => (None, None),
        };
        // Side by side, the MLP reads the block's input, normalised by its own LayerNorm.
        let mlp_input = self.parallel.then(|| self.ln_2.normalized(x.clone()));
        let (mut x, self_attn) = self.ln_1.forward(x, Some(&self.dropout), |h| {
            self.attn
                .forward_self(h, true, pad, self_cache, return_weights)
        });
        if let Some(h) = mlp_input {
            let y = self.mlp.forward_undropped(h);
            let x = crate::ops::add_dropout(x, &self.mlp.dropout, y);
            return (
                x,
                BlockWeights {
                    self_attn,
                    cross_attn: None,
                },
            );
        }
        let mut cross_weights = None;
        if let (Some(ln), Some(cross), Some(memory)) = (&self.ln_cross, &self.cross_attn, memory) {
            let (y, w) = ln.forward(x, Some(&self.dropout), |h| {
                cross.forward_cross(
                    h,
                    memory.states.clone(),
                    memory.pad.clone(),
                    cross_cache,
                    return_weights,
                )
            });
            x = y;
            cross_weights = w;
        }
        let (x, ()) = self.ln_2.forward(x, Some(&self.mlp.dropout), |h| {
            (self.mlp.forward_undropped(h), ())
        });
        (
            x,
            BlockWeights {
                self_attn,
                cross_attn: cross_weights,
            },
        )
    }
}
