//! Building blocks of ember's CPU kernels: a fused multiply-add that stays fast without FMA,
//! a branch-free `exp` that vectorises (Cephes' `expf` polynomial), dot product, maximum and
//! sum in independent lanes, and [`multiversion!`], which compiles one loop for AVX-512, AVX2
//! and the baseline and picks at run time.

use core::f32::consts::LOG2_E;

/// `a * b + c`, fused where the CPU has FMA (`F`) and as two operations otherwise (where
/// `mul_add` would be a slow library call).
#[inline(always)]
pub(crate) fn madd<const F: bool>(a: f32, b: f32, c: f32) -> f32 {
    if F { a.mul_add(b, c) } else { a * b + c }
}

/// `e^x` without branches; 0 below -87.
#[inline(always)]
#[allow(clippy::excessive_precision)] // the published coefficients, as published
pub(crate) fn exp<const F: bool>(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    const LN2_HI: f32 = 0.693_359_4; // ln 2 = LN2_HI + LN2_LO, split for an exact n * LN2_HI
    const LN2_LO: f32 = -2.121_944_4e-4;
    let c = x.clamp(-87.0, 88.0);
    // m's low mantissa bits hold n = round(c / ln 2) in two's complement.
    let m = madd::<F>(c, LOG2_E, ROUND);
    let n = m - ROUND;
    let r = madd::<F>(-n, LN2_LO, madd::<F>(-n, LN2_HI, c));
    let mut p = 1.987_569_1e-4_f32;
    p = madd::<F>(p, r, 1.398_199_9e-3);
    p = madd::<F>(p, r, 8.333_452e-3);
    p = madd::<F>(p, r, 4.166_579_6e-2);
    p = madd::<F>(p, r, 1.666_666_5e-1);
    p = madd::<F>(p, r, 5.000_000_1e-1);
    let y = madd::<F>(p, r * r, r) + 1.0;
    // 2^n from the bits of m (an `as i32` cast would not vectorise: it saturates).
    let scale = f32::from_bits(m.to_bits().wrapping_add(127) << 23);
    if x < -87.0 { 0.0 } else { y * scale }
}

/// Defines `pub fn $name`, which runs `$body` compiled for the best vector extension this CPU
/// has: AVX-512 or AVX2 with FMA (`F = true` in the body), else the baseline (`F = false`).
macro_rules! multiversion {
    (
        $(#[$doc:meta])*
        pub fn $name:ident$(<$g:ident: $bound:path>)?($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        $(#[$doc])*
        pub fn $name$(<$g: $bound>)?($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic<$($g: $bound,)? const F: bool>($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                fn avx512$(<$g: $bound>)?($($arg: $ty),*) $(-> $ret)? {
                    generic::<$($g,)? true>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2$(<$g: $bound>)?($($arg: $ty),*) $(-> $ret)? {
                    generic::<$($g,)? true>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                {
                    // SAFETY: the CPU has the features the function is compiled for.
                    return unsafe { avx512$(::<$g>)?($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above.
                    return unsafe { avx2$(::<$g>)?($($arg),*) };
                }
            }
            generic::<$($g,)? false>($($arg),*)
        }
    };
}

/// The largest value, with 16 running maxima so that it vectorises (not NaN-aware).
#[inline(always)]
pub(crate) fn lanes_max(xs: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 16];
    let split = xs.len() / 16 * 16;
    for chunk in xs[..split].chunks_exact(16) {
        for i in 0..16 {
            m[i] = if chunk[i] > m[i] { chunk[i] } else { m[i] };
        }
    }
    let tail = xs[split..].iter().copied();
    m.into_iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |a, x| if x > a { x } else { a })
}

/// `a . b` with `LANES` independent partial sums added as a tree, so that it vectorises.
#[inline(always)]
pub(crate) fn dot<const F: bool, const LANES: usize>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let split = a.len() / LANES * LANES;
    for (ca, cb) in a[..split]
        .chunks_exact(LANES)
        .zip(b[..split].chunks_exact(LANES))
    {
        for i in 0..LANES {
            acc[i] = madd::<F>(ca[i], cb[i], acc[i]);
        }
    }
    let mut sum = 0.0;
    for (x, y) in a[split..].iter().zip(&b[split..]) {
        sum = madd::<F>(*x, *y, sum);
    }
    sum + tree_sum(&mut acc)
}

/// The sum of `LANES` partial sums (a power of two), added as a tree in place (so that it
/// vectorises): the last step of [`dot`] and [`lanes_sum`].
#[inline(always)]
pub(crate) fn tree_sum<const LANES: usize>(acc: &mut [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

/// The sum, with 16 partial sums added as a tree so that it vectorises.
#[inline(always)]
pub(crate) fn lanes_sum(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let split = xs.len() / 16 * 16;
    for chunk in xs[..split].chunks_exact(16) {
        for i in 0..16 {
            acc[i] += chunk[i];
        }
    }
    tree_sum(&mut acc) + xs[split..].iter().sum::<f32>()
}

pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std() {
        for f in [exp::<false>, exp::<true>] {
            let mut worst = 0.0f32;
            for i in -8_700..=8_800 {
                let x = i as f32 * 0.01;
                worst = worst.max((f(x) - x.exp()).abs() / x.exp());
            }
            assert!(worst < 3e-7, "largest relative error {worst:e}");
            assert_eq!(f(-100.0), 0.0);
        }
    }
}
