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
    /// Bytes of one value of the products' inputs: 4 in `f32`, 2 in `bf16`.
    pub fn product_bytes(self) -> u64 {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 => 2,
        }
    }

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

    /// A warning where bf16 runs on a CPU device (flex, ndarray), which computes bf16 products
    /// by widening them to `f32` and back: slower than `f32` there (GPT-2 small's config on 2
    /// Xeon cores: about 65 s a step against 54).
    pub fn warning(self, devices: &[Device], names: &str) -> Option<String> {
        if self != Precision::Bf16 {
            return None;
        }
        let i = devices.iter().position(|d| !ember_kernels::on_cubecl(d))?;
        let name = names.split(',').nth(i).unwrap_or(names).trim();
        Some(format!(
            "warning: training.precision = \"bf16\" on the CPU device `{name}` is slower than \
             \"f32\" there (bf16 is for GPUs with bf16 tensor cores)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 on a CPU device warns once, naming the first CPU device of the list; f32 does not.
    #[test]
    fn bf16_on_a_cpu_device_warns() {
        let devices = [Device::flex(), Device::flex()];
        let warning = Precision::Bf16
            .warning(&devices, "cpu, flex")
            .expect("a warning");
        assert!(
            warning.contains("`cpu`") && warning.contains("slower"),
            "{warning}"
        );
        assert_eq!(Precision::F32.warning(&devices, "cpu, flex"), None);
    }
}
