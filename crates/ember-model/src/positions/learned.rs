//! Learned positions (GPT-2): a trained `[max_positions, D]` table added to the embeddings.

use burn::module::Param;
use burn::nn::{Embedding, EmbeddingConfig, Initializer};
use burn::tensor::Device;

use super::PositionInit;
use super::sinusoidal::sinusoidal_table;

/// Standard deviation of the normal start of a learned table, and the root mean square of its
/// sinusoidal start.
const LEARNED_STD: f64 = 0.02;

/// A learned `[max_positions, D]` table started as `init` says.
pub(crate) fn learned_table(
    init: PositionInit,
    max_positions: usize,
    d_model: usize,
    device: &Device,
) -> Embedding {
    match init {
        PositionInit::Normal => EmbeddingConfig::new(max_positions, d_model)
            .with_initializer(Initializer::Normal {
                mean: 0.0,
                std: LEARNED_STD,
            })
            .init(device),
        PositionInit::Sinusoidal => {
            // Each (sin, cos) pair has a mean square of 1/2, so sqrt(2) * std gives that RMS.
            let scale = LEARNED_STD * std::f64::consts::SQRT_2;
            let table = sinusoidal_table(0, max_positions, d_model, device).mul_scalar(scale);
            Embedding {
                weight: Param::from_tensor(table),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::positions::{AdditivePositions, PositionalKind};
    use burn::tensor::Tensor;

    #[test]
    fn a_learned_table_starts_random_or_as_the_scaled_sinusoids() {
        let device = Device::flex();
        let start = |init| {
            let positions = AdditivePositions::new(PositionalKind::Learned, init, 64, 128, &device);
            let weight = positions.unwrap().wpe.unwrap().weight.val();
            assert_eq!(weight.dims(), [64, 128]);
            weight
        };
        let rms = |x: Tensor<2>| x.powi_scalar(2).mean().sqrt().into_scalar::<f32>();
        let sinusoidal = start(PositionInit::Sinusoidal);
        let expected = sinusoidal_table(0, 64, 128, &device).mul_scalar(0.02 * 2f64.sqrt());
        let diff = (sinusoidal.clone() - expected)
            .abs()
            .max()
            .into_scalar::<f32>();
        assert!(diff < 1e-7, "differs from the scaled table by {diff}");
        assert!((rms(sinusoidal) - 0.02).abs() < 1e-6);
        // The random start: mean 0, std 0.02 (64 x 128 draws: within a few percent).
        let normal = start(PositionInit::Normal);
        assert!(normal.clone().mean().into_scalar::<f32>().abs() < 1e-3);
        assert!((rms(normal) - 0.02).abs() < 1e-3);
    }
}
