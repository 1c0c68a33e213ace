//! The two GELUs and their derivatives over `f32` slices, written branch-free so the compiler
//! vectorises the loops (AVX-512 or AVX2 with FMA when the CPU has them, plain SSE2 otherwise).
//!
//! - [`Exact`]: `x * Phi(x)`. `Phi(x) = 1 - q` for `x >= 0` and `q` for `x < 0`, with
//!   `q = erfc(|x| / sqrt 2) / 2` from the Chebyshev fit of Numerical Recipes' `erfcc`
//!   (fractional error below 1.2e-7 everywhere), so the negative tail keeps its relative
//!   accuracy.
//! - [`Tanh`]: `x/2 * (1 + tanh(u))`, `u = sqrt(2/pi) (x + 0.044715 x^3)` (GPT-2's `gelu_new`),
//!   computed as the equal `x * sigmoid(2u)`.
//! - [`Silu`]: `x * sigmoid(x)` (SiLU, LLaMA's gate), the same family: `x` times a sigmoid.
//!
//! The tests bound the error against `f64` references.

use core::f32::consts::FRAC_1_SQRT_2;

use crate::kernels::vector_math::{exp, madd, multiversion};

/// `1 / sqrt(2 pi)`.
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `(t, P(t))` for `z = |x| / sqrt 2`: `erfc z = t e^(P(t) - z^2)` (Numerical Recipes' `erfcc`).
#[inline(always)]
#[allow(clippy::excessive_precision)] // the published coefficients, as published
fn erfc_parts<const F: bool>(z: f32) -> (f32, f32) {
    let t = 1.0 / madd::<F>(0.5, z, 1.0);
    let mut p = 0.170_872_77_f32;
    for c in [
        -0.822_152_23,
        1.488_515_87,
        -1.135_203_98,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_68,
        -1.265_512_23,
    ] {
        p = madd::<F>(p, t, c);
    }
    (t, p)
}

/// `Phi(x)` from `q = Phi(-|x|)`.
#[inline(always)]
fn cdf_from_tail(x: f32, q: f32) -> f32 {
    if x >= 0.0 { 1.0 - q } else { q }
}

/// A GELU: its value and derivative at one point, with fused multiply-adds when `F`.
pub trait GeluKind: Send + Sync + core::fmt::Debug + 'static {
    /// `GELU(x)`.
    fn value<const F: bool>(x: f32) -> f32;
    /// `d GELU / dx`.
    fn derivative<const F: bool>(x: f32) -> f32;
}

/// Exact GELU, `x * Phi(x)`.
#[derive(Debug, Clone, Copy)]
pub struct Exact;

impl GeluKind for Exact {
    #[inline(always)]
    fn value<const F: bool>(x: f32) -> f32 {
        let z = x.abs() * FRAC_1_SQRT_2;
        let (t, p) = erfc_parts::<F>(z);
        let q = 0.5 * t * exp::<F>(madd::<F>(-z, z, p));
        x * cdf_from_tail(x, q)
    }

    /// `Phi(x) + x * phi(x)`, `phi(x) = e^(-x^2 / 2) / sqrt(2 pi)`.
    #[inline(always)]
    fn derivative<const F: bool>(x: f32) -> f32 {
        let z = x.abs() * FRAC_1_SQRT_2;
        let (t, p) = erfc_parts::<F>(z);
        let gauss = exp::<F>(-z * z);
        let q = 0.5 * t * gauss * exp::<F>(p);
        madd::<F>(x * INV_SQRT_2PI, gauss, cdf_from_tail(x, q))
    }
}

/// GELU with the tanh approximation, `x/2 * (1 + tanh(u))`.
#[derive(Debug, Clone, Copy)]
pub struct Tanh;

/// `sqrt(2 / pi)`.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic term's coefficient.
const CUBIC: f32 = 0.044_715;

impl Tanh {
    /// `(s, e)` with `e = e^(-2u)` and `s = sigmoid(2u) = 1 / (1 + e)`; `1 + tanh(u) = 2s` and
    /// `1 - s = e s` (without the cancellation of subtracting).
    #[inline(always)]
    fn sigmoid_2u<const F: bool>(x: f32) -> (f32, f32) {
        let two_u = 2.0 * SQRT_2_OVER_PI * madd::<F>(CUBIC * x * x, x, x);
        let e = exp::<F>(-two_u);
        (1.0 / (1.0 + e), e)
    }
}

impl GeluKind for Tanh {
    #[inline(always)]
    fn value<const F: bool>(x: f32) -> f32 {
        x * Self::sigmoid_2u::<F>(x).0
    }

    /// `s + x s (1 - s) d(2u)/dx`, `d(2u)/dx = 2 sqrt(2/pi) (1 + 3c x^2)`.
    #[inline(always)]
    fn derivative<const F: bool>(x: f32) -> f32 {
        let (s, e) = Self::sigmoid_2u::<F>(x);
        let du = 2.0 * SQRT_2_OVER_PI * madd::<F>(3.0 * CUBIC * x, x, 1.0);
        madd::<F>(x * s * (e * s), du, s)
    }
}

/// SiLU, `x * sigmoid(x)`.
#[derive(Debug, Clone, Copy)]
pub struct Silu;

impl Silu {
    /// `(s, e)` with `e = e^(-x)` and `s = sigmoid(x) = 1 / (1 + e)`; `1 - s = e s`.
    #[inline(always)]
    fn sigmoid<const F: bool>(x: f32) -> (f32, f32) {
        let e = exp::<F>(-x);
        (1.0 / (1.0 + e), e)
    }
}

impl GeluKind for Silu {
    #[inline(always)]
    fn value<const F: bool>(x: f32) -> f32 {
        x * Self::sigmoid::<F>(x).0
    }

    /// `s + x s (1 - s)`.
    #[inline(always)]
    fn derivative<const F: bool>(x: f32) -> f32 {
        let (s, e) = Self::sigmoid::<F>(x);
        madd::<F>(x * s, e * s, s)
    }
}

multiversion! {
    /// `xs[i] = GELU(xs[i])`.
    pub fn forward_in_place<K: GeluKind>(xs: &mut [f32]) {
        for x in xs.iter_mut() {
            *x = K::value::<F>(*x);
        }
    }
}

multiversion! {
    /// `out[i] = GELU(xs[i])`; the slices have the same length.
    pub fn forward_into<K: GeluKind>(xs: &[f32], out: &mut [f32]) {
        for (o, &x) in out.iter_mut().zip(xs) {
            *o = K::value::<F>(x);
        }
    }
}

multiversion! {
    /// `grads[i] *= GELU'(xs[i])`: the backward pass, in place on the incoming gradient.
    pub fn backward_in_place<K: GeluKind>(xs: &[f32], grads: &mut [f32]) {
        for (g, &x) in grads.iter_mut().zip(xs) {
            *g *= K::derivative::<F>(x);
        }
    }
}

multiversion! {
    /// `out[i] = grads[i] * GELU'(xs[i])`.
    pub fn backward_into<K: GeluKind>(xs: &[f32], grads: &[f32], out: &mut [f32]) {
        for ((o, &g), &x) in out.iter_mut().zip(grads).zip(xs) {
            *o = g * K::derivative::<F>(x);
        }
    }
}

multiversion! {
    /// `out[i] = act(gate[i]) * up[i]`: a gated MLP's hidden value (SwiGLU with [`Silu`]).
    pub fn gated_forward<K: GeluKind>(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = K::value::<F>(g) * u;
        }
    }
}

multiversion! {
    /// The gradients of [`gated_forward`]'s inputs from its output's, `grad`:
    /// `d_gate = grad * up * act'(gate)`, `d_up = grad * act(gate)`.
    pub fn gated_backward<K: GeluKind>(
        gate: &[f32],
        up: &[f32],
        grad: &[f32],
        d_gate: &mut [f32],
        d_up: &mut [f32]
    ) {
        let outs = d_gate.iter_mut().zip(d_up.iter_mut());
        for ((((dg, du), &g), &u), &dy) in outs.zip(gate).zip(up).zip(grad) {
            *du = dy * K::value::<F>(g);
            *dg = dy * u * K::derivative::<F>(g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// erf to f64 precision (Abramowitz-Stegun 7.1.26 is not enough here; use the series and
    /// the continued fraction).
    fn erf64(x: f64) -> f64 {
        if x.abs() < 3.0 {
            // Maclaurin series: erf x = 2/sqrt(pi) sum (-1)^n x^(2n+1) / (n! (2n+1)).
            let mut sum = 0.0f64;
            let mut term = x;
            let mut n = 0.0;
            while term.abs() > 1e-17 * sum.abs().max(1e-300) || n < 3.0 {
                sum += term / (2.0 * n + 1.0);
                n += 1.0;
                term *= -x * x / n;
                if n > 200.0 {
                    break;
                }
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            x.signum() * (1.0 - erfc64(x.abs()))
        }
    }

    /// erfc for x >= 3 by Lentz's continued fraction.
    fn erfc64(x: f64) -> f64 {
        // erfc x = exp(-x^2)/sqrt(pi) * 1/(x + 1/2/(x + 1/(x + 3/2/(x + ...))))
        let mut f = x;
        for k in (1..200).rev() {
            f = x + (k as f64 / 2.0) / f;
        }
        (-x * x).exp() / std::f64::consts::PI.sqrt() / f
    }

    fn phi64(x: f64) -> f64 {
        if x < -4.0 {
            0.5 * erfc64(-x / std::f64::consts::SQRT_2)
        } else {
            0.5 * (1.0 + erf64(x / std::f64::consts::SQRT_2))
        }
    }

    fn grid() -> impl Iterator<Item = f32> {
        (-12_000..=12_000).map(|i| i as f32 * 1e-3)
    }

    #[test]
    fn reference_erf_is_right() {
        // Values from tables (Abramowitz-Stegun table 7.1).
        assert!((erf64(0.5) - 0.520_499_877_813_046_5).abs() < 1e-15);
        assert!((erf64(1.0) - 0.842_700_792_949_714_9).abs() < 1e-15);
        assert!((erfc64(3.0) - 2.209_049_699_858_544e-5).abs() < 1e-18);
        assert!((erfc64(5.0) - 1.537_459_794_428_035e-12).abs() < 1e-24);
    }

    /// Largest error of `f` over the grid, as a multiple of `1e-6 |want| + 1e-8`: relative,
    /// plus an absolute 1e-8 (far below an f32 ulp of 1) for the far tail, where rounding
    /// x^2 / 2 in f32 moves e^(-x^2/2) by a few parts in 1e6.
    fn worst(f: impl Fn(f32) -> f32, want: impl Fn(f64) -> f64) -> f64 {
        grid()
            .map(|x| {
                let w = want(x as f64);
                (f(x) as f64 - w).abs() / (1e-6 * w.abs() + 1e-8)
            })
            .fold(0.0, f64::max)
    }

    fn gelu64(x: f64) -> f64 {
        x * phi64(x)
    }

    fn derivative64(x: f64) -> f64 {
        phi64(x) + x * (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
    }

    fn tanh_gelu64(x: f64) -> f64 {
        let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
        0.5 * x * (1.0 + u.tanh())
    }

    fn tanh_derivative64(x: f64) -> f64 {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let th = (c * (x + 0.044715 * x * x * x)).tanh();
        0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * c * (1.0 + 3.0 * 0.044715 * x * x)
    }

    #[test]
    fn values_match_f64_references() {
        for (w, what) in [
            (worst(Exact::value::<false>, gelu64), "exact"),
            (worst(Exact::value::<true>, gelu64), "exact, fma"),
            (worst(Tanh::value::<false>, tanh_gelu64), "tanh"),
            (worst(Tanh::value::<true>, tanh_gelu64), "tanh, fma"),
        ] {
            assert!(w < 1.0, "{what}: error {w} times the tolerance");
        }
    }

    #[test]
    fn derivatives_match_f64_references() {
        // Absolute: the derivatives are O(1) and, for x < 0, differences of two small terms.
        type Case = (fn(f32) -> f32, fn(f64) -> f64);
        let cases: [Case; 4] = [
            (Exact::derivative::<false>, derivative64),
            (Exact::derivative::<true>, derivative64),
            (Tanh::derivative::<false>, tanh_derivative64),
            (Tanh::derivative::<true>, tanh_derivative64),
        ];
        for (i, (f, want)) in cases.into_iter().enumerate() {
            let worst = grid()
                .map(|x| (f(x) as f64 - want(x as f64)).abs())
                .fold(0.0, f64::max);
            assert!(worst < 3e-7, "case {i}: largest absolute error {worst:e}");
        }
    }

    fn slices_agree<K: GeluKind>() {
        let xs: Vec<f32> = grid().step_by(7).collect();
        let grads: Vec<f32> = xs.iter().map(|x| (x * 3.1).sin()).collect();
        let mut a = xs.clone();
        forward_in_place::<K>(&mut a);
        let mut b = vec![0.0; xs.len()];
        forward_into::<K>(&xs, &mut b);
        let mut c = grads.clone();
        backward_in_place::<K>(&xs, &mut c);
        let mut d = vec![0.0; xs.len()];
        backward_into::<K>(&xs, &grads, &mut d);
        for i in 0..xs.len() {
            // The vector versions fuse multiply-adds: allow a few ulps.
            let close = |got: f32, want: f32| (got - want).abs() <= 2e-6 * want.abs() + 1e-8;
            assert!(close(a[i], K::value::<false>(xs[i])), "{}", xs[i]);
            assert_eq!(a[i], b[i]);
            let want = grads[i] * K::derivative::<false>(xs[i]);
            assert!((c[i] - want).abs() <= 3e-7 * grads[i].abs(), "{}", xs[i]);
            assert_eq!(c[i], d[i]);
        }
        for f in [K::value::<false>, K::value::<true>] {
            assert!(f(f32::NAN).is_nan());
            assert_eq!(f(0.0), 0.0);
            assert_eq!(f(20.0), 20.0);
            assert!(f(-20.0).abs() < 1e-30);
        }
    }

    #[test]
    fn slices_agree_with_the_scalar_functions() {
        slices_agree::<Exact>();
        slices_agree::<Tanh>();
    }

    fn silu64(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    fn silu_derivative64(x: f64) -> f64 {
        let s = 1.0 / (1.0 + (-x).exp());
        s + x * s * (1.0 - s)
    }

    /// SiLU and its derivative against `f64`, over the grid and far out (`-100` and `100`,
    /// where `e^(-x)` leaves `f32`'s range), and its slices against the scalar function.
    #[test]
    fn silu_matches_f64_references() {
        for f in [Silu::value::<false>, Silu::value::<true>] {
            assert!(worst(f, silu64) < 1.0);
            assert_eq!(f(100.0), 100.0);
            assert!(f(-100.0).abs() < 1e-30);
            assert!(f(f32::NAN).is_nan());
        }
        for f in [Silu::derivative::<false>, Silu::derivative::<true>] {
            let worst = grid()
                .map(|x| (f(x) as f64 - silu_derivative64(x as f64)).abs())
                .fold(0.0, f64::max);
            assert!(worst < 3e-7, "largest absolute error {worst:e}");
            assert_eq!(f(100.0), 1.0);
            assert!(f(-100.0).abs() < 1e-30);
        }
        let xs: Vec<f32> = grid().step_by(7).collect();
        let grads: Vec<f32> = xs.iter().map(|x| (x * 3.1).sin()).collect();
        let mut a = xs.clone();
        forward_in_place::<Silu>(&mut a);
        let mut c = grads.clone();
        backward_in_place::<Silu>(&xs, &mut c);
        for i in 0..xs.len() {
            let want = Silu::value::<false>(xs[i]);
            assert!((a[i] - want).abs() <= 2e-6 * want.abs() + 1e-8, "{}", xs[i]);
            let want = grads[i] * Silu::derivative::<false>(xs[i]);
            assert!((c[i] - want).abs() <= 3e-7 * grads[i].abs(), "{}", xs[i]);
        }
    }
}
