//! Residual connection around a sub-layer, with a norm before it (pre-norm, GPT-2) or after
//! the sum (post-norm, the original paper's `LayerNorm(x + Sublayer(x))`).

use burn::module::Module;
use burn::nn::{Dropout, LayerNorm};
use burn::tensor::{Device, Tensor};

use crate::blocks::norm::NormKind;

/// A norm and where it sits relative to the residual sum.
#[derive(Module, Debug)]
pub struct Residual {
    /// The norm's weights (`gamma` alone for RMSNorm).
    pub norm: LayerNorm,
    /// LayerNorm or RMSNorm.
    pub kind: NormKind,
    /// `true`: `x + f(norm(x))`; `false`: `norm(x + f(x))`.
    pub norm_first: bool,
    /// The norm's epsilon (Burn's `LayerNorm` keeps its own private).
    pub eps: f64,
}

impl Residual {
    /// A residual wrapper over width `D`.
    pub fn new(
        d_model: usize,
        eps: f64,
        norm_first: bool,
        kind: NormKind,
        device: &Device,
    ) -> Self {
        Self {
            norm: kind.init(d_model, eps, device),
            kind,
            norm_first,
            eps,
        }
    }

    /// Applies `sublayer` with the residual and the norm; `dropout` applies to its output
    /// before the sum. The closure may return extra data (attention weights).
    ///
    /// # Shapes
    /// - x: `[B, T, D]`
    /// - output: `[B, T, D]`
    pub fn forward<E>(
        &self,
        x: Tensor<3>,
        dropout: Option<&Dropout>,
        sublayer: impl FnOnce(Tensor<3>) -> (Tensor<3>, E),
    ) -> (Tensor<3>, E) {
        if self.norm_first {
            let (y, extra) = sublayer(self.norm(x.clone()));
            (add(x, dropout, y), extra)
        } else {
            let (y, extra) = sublayer(x.clone());
            (self.norm(add(x, dropout, y)), extra)
        }
    }

    fn norm(&self, x: Tensor<3>) -> Tensor<3> {
        self.kind.forward(&self.norm, x, self.eps)
    }

    /// The norm alone, for a sub-layer whose sum is made elsewhere (a parallel block's MLP).
    ///
    /// # Shapes
    /// - x, output: `[B, T, D]`
    pub fn normalized(&self, x: Tensor<3>) -> Tensor<3> {
        self.norm(x)
    }
}

/// `x + dropout(y)` (one kernel on GPUs in training: `ops::add_dropout`), or `x + y`.
fn add(x: Tensor<3>, dropout: Option<&Dropout>, y: Tensor<3>) -> Tensor<3> {
    match dropout {
        Some(dropout) => crate::ops::add_dropout(x, dropout, y),
        None => x + y,
    }
}
