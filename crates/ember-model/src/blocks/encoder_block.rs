//! Encoder block: self-attention over the whole source, then the MLP, each wrapped in a
//! residual connection with LayerNorm.

use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig};
use burn::tensor::{Bool, Device, Tensor};

use crate::attention::multi_head::MultiHeadAttention;
use crate::blocks::config::BlockConfig;
use crate::blocks::mlp::Mlp;
use crate::blocks::residual::Residual;

/// One encoder layer.
#[derive(Module, Debug)]
pub struct EncoderBlock {
    /// Norm around the self-attention.
    pub ln_1: Residual,
    /// Bidirectional self-attention.
    pub attn: MultiHeadAttention,
    /// Norm around the MLP.
    pub ln_2: Residual,
    /// Position-wise feed-forward network.
    pub mlp: Mlp,
    /// Dropout on the attention output before the residual sum.
    pub dropout: Dropout,
}

impl EncoderBlock {
    /// Builds a block from the shared settings.
    pub fn new(config: &BlockConfig, device: &Device) -> Self {
        Self {
            ln_1: config.residual(device),
            attn: config.attention(true, device),
            ln_2: config.residual(device),
            mlp: config.mlp(device),
            dropout: DropoutConfig::new(config.dropout).init(),
        }
    }

    /// # Shapes
    /// - x: `[B, S, D]`
    /// - pad: `[B, S]`, `true` at padding
    /// - output: `[B, S, D]`, weights `[B, H, S, S]` when asked for
    pub fn forward(
        &self,
        x: Tensor<3>,
        pad: Option<Tensor<2, Bool>>,
        return_weights: bool,
    ) -> (Tensor<3>, Option<Tensor<4>>) {
        let (x, weights) = self.ln_1.forward(x, Some(&self.dropout), |h| {
            self.attn.forward_self(h, false, pad, None, return_weights)
        });
        let (x, ()) = self.ln_2.forward(x, Some(&self.mlp.dropout), |h| {
            (self.mlp.forward_undropped(h), ())
        });
        (x, weights)
    }
}
