//! The position-wise feed-forward network: `proj(act(fc(x)))`, applied to each position alone;
//! or gated (Shazeer 2020; LLaMA's SwiGLU with `silu`): `proj(act(gate(x)) * up(x))`, the
//! activated half of a double-width expansion multiplying the other half.

use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Initializer, Linear, LinearConfig};
use burn::serde::{Deserialize, Serialize};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use crate::ops::linear;

/// The MLP's non-linearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(crate = "burn::serde", rename_all = "snake_case")]
pub enum Activation {
    /// Exact GELU, `x * Phi(x)`.
    #[default]
    Gelu,
    /// GELU with the tanh approximation (GPT-2's `gelu_new`).
    GeluTanh,
    /// `max(0, x)`, as in the original transformer.
    Relu,
    /// `x * sigmoid(x)` (SiLU, or swish; LLaMA's gated MLP).
    Silu,
}

impl Activation {
    /// Applies the non-linearity element-wise.
    pub fn forward<const N: usize>(&self, x: Tensor<N>) -> Tensor<N> {
        match self {
            Activation::Gelu => crate::ops::gelu(x),
            Activation::GeluTanh => crate::ops::gelu_tanh(x),
            Activation::Relu => relu(x),
            Activation::Silu => crate::ops::silu(x),
        }
    }

    /// `self.forward(linear(layer, x))`; a GELU goes with the product into one kernel where
    /// a GPU decodes a few rows ([`crate::ops::linear_gelu`]).
    pub fn after_linear<const N: usize>(&self, layer: &Linear, x: Tensor<N>) -> Tensor<N> {
        match self {
            Activation::Gelu => crate::ops::linear_gelu(layer, x, false),
            Activation::GeluTanh => crate::ops::linear_gelu(layer, x, true),
            Activation::Relu => relu(linear(layer, x)),
            Activation::Silu => crate::ops::silu(linear(layer, x)),
        }
    }
}

impl std::fmt::Display for Activation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::Relu => "relu",
            Activation::Silu => "silu",
        };
        f.write_str(name)
    }
}

// A constant field of a module: no weights, not saved. (The macro calls itself unqualified.)
use burn::empty;
empty!(Activation);

/// Position-wise feed-forward network `D -> F -> D`.
#[derive(Module, Debug)]
pub struct Mlp {
    /// `[D, F]` expansion (GPT-2's `c_fc`); gated, `[D, 2F]`, columns `[gate | up]`.
    pub c_fc: Linear,
    /// `[F, D]` projection back (GPT-2's `c_proj`).
    pub c_proj: Linear,
    /// The non-linearity between them.
    pub activation: Activation,
    /// Gated: `proj(act(gate(x)) * up(x))`.
    pub gated: bool,
    /// Dropout after the projection.
    pub dropout: Dropout,
}

impl Mlp {
    /// A `D -> F -> D` MLP (gated: `F` twice, for the gate and the values it multiplies);
    /// `proj_std` is the init scale of the projection back to `D`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        d_model: usize,
        d_ff: usize,
        activation: Activation,
        gated: bool,
        dropout: f64,
        bias: bool,
        proj_std: f64,
        device: &Device,
    ) -> Self {
        let linear = |d_in, d_out, std| {
            LinearConfig::new(d_in, d_out)
                .with_bias(bias)
                .with_initializer(Initializer::Normal { mean: 0.0, std })
                .init(device)
        };
        Self {
            c_fc: linear(d_model, if gated { 2 * d_ff } else { d_ff }, 0.02),
            c_proj: linear(d_ff, d_model, proj_std),
            activation,
            gated,
            dropout: DropoutConfig::new(dropout).init(),
        }
    }

    /// # Shapes
    /// - x: `[B, T, D]`
    /// - output: `[B, T, D]`
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        crate::ops::dropout(&self.dropout, self.forward_undropped(x))
    }

    /// [`Mlp::forward`] before its dropout: a block drops it as it adds it to the residual
    /// stream (`ops::add_dropout`, one kernel on GPUs).
    ///
    /// # Shapes
    /// - x: `[B, T, D]`
    /// - output: `[B, T, D]`
    pub fn forward_undropped(&self, x: Tensor<3>) -> Tensor<3> {
        let dtype = x.dtype();
        // act(fc(x)), [B, T, F]: in mixed precision kept in the products' type (bf16), as
        // PyTorch's autocast keeps it; the projection back is widened to the residual stream's.
        let h = match self.gated {
            false => self.activation.after_linear(&self.c_fc, x),
            true => {
                let both = linear(&self.c_fc, x); // [B, T, 2F]: [gate | up]
                if self.activation == Activation::Silu {
                    // SwiGLU in one op: one pass each way on flex.
                    crate::ops::gated_silu(both)
                } else {
                    let [b, t, f2] = both.dims();
                    let gate = both.clone().slice([0..b, 0..t, 0..f2 / 2]);
                    let up = both.slice([0..b, 0..t, f2 / 2..f2]);
                    self.activation.forward(gate) * up
                }
            }
        };
        crate::ops::linear_into(&self.c_proj, h, dtype)
    }
}
