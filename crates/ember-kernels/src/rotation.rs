//! The angles of sinusoidal and rotary positions and the rotation of rotary positions (RoPE,
//! Su et al. 2021): the maths the rotary op and its kernels share with
//! `ember_model::positions`.

use burn::tensor::{Device, Int, Tensor};

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
    apply_rotary_from(x, start as i64, base)
}

/// [`apply_rotary`] from a position that may be negative (the padding before a left-padded
/// sequence, which attention masks out).
pub fn apply_rotary_from(x: Tensor<4>, start: i64, base: f64) -> Tensor<4> {
    let [_, _, t, k] = x.dims();
    let half = k / 2;
    let device = x.device();
    let angles = angles(start, t, half, base, k as f64, &device); // [T, K/2]
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

/// `angle[p, i] = (start + p) / base^(2i / width)` for `i < half`.
///
/// # Shapes
/// - output: `[T, half]`
pub fn angles(
    start: i64,
    t: usize,
    half: usize,
    base: f64,
    width: f64,
    device: &Device,
) -> Tensor<2> {
    let positions = Tensor::<1, Int>::arange(start..start + t as i64, device)
        .float()
        .reshape([t, 1]);
    let freqs = frequencies(half, base, width);
    let freqs = Tensor::<1>::from_floats(freqs.as_slice(), device).reshape([1, half]);
    positions.mul(freqs)
}

/// `base^(-2i / width)` for `i < half`, in `f32`: the angle per position of each pair.
pub fn frequencies(half: usize, base: f64, width: f64) -> Vec<f32> {
    (0..half)
        .map(|i| (1.0 / base.powf(2.0 * i as f64 / width)) as f32)
        .collect()
}
