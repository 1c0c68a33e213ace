//! The settings shared by encoder and decoder blocks.

use burn::tensor::Device;

use crate::attention::multi_head::{MultiHeadAttention, MultiHeadAttentionConfig};
use crate::blocks::mlp::{Activation, Mlp};
use crate::blocks::norm::NormKind;
use crate::blocks::residual::Residual;
use crate::ops::rotation::Rope;

/// What every transformer block is made of; filled in by the model configs.
#[derive(Debug, Clone)]
pub struct BlockConfig {
    /// Model width `D`.
    pub d_model: usize,
    /// Attention heads `H`.
    pub n_heads: usize,
    /// Key/value heads of self-attention (`H` but for grouped-query attention).
    pub n_kv_heads: usize,
    /// Hidden width of the MLP `F`.
    pub d_ff: usize,
    /// Dropout on attention weights, sub-layer outputs and the MLP.
    pub dropout: f64,
    /// The MLP's non-linearity.
    pub activation: Activation,
    /// A gated MLP, `proj(act(gate(x)) * up(x))`.
    pub gated_mlp: bool,
    /// LayerNorm or RMSNorm.
    pub norm: NormKind,
    /// Pre-norm (`true`) or post-norm (`false`).
    pub norm_first: bool,
    /// Biases in the linear layers.
    pub bias: bool,
    /// The norms' epsilon.
    pub layer_norm_eps: f64,
    /// Self-attention's rotation, when the model uses rotary positions.
    pub rotary: Option<Rope>,
    /// Leading dimensions of each head the rotation turns (`None`: all).
    pub rotary_dims: Option<usize>,
    /// Attention and MLP side by side on the block's input (decoder blocks).
    pub parallel: bool,
    /// Init scale of the projections that write into the residual stream.
    pub proj_std: f64,
}

impl BlockConfig {
    pub(crate) fn attention(&self, rotary: bool, device: &Device) -> MultiHeadAttention {
        MultiHeadAttentionConfig {
            d_model: self.d_model,
            n_heads: self.n_heads,
            // Grouped keys and values are self-attention's (`rotary`: it alone rotates).
            n_kv_heads: if rotary {
                self.n_kv_heads
            } else {
                self.n_heads
            },
            dropout: self.dropout,
            bias: self.bias,
            rotary: if rotary { self.rotary } else { None },
            rotary_dims: if rotary { self.rotary_dims } else { None },
            proj_std: self.proj_std,
        }
        .init(device)
    }

    pub(crate) fn mlp(&self, device: &Device) -> Mlp {
        Mlp::new(
            self.d_model,
            self.d_ff,
            self.activation,
            self.gated_mlp,
            self.dropout,
            self.bias,
            self.proj_std,
            device,
        )
    }

    pub(crate) fn residual(&self, device: &Device) -> Residual {
        Residual::new(
            self.d_model,
            self.layer_norm_eps,
            self.norm_first,
            self.norm,
            device,
        )
    }
}
