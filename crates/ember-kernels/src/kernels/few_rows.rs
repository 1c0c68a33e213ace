//! Products of a few rows by a large matrix: a decoding step's linear layers, `[m, k] @ [k, n]`
//! with `m` the number of sequences decoded together (at most [`MAX_ROWS`]).
//!
//! Such a product does `m` multiply-adds per weight it reads, so reading the weights is its
//! cost. gemm serves more than one row from packed panels: it reads the weights, writes them
//! again in its own layout and reads that. Here every weight is read once from where it lies:
//!
//! - [`rows_by_matrix`]: a weight stored `[k, n]` row-major (a linear layer's `[in, out]`). The
//!   output rows accumulate in panels of columns (kept in L1 across the pass over `k`), four
//!   rows of weights at a time, each a contiguous stretch of the panel's width.
//! - [`rows_by_transposed`]: a weight stored `[n, k]` (the token table as a tied output head):
//!   each of its rows is read once and dotted with up to eight input rows at a time (in L1).
//!
//! Both write `out` without reading it. Rows are `a[r * a_rs..][..k]`; the `[k, n]` weight's
//! row `p` is `b[p * b_rs..][..n]`, the `[n, k]` one's row `j` is `b[j * b_rs..][..k]`.

use crate::kernels::vector_math::{madd, multiversion, tree_sum};

/// The most rows these loops are meant for. Beyond it gemm's panels, reused by many rows, catch
/// up (16 rows of GPT-2 124M decoded no faster by these loops than by gemm on 2 cores).
pub const MAX_ROWS: usize = 8;

/// Values in the output panels of all rows together (16 KiB, in L1 across the pass over `k`).
/// A panel is `PANEL_VALUES / rows` columns wide, at least [`MIN_PANEL`]: the wider, the longer
/// each contiguous stretch read from a weight row (16 KiB for one row).
const PANEL_VALUES: usize = 4096;

/// The narrowest panel: 1 KiB of each weight row.
const MIN_PANEL: usize = 256;

multiversion! {
    /// `out[r][j] = sum_p a[r * a_rs + p] * b[p * b_rs + j]` for `r < out.len()`,
    /// `j < out[r].len()`, `p < k`.
    pub fn rows_by_matrix(a: &[f32], a_rs: usize, k: usize, b: &[f32], b_rs: usize, out: &mut [&mut [f32]]) {
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

multiversion! {
    /// `out[r][j] = sum_p a[r * a_rs + p] * b[j * b_rs + p]` for `r < out.len()`,
    /// `j < out[r].len()`, `p < k`.
    pub fn rows_by_transposed(a: &[f32], a_rs: usize, k: usize, b: &[f32], b_rs: usize, out: &mut [&mut [f32]]) {
        let rows: Vec<&[f32]> = (0..out.len()).map(|r| &a[r * a_rs..][..k]).collect();
        for (rows, out) in rows.chunks(8).zip(out.chunks_mut(8)) {
            match rows.len() {
                8 => dots::<8, F>(rows.try_into().unwrap(), b, b_rs, k, out),
                7 => dots::<7, F>(rows.try_into().unwrap(), b, b_rs, k, out),
                6 => dots::<6, F>(rows.try_into().unwrap(), b, b_rs, k, out),
                5 => dots::<5, F>(rows.try_into().unwrap(), b, b_rs, k, out),
                4 => dots::<4, F>(rows.try_into().unwrap(), b, b_rs, k, out),
                3 => dots::<3, F>(rows.try_into().unwrap(), b, b_rs, k, out),
                2 => dots::<2, F>(rows.try_into().unwrap(), b, b_rs, k, out),
                _ => dots::<1, F>(rows.try_into().unwrap(), b, b_rs, k, out),
            }
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
    let split = k / 16 * 16;
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
}
