//! The normalisation of each residual connection and of the final states: LayerNorm (Ba et al.
//! 2016; the original transformer's and GPT-2's), `(x - mean) / sqrt(var + eps) * gamma + beta`,
//! or RMSNorm (Zhang and Sennrich 2019; LLaMA's), `x / sqrt(mean(x^2) + eps) * gamma`: no
//! centring and no bias, one reduction fewer.

use burn::nn::{LayerNorm, LayerNormConfig};
use burn::serde::{Deserialize, Serialize};
use burn::tensor::{Device, Tensor};

/// Which normalisation a model's norms apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(crate = "burn::serde", rename_all = "snake_case")]
pub enum NormKind {
    /// LayerNorm: centred, scaled by `gamma`, shifted by `beta`.
    #[default]
    LayerNorm,
    /// RMSNorm: divided by the root mean square, scaled by `gamma`.
    RmsNorm,
}

impl NormKind {
    /// The norm's weights over width `D`: `gamma` and `beta` (LayerNorm) or `gamma` alone
    /// (RMSNorm), in Burn's `LayerNorm` either way, so that both save under the same names.
    pub fn init(self, d_model: usize, eps: f64, device: &Device) -> LayerNorm {
        LayerNormConfig::new(d_model)
            .with_epsilon(eps)
            .with_bias(self == NormKind::LayerNorm)
            .init(device)
    }

    /// Normalises over the last dimension with `norm`'s weights.
    ///
    /// # Shapes
    /// - x, output: `[..., D]`
    pub fn forward<const N: usize>(self, norm: &LayerNorm, x: Tensor<N>, eps: f64) -> Tensor<N> {
        match self {
            NormKind::LayerNorm => crate::ops::layer_norm(norm, x, eps),
            NormKind::RmsNorm => crate::ops::rms_norm(x, norm.gamma.val(), eps),
        }
    }
}

impl std::fmt::Display for NormKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NormKind::LayerNorm => "layer_norm",
            NormKind::RmsNorm => "rms_norm",
        })
    }
}

// A constant field of a module: no weights, not saved. (The macro calls itself unqualified.)
use burn::empty;
empty!(NormKind);

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;

    /// A row by hand: `[3, 4]` has mean square 12.5; with gamma `[1, 2]` and eps 0 the output is
    /// `[3, 8] / sqrt(12.5)`.
    #[test]
    fn rms_norm_by_hand() {
        let device = Device::flex();
        let x = Tensor::<2>::from_floats([[3.0, 4.0], [0.0, -2.0]], &device);
        let gamma = Tensor::<1>::from_floats([1.0, 2.0], &device);
        let got: Vec<f32> = crate::ops::rms_norm(x, gamma, 0.0)
            .try_into_vec_as::<f32>()
            .unwrap();
        let r = 12.5f32.sqrt();
        let want = [3.0 / r, 8.0 / r, 0.0, -2.0 * 2.0 / 2f32.sqrt()];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?} against {want:?}");
        }
    }

    /// RMSNorm's weights are `gamma` alone; LayerNorm's `gamma` and `beta`, and a LayerNorm given
    /// centred rows with unit `gamma` and zero `beta` agrees with RMSNorm (their variance is
    /// their mean square).
    #[test]
    fn rms_norm_is_layer_norm_of_centred_rows_without_bias() {
        let device = Device::flex();
        let mut rms = NormKind::RmsNorm.init(4, 1e-5, &device);
        assert!(rms.beta.is_none());
        let mut layer = NormKind::LayerNorm.init(4, 1e-5, &device);
        assert!(layer.beta.is_some());
        let gamma = Tensor::<1>::from_floats([0.5, 1.5, -1.0, 2.0], &device);
        layer.gamma = Param::from_tensor(gamma.clone());
        rms.gamma = Param::from_tensor(gamma);
        let x =
            Tensor::<2>::from_floats([[1.0, -1.0, 3.0, -3.0], [0.5, 0.25, -0.5, -0.25]], &device);
        let a = NormKind::RmsNorm.forward(&rms, x.clone(), 1e-5);
        let b = NormKind::LayerNorm.forward(&layer, x, 1e-5);
        let diff = (a - b).abs().max().into_scalar::<f32>();
        assert!(diff < 1e-5, "differ by {diff}");
    }
}
