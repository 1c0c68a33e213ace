//! Positional encodings: sinusoidal (Vaswani et al. 2017), learned, and rotary (RoPE, Su et al.
//! 2021). Sinusoidal and learned ones are added to the token embeddings; rotary ones rotate
//! queries and keys inside attention.

use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Initializer};
use burn::serde::{Deserialize, Serialize};
use burn::tensor::{Device, Int, Tensor};

/// Which positional encoding a model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(crate = "burn::serde", rename_all = "lowercase")]
pub enum PositionalKind {
    /// Fixed `sin`/`cos` table added to the embeddings.
    Sinusoidal,
    /// A trained `[max_positions, D]` table added to the embeddings (GPT-2).
    #[default]
    Learned,
    /// Rotary: queries and keys are rotated by an angle proportional to their position.
    Rotary,
    /// No positional information (attention is then permutation-equivariant).
    None,
}

/// How a learned position table starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(crate = "burn::serde", rename_all = "lowercase")]
pub enum PositionInit {
    /// Random: `N(0, 0.02)` per entry, as GPT-2 and nanoGPT start it.
    #[default]
    Normal,
    /// The sinusoidal table of [`sinusoidal_table`], scaled to a root mean square of 0.02 (the
    /// normal start's standard deviation); the table is then trained like any other.
    Sinusoidal,
}

/// Standard deviation of the normal start of a learned table, and the root mean square of its
/// sinusoidal start.
const LEARNED_STD: f64 = 0.02;

/// Positions added to the token embeddings (sinusoidal or learned).
#[derive(Module, Debug)]
pub struct AdditivePositions {
    /// The learned table `[max_positions, D]`, for [`PositionalKind::Learned`].
    pub wpe: Option<Embedding>,
    /// Width of the sinusoidal encoding when there is no learned table; 0 when unused.
    pub sinusoidal_width: usize,
}

impl AdditivePositions {
    /// Builds the additive encoding for `kind` (None for rotary and none); `init` says how a
    /// learned table starts.
    pub fn new(
        kind: PositionalKind,
        init: PositionInit,
        max_positions: usize,
        d_model: usize,
        device: &Device,
    ) -> Option<Self> {
        match kind {
            PositionalKind::Learned => Some(Self {
                wpe: Some(learned_table(init, max_positions, d_model, device)),
                sinusoidal_width: 0,
            }),
            PositionalKind::Sinusoidal => Some(Self {
                wpe: None,
                sinusoidal_width: d_model,
            }),
            PositionalKind::Rotary | PositionalKind::None => None,
        }
    }

    /// The encodings of positions `start..start + T`.
    ///
    /// # Shapes
    /// - output: `[1, T, D]`
    pub fn forward(&self, start: usize, t: usize, device: &Device) -> Tensor<3> {
        match &self.wpe {
            Some(wpe) => {
                let positions = Tensor::<1, Int>::arange(start as i64..(start + t) as i64, device);
                wpe.forward(positions.reshape([1, t]))
            }
            None => sinusoidal_table(start, t, self.sinusoidal_width, device).unsqueeze(),
        }
    }
}

/// A learned `[max_positions, D]` table started as `init` says.
fn learned_table(
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

/// The sinusoidal table of Vaswani et al. for positions `start..start + T`:
/// `PE[pos, 2i] = sin(pos / 10000^(2i/D))`, `PE[pos, 2i+1] = cos(pos / 10000^(2i/D))`.
///
/// # Shapes
/// - output: `[T, D]`
pub fn sinusoidal_table(start: usize, t: usize, d_model: usize, device: &Device) -> Tensor<2> {
    let half = d_model.div_ceil(2);
    let angles = angles(start, t, half, 10000.0, d_model as f64, device); // [T, half]
    // Interleave: stack sin and cos on a last axis, then flatten pairs into the width.
    let table = Tensor::stack::<3>(vec![angles.clone().sin(), angles.cos()], 2); // [T, half, 2]
    table.reshape([t, 2 * half]).slice([0..t, 0..d_model])
}

/// `angle[p, i] = (start + p) / base^(2i / width)` for `i < half`.
///
/// # Shapes
/// - output: `[T, half]`
fn angles(
    start: usize,
    t: usize,
    half: usize,
    base: f64,
    width: f64,
    device: &Device,
) -> Tensor<2> {
    let positions = Tensor::<1, Int>::arange(start as i64..(start + t) as i64, device)
        .float()
        .reshape([t, 1]);
    let freqs = frequencies(half, base, width);
    let freqs = Tensor::<1>::from_floats(freqs.as_slice(), device).reshape([1, half]);
    positions.mul(freqs)
}

/// `base^(-2i / width)` for `i < half`, in `f32`: the angle per position of each pair.
pub(crate) fn frequencies(half: usize, base: f64, width: f64) -> Vec<f32> {
    (0..half)
        .map(|i| (1.0 / base.powf(2.0 * i as f64 / width)) as f32)
        .collect()
}

/// Rotary position embedding applied to queries or keys.
///
/// Pairs dimension `i` with `i + K/2` (the "rotate half" layout of GPT-NeoX and LLaMA) and
/// rotates each pair by `pos * base^(-2i/K)`. Because a rotation by `a` then the transpose of a
/// rotation by `b` is a rotation by `a - b`, `q_m . k_n` depends only on `m - n`.
///
/// # Shapes
/// - x: `[B, H, T, K]` (K even), holding positions `start..start + T`
/// - output: `[B, H, T, K]`
pub fn apply_rotary(x: Tensor<4>, start: usize, base: f64) -> Tensor<4> {
    let [b, h, t, k] = x.dims();
    let half = k / 2;
    let device = x.device();
    let angles = angles(start, t, half, base, k as f64, &device); // [T, K/2]
    let cos = angles.clone().cos().reshape([1, 1, t, half]);
    let sin = angles.sin().reshape([1, 1, t, half]);
    let x1 = x.clone().slice([0..b, 0..h, 0..t, 0..half]);
    let x2 = x.slice([0..b, 0..h, 0..t, half..k]);
    let r1 = x1.clone().mul(cos.clone()).sub(x2.clone().mul(sin.clone()));
    let r2 = x1.mul(sin).add(x2.mul(cos));
    Tensor::cat(vec![r1, r2], 3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;

    #[test]
    fn sinusoidal_matches_the_formula() {
        let device = Device::flex();
        let d = 8;
        let table = sinusoidal_table(0, 50, d, &device)
            .try_into_vec_as::<f32>()
            .unwrap();
        for &(pos, i) in &[(0, 0), (1, 0), (1, 1), (7, 2), (13, 3), (49, 1), (49, 3)] {
            let angle = pos as f64 / 10000f64.powf(2.0 * i as f64 / d as f64);
            let sin = table[pos * d + 2 * i] as f64;
            let cos = table[pos * d + 2 * i + 1] as f64;
            assert!((sin - angle.sin()).abs() < 1e-5, "PE[{pos}, {}]", 2 * i);
            assert!((cos - angle.cos()).abs() < 1e-5, "PE[{pos}, {}]", 2 * i + 1);
        }
    }

    #[test]
    fn sinusoidal_offset_equals_slice_of_longer_table() {
        let device = Device::flex();
        let full = sinusoidal_table(0, 10, 6, &device).slice([4..7, 0..6]);
        let part = sinusoidal_table(4, 3, 6, &device);
        let diff = (full - part).abs().max().into_scalar::<f32>();
        assert!(diff < 1e-6);
    }

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

    fn norms(x: Tensor<4>) -> Vec<f32> {
        x.powi_scalar(2)
            .sum_dim(3)
            .sqrt()
            .try_into_vec_as::<f32>()
            .unwrap()
    }

    #[test]
    fn rotary_preserves_norms() {
        let device = Device::flex();
        let x = Tensor::<4>::random([2, 3, 5, 8], Distribution::Normal(0.0, 1.0), &device);
        let before = norms(x.clone());
        let after = norms(apply_rotary(x, 7, 10000.0));
        for (a, b) in before.iter().zip(&after) {
            assert!((a - b).abs() < 1e-4, "norm {a} became {b}");
        }
    }

    /// q . k after rotating q to position m and k to position n.
    fn rotated_dot(q: &Tensor<4>, k: &Tensor<4>, m: usize, n: usize) -> f32 {
        let q = apply_rotary(q.clone(), m, 10000.0);
        let k = apply_rotary(k.clone(), n, 10000.0);
        (q * k).sum().into_scalar::<f32>()
    }

    #[test]
    fn rotary_dot_product_depends_only_on_offset() {
        let device = Device::flex();
        let q = Tensor::<4>::random([1, 1, 1, 8], Distribution::Normal(0.0, 1.0), &device);
        let k = Tensor::<4>::random([1, 1, 1, 8], Distribution::Normal(0.0, 1.0), &device);
        let base = rotated_dot(&q, &k, 5, 2);
        for shift in [1, 10, 100] {
            let shifted = rotated_dot(&q, &k, 5 + shift, 2 + shift);
            assert!(
                (base - shifted).abs() < 1e-3,
                "offset 3: {base} vs {shifted}"
            );
        }
        // A different offset gives a different product: the rotation is not a no-op.
        let other = rotated_dot(&q, &k, 9, 2);
        assert!((base - other).abs() > 1e-4);
    }
}
