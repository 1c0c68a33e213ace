//! The few-row products with AVX-512 intrinsics. Left to the compiler, the loops over a
//! handful of rows were vectorised across the rows (gathers) for some row counts and across
//! the lanes for others, reloaded each row's length at every vector, and kept the outputs in
//! memory; written out, each kernel keeps every sum in a register until its end.
//!
//! Both add in the order of the loops in `mod.rs` (one fused multiply-add per term, lane by
//! lane, the lanes summed as `tree_sum` sums them), so their results are the loops' to the bit.

use super::{LANES, MAX_ROWS, with_rows};
use crate::kernels::vector_math::tree_sum;
use core::arch::x86_64::{
    __m512, _MM_HINT_T0, _MM_HINT_T1, _mm_prefetch, _mm512_fmadd_ps, _mm512_loadu_ps,
    _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps,
};

/// Columns of one register tile of [`tiles`]: two vectors, so that 8 rows hold 16 sums in
/// registers with room for the weights and the broadcast input.
const TILE: usize = 2 * LANES;

/// How many weight rows below the one being multiplied [`tiles`] asks for: a tile reads 128
/// bytes of each weight row, rows a whole row apart, which the hardware's prefetcher does not
/// follow. 16 decoded 8 sequences of GPT-2 124M fastest of 8, 16 and 32 (2-core Xeon).
const AHEAD: usize = 16;

/// `true` where the CPU runs these kernels.
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma")
}

/// `out[r][j] = rows[r] . b[j]` (`b[p * b_rs + j]` over `p < k`) for every column `j` of whole
/// tiles; returns how many columns that is (the rest are the caller's).
pub(super) fn rows_by_matrix(
    rows: &[&[f32]],
    k: usize,
    b: &[f32],
    b_rs: usize,
    out: &mut [&mut [f32]],
) -> usize {
    assert!(
        available(),
        "few-row products: AVX-512 kernels called without AVX-512"
    );
    let tiled = out.first().map_or(0, |o| o.len()) / TILE * TILE;
    for (rows, out) in rows.chunks(MAX_ROWS).zip(out.chunks_mut(MAX_ROWS)) {
        // SAFETY: the CPU has AVX-512F and FMA (asserted above).
        with_rows!(rows, unsafe { tiles::<R>(rows, k, b, b_rs, tiled, out) })
    }
    tiled
}

/// `out[r][j] = rows[r] . b[j * b_rs..][..k]` for every row `r` and column `j`.
pub(super) fn rows_by_transposed(
    rows: &[&[f32]],
    k: usize,
    b: &[f32],
    b_rs: usize,
    out: &mut [&mut [f32]],
) {
    assert!(
        available(),
        "few-row products: AVX-512 kernels called without AVX-512"
    );
    for (rows, out) in rows.chunks(MAX_ROWS).zip(out.chunks_mut(MAX_ROWS)) {
        // SAFETY: as above.
        with_rows!(rows, unsafe { dots::<R>(rows, b, b_rs, k, out) })
    }
}

/// `out[r][j] = sum_p rows[r][p] * b[p * b_rs + j]` for `j < tiled` (a multiple of [`TILE`]):
/// 32 columns of all `R` rows summed in registers down the whole of `k`, each weight read
/// once. While a tile runs down `k`, the rows [`AHEAD`] below are fetched into L1 and the next
/// tile's stretch of each row into L2.
///
/// # Safety
/// The CPU has AVX-512F and FMA.
#[target_feature(enable = "avx512f,fma")]
unsafe fn tiles<const R: usize>(
    rows: &[&[f32]; R],
    k: usize,
    b: &[f32],
    b_rs: usize,
    tiled: usize,
    out: &mut [&mut [f32]],
) {
    assert!(
        rows.iter().all(|x| x.len() >= k),
        "few-row tiles: a row shorter than k"
    );
    assert!(
        out.iter().all(|o| o.len() >= tiled),
        "few-row tiles: an output row too short"
    );
    assert!(
        k == 0 || tiled == 0 || (k - 1) * b_rs + tiled <= b.len(),
        "few-row tiles: weights outside their buffer"
    );
    for c in (0..tiled).step_by(TILE) {
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for p in 0..k {
            // SAFETY: `p < k` and `c + TILE <= tiled`, so the tile's 32 weights of row `p` are
            // inside `b` (asserted above); the prefetches are hints at addresses inside `b`
            // (row `p + AHEAD < k`, and the next tile's columns below `tiled`).
            let w = unsafe {
                let at = b.as_ptr().add(p * b_rs + c);
                if p + AHEAD < k {
                    let below = b.as_ptr().add((p + AHEAD) * b_rs + c).cast::<i8>();
                    _mm_prefetch::<_MM_HINT_T0>(below);
                    _mm_prefetch::<_MM_HINT_T0>(below.add(64));
                }
                if c + TILE < tiled {
                    let next = at.add(TILE).cast::<i8>();
                    _mm_prefetch::<_MM_HINT_T1>(next);
                    _mm_prefetch::<_MM_HINT_T1>(next.add(64));
                }
                [_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(LANES))]
            };
            for (acc, x) in acc.iter_mut().zip(rows) {
                // SAFETY: `p < k <= x.len()` (asserted above).
                let x = _mm512_set1_ps(unsafe { *x.get_unchecked(p) });
                acc[0] = _mm512_fmadd_ps(x, w[0], acc[0]);
                acc[1] = _mm512_fmadd_ps(x, w[1], acc[1]);
            }
        }
        for (acc, o) in acc.iter().zip(out.iter_mut()) {
            // SAFETY: `c + TILE <= tiled <= o.len()` (asserted above).
            unsafe {
                _mm512_storeu_ps(o.as_mut_ptr().add(c), acc[0]);
                _mm512_storeu_ps(o.as_mut_ptr().add(c + LANES), acc[1]);
            }
        }
    }
}

/// `out[r][j] = rows[r] . b[j * b_rs..][..k]`, two weight rows at a time: each weight read
/// once, each input vector loaded once for both, `2 R` sums in registers.
///
/// # Safety
/// The CPU has AVX-512F and FMA.
#[target_feature(enable = "avx512f,fma")]
unsafe fn dots<const R: usize>(
    rows: &[&[f32]; R],
    b: &[f32],
    b_rs: usize,
    k: usize,
    out: &mut [&mut [f32]],
) {
    assert!(
        rows.iter().all(|x| x.len() >= k),
        "few-row dots: a row shorter than k"
    );
    let n = out[0].len();
    let row = |j: usize| &b[j * b_rs..][..k];
    let mut j = 0;
    while j + 2 <= n {
        // The next pair is fetched meanwhile (at the end, this pair again: lines already here).
        let ahead = |i: usize| row(if i < n { i } else { j });
        // SAFETY: the CPU has the features (this function's own).
        let sums =
            unsafe { sums::<R, 2>(rows, [row(j), row(j + 1)], [ahead(j + 2), ahead(j + 3)]) };
        for (o, s) in out.iter_mut().zip(sums) {
            o[j] = s[0];
            o[j + 1] = s[1];
        }
        j += 2;
    }
    if j < n {
        // SAFETY: as above.
        let sums = unsafe { sums::<R, 1>(rows, [row(j)], [row(j)]) };
        for (o, s) in out.iter_mut().zip(sums) {
            o[j] = s[0];
        }
    }
}

/// `rows[r] . ws[i]` for every row and weight row (all `k = ws[0].len()` long, the rows at
/// least that), while `next` (as long) is fetched into L1: the memory's latency, paid at
/// each new weight row otherwise, is spent while these are multiplied.
///
/// # Safety
/// The CPU has AVX-512F and FMA.
#[target_feature(enable = "avx512f,fma")]
unsafe fn sums<const R: usize, const J: usize>(
    rows: &[&[f32]; R],
    ws: [&[f32]; J],
    next: [&[f32]; J],
) -> [[f32; J]; R] {
    let k = ws[0].len();
    assert!(ws.iter().chain(&next).all(|w| w.len() == k) && rows.iter().all(|x| x.len() >= k));
    let split = k / LANES * LANES;
    let mut acc: [[__m512; J]; R] = [[_mm512_setzero_ps(); J]; R];
    for c in (0..split).step_by(LANES) {
        // SAFETY: `c + LANES <= split <= k`: inside every weight row, `next` row and input row
        // (asserted above); the prefetches read and write nothing.
        let wv: [__m512; J] = core::array::from_fn(|i| unsafe {
            _mm_prefetch::<_MM_HINT_T0>(next[i].as_ptr().add(c).cast());
            _mm512_loadu_ps(ws[i].as_ptr().add(c))
        });
        for (acc, x) in acc.iter_mut().zip(rows) {
            let xv = unsafe { _mm512_loadu_ps(x.as_ptr().add(c)) };
            for (acc, wv) in acc.iter_mut().zip(wv) {
                *acc = _mm512_fmadd_ps(xv, wv, *acc);
            }
        }
    }
    let mut out = [[0.0; J]; R];
    for ((out, acc), x) in out.iter_mut().zip(acc).zip(rows) {
        for ((out, acc), w) in out.iter_mut().zip(acc).zip(ws) {
            let mut lanes = [0.0f32; LANES];
            // SAFETY: `lanes` holds one vector.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
            let tail = (split..k).fold(0.0, |s, p| x[p].mul_add(w[p], s));
            *out = tree_sum(&mut lanes) + tail;
        }
    }
    out
}
