//! Products of a few rows by a large matrix: a decoding step's linear layers, `[m, k] @ [k, n]`
//! with `m` the number of sequences decoded together (at most [`MAX_ROWS`]).
//!
//! Such a product does `m` multiply-adds per weight it reads, so reading the weights is its
//! cost. gemm serves more than one row from packed panels: it reads the weights, writes them
//! again in its own layout and reads that. Here every weight is read once from where it lies:
//!
//! - [`rows_by_matrix`]: a weight stored `[k, n]` row-major (a linear layer's `[in, out]`). With
//!   AVX-512 and two rows or more, register tiles of 32 columns of every row summed down the
//!   whole of `k` (`avx512::tiles`); otherwise the output rows accumulate in panels of columns
//!   (kept in L1 across the pass over `k`), four rows of weights at a time, each a contiguous
//!   stretch of the panel's width.
//! - [`rows_by_transposed`]: a weight stored `[n, k]` (the token table as a tied output head):
//!   each of its rows is read once and dotted with up to eight input rows at a time (in L1);
//!   with AVX-512, two weight rows at a time.
//!
//! The AVX-512 kernels add in the loops' order, so they give the loops' results to the bit.
//! Both write `out` without reading it. Rows are `a[r * a_rs..][..k]`; the `[k, n]` weight's
//! row `p` is `b[p * b_rs..][..n]`, the `[n, k]` one's row `j` is `b[j * b_rs..][..k]`.

use crate::kernels::vector_math::{madd, multiversion, tree_sum};

#[cfg(target_arch = "x86_64")]
mod avx512;

/// The most rows these kernels are meant for. Beyond it gemm's panels, reused by many rows,
/// catch up (16 rows of GPT-2 124M decoded no faster by the loops than by gemm on 2 cores, and
/// by the AVX-512 tiles in two passes of 8 no clearly faster: 166-228 against 166-184 tokens/s).
pub const MAX_ROWS: usize = 8;

/// Values in the output panels of all rows together (16 KiB, in L1 across the pass over `k`).
/// A panel is `PANEL_VALUES / rows` columns wide, at least [`MIN_PANEL`]: the wider, the longer
/// each contiguous stretch read from a weight row (16 KiB for one row).
const PANEL_VALUES: usize = 4096;

/// The narrowest panel: 1 KiB of each weight row.
const MIN_PANEL: usize = 256;

/// Lanes of a 64-byte vector of `f32`.
const LANES: usize = 16;

/// The fewest rows for the register tiles: one row reads its weights faster as the panels'
/// contiguous stretches (GPT-2 124M decoded one sequence at a time no faster with tiles).
const TILE_MIN_ROWS: usize = 2;

/// `$call` with `R`, the number of `$rows` (1 to [`MAX_ROWS`]), a constant for a const
/// parameter, and `$rows` an array of that length.
macro_rules! with_rows {
    ($rows:ident, $call:expr) => {
        match $rows.len() {
            8 => with_rows!(@ 8, $rows, $call),
            7 => with_rows!(@ 7, $rows, $call),
            6 => with_rows!(@ 6, $rows, $call),
            5 => with_rows!(@ 5, $rows, $call),
            4 => with_rows!(@ 4, $rows, $call),
            3 => with_rows!(@ 3, $rows, $call),
            2 => with_rows!(@ 2, $rows, $call),
            _ => with_rows!(@ 1, $rows, $call),
        }
    };
    (@ $n:literal, $rows:ident, $call:expr) => {{
        const R: usize = $n;
        let $rows: &[&[f32]; R] = $rows.try_into().unwrap();
        $call
    }};
}
use with_rows;

/// `out[r][j] = sum_p a[r * a_rs + p] * b[p * b_rs + j]` for `r < out.len()`,
/// `j < out[r].len()`, `p < k`.
pub fn rows_by_matrix(
    a: &[f32],
    a_rs: usize,
    k: usize,
    b: &[f32],
    b_rs: usize,
    out: &mut [&mut [f32]],
) {
    #[cfg(target_arch = "x86_64")]
    if out.len() >= TILE_MIN_ROWS && avx512::available() {
        let rows: Vec<&[f32]> = (0..out.len()).map(|r| &a[r * a_rs..][..k]).collect();
        let tiled = avx512::rows_by_matrix(&rows, k, b, b_rs, out);
        if tiled < out[0].len() {
            let mut rest: Vec<&mut [f32]> = out.iter_mut().map(|o| &mut o[tiled..]).collect();
            // (`b` may be empty when `k` is 0; the loops then read none of it.)
            let b = b.get(tiled..).unwrap_or_default();
            rows_by_matrix_loops(a, a_rs, k, b, b_rs, &mut rest);
        }
        return;
    }
    rows_by_matrix_loops(a, a_rs, k, b, b_rs, out)
}

multiversion! {
    /// [`rows_by_matrix`] as loops the compiler vectorises: on CPUs without AVX-512, for one
    /// row (where the weights' contiguous stretches beat the tiles' stride), and for the columns
    /// after the last whole tile.
    pub fn rows_by_matrix_loops(a: &[f32], a_rs: usize, k: usize, b: &[f32], b_rs: usize, out: &mut [&mut [f32]]) {
        let Some(n) = out.first().map(|row| row.len()) else { return };
        let rows: Vec<&[f32]> = (0..out.len()).map(|r| &a[r * a_rs..][..k]).collect();
        let weights = |p: usize, cols: core::ops::Range<usize>| &b[p * b_rs..][cols];
        let panel = (PANEL_VALUES / out.len()).max(MIN_PANEL);
        for first in (0..n).step_by(panel) {
            let cols = first..n.min(first + panel);
            for o in out.iter_mut() {
                o[cols.clone()].fill(0.0);
            }
            let mut p = 0;
            while p + 4 <= k {
                let (w0, w1) = (weights(p, cols.clone()), weights(p + 1, cols.clone()));
                let (w2, w3) = (weights(p + 2, cols.clone()), weights(p + 3, cols.clone()));
                for (x, o) in rows.iter().zip(out.iter_mut()) {
                    let o = &mut o[cols.clone()];
                    let (x0, x1, x2, x3) = (x[p], x[p + 1], x[p + 2], x[p + 3]);
                    for ((((o, w0), w1), w2), w3) in o.iter_mut().zip(w0).zip(w1).zip(w2).zip(w3) {
                        let s = madd::<F>(x0, *w0, *o);
                        let s = madd::<F>(x1, *w1, s);
                        let s = madd::<F>(x2, *w2, s);
                        *o = madd::<F>(x3, *w3, s);
                    }
                }
                p += 4;
            }
            for p in p..k {
                let w = weights(p, cols.clone());
                for (x, o) in rows.iter().zip(out.iter_mut()) {
                    for (o, w) in o[cols.clone()].iter_mut().zip(w) {
                        *o = madd::<F>(x[p], *w, *o);
                    }
                }
            }
        }
    }
}

/// `out[r][j] = sum_p a[r * a_rs + p] * b[j * b_rs + p]` for `r < out.len()`,
/// `j < out[r].len()`, `p < k`.
pub fn rows_by_transposed(
    a: &[f32],
    a_rs: usize,
    k: usize,
    b: &[f32],
    b_rs: usize,
    out: &mut [&mut [f32]],
) {
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        let rows: Vec<&[f32]> = (0..out.len()).map(|r| &a[r * a_rs..][..k]).collect();
        return avx512::rows_by_transposed(&rows, k, b, b_rs, out);
    }
    rows_by_transposed_loops(a, a_rs, k, b, b_rs, out)
}

multiversion! {
    /// [`rows_by_transposed`] as loops the compiler vectorises (CPUs without AVX-512).
    pub fn rows_by_transposed_loops(a: &[f32], a_rs: usize, k: usize, b: &[f32], b_rs: usize, out: &mut [&mut [f32]]) {
        let rows: Vec<&[f32]> = (0..out.len()).map(|r| &a[r * a_rs..][..k]).collect();
        for (rows, out) in rows.chunks(MAX_ROWS).zip(out.chunks_mut(MAX_ROWS)) {
            with_rows!(rows, dots::<R, F>(rows, b, b_rs, k, out))
        }
    }
}

/// [`rows_by_transposed`] for `R` rows: each weight row read once, 16 lanes at a time, into
/// `R` sums held in registers.
#[inline(always)]
fn dots<const R: usize, const F: bool>(
    rows: &[&[f32]; R],
    b: &[f32],
    b_rs: usize,
    k: usize,
    out: &mut [&mut [f32]],
) {
    let split = k / LANES * LANES;
    for j in 0..out[0].len() {
        let w = &b[j * b_rs..][..k];
        let mut acc = [[0.0f32; 16]; R];
        for c in (0..split).step_by(16) {
            let w: &[f32; 16] = w[c..c + 16].try_into().unwrap();
            for (acc, x) in acc.iter_mut().zip(rows) {
                let x: &[f32; 16] = x[c..c + 16].try_into().unwrap();
                for l in 0..16 {
                    acc[l] = madd::<F>(x[l], w[l], acc[l]);
                }
            }
        }
        for ((acc, x), o) in acc.iter_mut().zip(rows).zip(out.iter_mut()) {
            let tail = (split..k).fold(0.0, |s, p| madd::<F>(x[p], w[p], s));
            o[j] = tree_sum(acc) + tail;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values that make a wrong index or a lost term visible: no two alike, of both signs.
    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(0x9E37_79B9).rotate_left(13);
                (h % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// Both loops against the definition in f64, for row counts 1 to [`MAX_ROWS`], inner sizes
    /// with and without a remainder of the four-row step and of 16 lanes, widths below, at and
    /// across a panel's with a short last panel, and row strides wider than the rows (a view).
    #[test]
    fn products_equal_the_definition() {
        for (m, k, n) in [
            (1, 1, 1),
            (1, 7, 5),
            (2, 8, 300),
            (3, 37, 256),
            (5, 64, 513),
            (MAX_ROWS, 19, 1100),
            (3, 0, 40),
        ] {
            let (a_rs, pad) = (k + 3, 5);
            let a = values(m * a_rs, 1);
            for transposed in [false, true] {
                let (b_rs, len) = match transposed {
                    true => (k + pad, n * (k + pad)),
                    false => (n + pad, k * (n + pad)),
                };
                let b = values(len, 2);
                let weight = |p: usize, j: usize| match transposed {
                    true => b[j * b_rs + p],
                    false => b[p * b_rs + j],
                };
                // Filled with NaN: a value left unwritten, or read before written, shows.
                let mut out = vec![vec![f32::NAN; n]; m];
                let mut rows: Vec<&mut [f32]> = out.iter_mut().map(|r| r.as_mut_slice()).collect();
                match transposed {
                    true => rows_by_transposed(&a, a_rs, k, &b, b_rs, &mut rows),
                    false => rows_by_matrix(&a, a_rs, k, &b, b_rs, &mut rows),
                }
                for (r, row) in out.iter().enumerate() {
                    for (j, got) in row.iter().enumerate() {
                        let want: f64 = (0..k)
                            .map(|p| a[r * a_rs + p] as f64 * weight(p, j) as f64)
                            .sum();
                        assert!(
                            (*got as f64 - want).abs() < 1e-5 * (1.0 + k as f64),
                            "{m}x{k}x{n} transposed {transposed}: [{r}, {j}] {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The AVX-512 kernels give the loops' results to the bit (they add in the same order),
    /// tiles and remainders, pairs of weight rows and a last single one, more rows than
    /// [`MAX_ROWS`]; on a CPU without AVX-512 there is nothing to compare.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_kernels_equal_the_loops_to_the_bit() {
        if !avx512::available() {
            return;
        }
        for (m, k, n) in [
            (2, 37, 300),
            (5, 64, 96),
            (MAX_ROWS, 19, 1100),
            (MAX_ROWS, 768, 65),
            (11, 3, 33),
        ] {
            let a_rs = k + 1;
            let a = values(m * a_rs, 3);
            for transposed in [false, true] {
                let b_rs = if transposed { k + 2 } else { n + 7 };
                let b = values(b_rs * if transposed { n } else { k }, 4);
                let mut want = vec![vec![0.0; n]; m];
                let mut got = vec![vec![f32::NAN; n]; m];
                let mut w: Vec<&mut [f32]> = want.iter_mut().map(|r| r.as_mut_slice()).collect();
                let mut g: Vec<&mut [f32]> = got.iter_mut().map(|r| r.as_mut_slice()).collect();
                if transposed {
                    rows_by_transposed_loops(&a, a_rs, k, &b, b_rs, &mut w);
                    rows_by_transposed(&a, a_rs, k, &b, b_rs, &mut g);
                } else {
                    rows_by_matrix_loops(&a, a_rs, k, &b, b_rs, &mut w);
                    rows_by_matrix(&a, a_rs, k, &b, b_rs, &mut g);
                }
                for (r, (want, got)) in want.iter().zip(&got).enumerate() {
                    for (j, (x, y)) in want.iter().zip(got).enumerate() {
                        assert_eq!(
                            x.to_bits(),
                            y.to_bits(),
                            "{m}x{k}x{n} transposed {transposed}: [{r}, {j}] {x} vs {y}"
                        );
                    }
                }
            }
        }
    }
}
