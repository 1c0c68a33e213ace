//! The angles of sinusoidal and rotary positions and the rotation of rotary positions (RoPE,
//! Su et al. 2021): the maths the rotary op and its kernels share with
//! `ember_model::positions`.

use burn::serde::{Deserialize, Serialize};
use burn::tensor::{Device, Int, Tensor};

/// A rotary model's rotation: the base of RoPE's frequencies `base^(-2i/K)`, and how they are
/// stretched, if they are, for a context longer than the one the model was trained on. An `f64`
/// converts into the plain rotation of that base.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    /// The base of the frequencies (10000 in the RoPE paper, 500000 in Llama 3's).
    pub base: f64,
    /// How the frequencies are stretched; `None` for RoPE's own.
    pub scaling: Option<RopeScaling>,
}

impl From<f64> for Rope {
    fn from(base: f64) -> Self {
        Self {
            base,
            scaling: None,
        }
    }
}

/// How a rotation's frequencies are stretched (transformers' `rope_type`), so that a model
/// trained on `original_max_positions` reads longer sequences: positions far apart then turn
/// by angles the model has seen.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(
    crate = "burn::serde",
    tag = "kind",
    rename_all = "lowercase",
    deny_unknown_fields
)]
pub enum RopeScaling {
    /// Position interpolation (Chen et al. 2023, transformers' `linear`): every frequency divided
    /// by `factor`, as if each position were `factor` times nearer the start.
    Linear {
        /// The stretch, above 0 (above 1 to lengthen the context).
        factor: f64,
    },
    /// Llama 3.1's (transformers' `llama3`): frequencies whose wavelength `2 pi / f` is longer
    /// than `original_max_positions / low_freq_factor` divided by `factor`, those shorter than
    /// `original_max_positions / high_freq_factor` kept, and between them a blend of the two,
    /// linear in `original_max_positions / wavelength`.
    Llama3 {
        /// The stretch of the low frequencies.
        factor: f64,
        /// Wavelengths beyond `original_max_positions / low_freq_factor` are stretched.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_positions / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context the frequencies were trained on (8192 for Llama 3).
        original_max_positions: usize,
    },
}

impl RopeScaling {
    /// `frequency` as the stretched rotation has it.
    pub fn scale(self, frequency: f64) -> f64 {
        match self {
            Self::Linear { factor } => frequency / factor,
            Self::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_positions,
            } => {
                let original = original_max_positions as f64;
                let wavelength = 2.0 * std::f64::consts::PI / frequency;
                if wavelength < original / high {
                    frequency
                } else if wavelength > original / low {
                    frequency / factor
                } else {
                    let smooth = (original / wavelength - low) / (high - low);
                    (1.0 - smooth) * frequency / factor + smooth * frequency
                }
            }
        }
    }

    /// What is wrong with the settings, if anything, naming the setting.
    pub fn invalid(self) -> Option<String> {
        let positive = |name: &str, v: f64| {
            (!(v.is_finite() && v > 0.0)).then(|| format!("`{name}` must be above 0, got {v}"))
        };
        match self {
            Self::Linear { factor } => positive("factor", factor),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => positive("factor", factor)
                .or_else(|| positive("low_freq_factor", low_freq_factor))
                .or_else(|| positive("high_freq_factor", high_freq_factor))
                .or_else(|| {
                    (high_freq_factor <= low_freq_factor).then(|| {
                        format!(
                            "`high_freq_factor` ({high_freq_factor}) must be above \
                             `low_freq_factor` ({low_freq_factor})"
                        )
                    })
                })
                .or_else(|| {
                    (original_max_positions == 0)
                        .then(|| "`original_max_positions` must be above 0".to_string())
                }),
        }
    }
}

impl Rope {
    /// The angle per position of each of a head's `half` pairs (head width `width`): RoPE's
    /// `base^(-2i / width)`, stretched as `scaling` says, in `f32`.
    pub fn frequencies(self, half: usize, width: f64) -> Vec<f32> {
        (0..half)
            .map(|i| {
                let f = 1.0 / self.base.powf(2.0 * i as f64 / width);
                self.scaling.map_or(f, |s| s.scale(f)) as f32
            })
            .collect()
    }
}

/// Rotary position embedding applied to queries or keys.
///
/// Pairs dimension `i` with `i + K/2` (the "rotate half" layout of GPT-NeoX and LLaMA) and
/// rotates each pair by `pos * base^(-2i/K)` (frequencies stretched where `rope` says so; an
/// `f64` is the base of the plain rotation). Because a rotation by `a` then the transpose of a
/// rotation by `b` is a rotation by `a - b`, `q_m . k_n` depends only on `m - n`.
///
/// # Shapes
/// - x: `[B, H, T, K]` (K even), holding positions `start..start + T`
/// - output: `[B, H, T, K]`
pub fn apply_rotary(x: Tensor<4>, start: usize, rope: impl Into<Rope>) -> Tensor<4> {
    apply_rotary_from(x, start as i64, rope)
}

/// [`apply_rotary`] from a position that may be negative (the padding before a left-padded
/// sequence, which attention masks out).
pub fn apply_rotary_from(x: Tensor<4>, start: i64, rope: impl Into<Rope>) -> Tensor<4> {
    let [_, _, t, k] = x.dims();
    let device = x.device();
    let freqs = rope.into().frequencies(k / 2, k as f64);
    let angles = angles(start, t, &freqs, &device); // [T, K/2]
    rotate_by(x, angles.clone().cos(), angles.sin())
}

/// `x` turned by the angles whose `cos` and `sin` are given per position: what
/// [`apply_rotary`] does once it has them (a decoding step replayed at any position reads them
/// from tables of every position).
///
/// # Shapes
/// - x: `[B, H, T, K]` (K even)
/// - cos, sin: `[T, K/2]`
/// - output: `[B, H, T, K]`
pub fn rotate_by(x: Tensor<4>, cos: Tensor<2>, sin: Tensor<2>) -> Tensor<4> {
    let [b, h, t, k] = x.dims();
    let half = k / 2;
    let cos = cos.reshape([1, 1, t, half]);
    let sin = sin.reshape([1, 1, t, half]);
    let x1 = x.clone().slice([0..b, 0..h, 0..t, 0..half]);
    let x2 = x.slice([0..b, 0..h, 0..t, half..k]);
    let r1 = x1.clone().mul(cos.clone()).sub(x2.clone().mul(sin.clone()));
    let r2 = x1.mul(sin).add(x2.mul(cos));
    Tensor::cat(vec![r1, r2], 3)
}

/// `angle[p, i] = (start + p) * freqs[i]` (`freqs` from [`frequencies`] or
/// [`Rope::frequencies`]).
///
/// # Shapes
/// - output: `[T, freqs.len()]`
pub fn angles(start: i64, t: usize, freqs: &[f32], device: &Device) -> Tensor<2> {
    let positions = Tensor::<1, Int>::arange(start..start + t as i64, device)
        .float()
        .reshape([t, 1]);
    let freqs = Tensor::<1>::from_floats(freqs, device).reshape([1, freqs.len()]);
    positions.mul(freqs)
}

/// `base^(-2i / width)` for `i < half`, in `f32`: the angle per position of each pair.
pub fn frequencies(half: usize, base: f64, width: f64) -> Vec<f32> {
    Rope::from(base).frequencies(half, width)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Heads of 8, base 10000: frequencies 1, 0.1, 0.01 and 0.001, whose wavelengths (6.3, 63,
    /// 628, 6283) fall one below `64 / 4`, one between `64 / 4` and `64 / 1`, two beyond: kept,
    /// blended, stretched. The values are transformers' (`ROPE_INIT_FUNCTIONS`, 5.24), to `f32`.
    #[test]
    fn stretched_frequencies_are_transformers() {
        let llama3 = Rope {
            base: 10000.0,
            scaling: Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_positions: 64,
            }),
        };
        let linear = Rope {
            base: 10000.0,
            scaling: Some(RopeScaling::Linear { factor: 2.0 }),
        };
        let cases = [
            (Rope::from(10000.0), [1.0, 0.1, 0.01, 0.001]),
            (llama3, [1.0, 0.013_042_256, 0.00125, 0.000125]),
            (linear, [0.5, 0.05, 0.005, 0.0005]),
        ];
        for (rope, want) in cases {
            let got = rope.frequencies(4, 8.0);
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= 1e-6 * w,
                    "{rope:?}: {got:?}, want {want:?}"
                );
            }
        }
    }

    #[test]
    fn invalid_stretches_are_named() {
        let llama3 = |low, high, original| RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_positions: original,
        };
        let cases = [
            (RopeScaling::Linear { factor: 0.0 }, "`factor`"),
            (RopeScaling::Linear { factor: f64::NAN }, "`factor`"),
            (llama3(4.0, 1.0, 64), "`high_freq_factor` (1)"),
            (llama3(1.0, 4.0, 0), "`original_max_positions`"),
            (llama3(-1.0, 4.0, 64), "`low_freq_factor`"),
        ];
        for (scaling, needle) in cases {
            let message = scaling.invalid().expect("refused");
            assert!(message.contains(needle), "{scaling:?}: {message}");
        }
        assert_eq!(llama3(1.0, 4.0, 8192).invalid(), None);
    }
}
