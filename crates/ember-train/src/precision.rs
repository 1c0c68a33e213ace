//! `[training] precision`: the float type of the training step's matrix products.

use std::borrow::Cow;

use burn::module::Module;
use burn::tensor::{Device, FloatDType};
use serde::{Deserialize, Serialize};

use crate::error::{Result, value_err};

/// How a training step computes. The weights, the optimizer's moments, the checkpoints and
/// everything but the products stay `f32` either way (see [`ember_model::precision`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in `f32` (CUDA runs the products on tensor cores as TF32).
    #[default]
    #[serde(alias = "fp32")]
    F32,
    /// Products of linear layers and the tied head in bf16 (rounded inputs, `f32` results);
    /// layer norms, softmax, loss, residual stream and weights in `f32`. For GPUs with bf16
    /// tensor cores; on a CPU it is slower than `f32`.
    Bf16,
}

impl Precision {
    /// The model a step's forward pass runs: `model` itself in `f32`; in `bf16` a view whose
    /// product weights are tracked bf16 casts of `model`'s, so gradients found on `model`'s
    /// parameters (`GradientsParams::from_grads(loss.backward(), model)`) are `f32`.
    pub fn compute<M: Module + Clone>(self, model: &M) -> Cow<'_, M> {
        match self {
            Precision::F32 => Cow::Borrowed(model),
            Precision::Bf16 => Cow::Owned(ember_model::precision::products_in(
                model.clone(),
                FloatDType::BF16,
            )),
        }
    }

    /// Checks that every device of a run computes in this precision.
    pub fn check(self, devices: &[Device], names: &str) -> Result<()> {
        if self == Precision::Bf16
            && let Some(i) = devices
                .iter()
                .position(|d| !d.supports_dtype(FloatDType::BF16))
        {
            let name = names.split(',').nth(i).unwrap_or(names).trim();
            return Err(value_err(
                "training.precision",
                format!("= \"bf16\": device `{name}` has no bf16 arithmetic; use \"f32\" there"),
            ));
        }
        Ok(())
    }
}
