//! The CubeCL kernels (CubeCL's `Tensor`, not Burn's). Loops over a row's `K` columns are
//! unrolled (`K` is a compile-time constant), so the accumulators can stay in registers.
//!
//! Dropout (`#[comptime] dropout`; without it the mask is never computed): weight `(r, j)` of
//! query row `r = (b * H + h) * T + i` is element `r * T + j` of a hashed mask
//! (`cube::hashed_mask`). The log-sum-exp is that of the weights
//! before dropout, so `delta_i = dO_i . O_i` still equals `sum_j P_ij dP_ij` with the mask in
//! `dP`.
//!
//! Shared here: the block of rows a cube takes and the row and tile loads; one file per family:
//! [`forward`] and [`backward`] (one row per unit), [`tiled`] (the register tiles' shared
//! parts), [`forward_tiled`] and [`backward_tiled`], [`mma`] (the tensor cores' shared parts),
//! [`forward_mma`] and [`backward_mma`], [`cached`] (decoding).

mod backward;
mod backward_mma;
mod backward_tiled;
mod cached;
mod forward;
mod forward_mma;
mod forward_tiled;
mod mma;
mod tiled;

pub(super) use backward::{attention_backward_key_value, attention_backward_query};
pub(super) use backward_mma::{attention_backward_key_value_mma, attention_backward_query_mma};
pub(super) use backward_tiled::{
    attention_backward_key_value_tiled, attention_backward_query_tiled,
};
pub(super) use cached::{cached_attention, cached_attention_at};
pub(super) use forward::attention_forward;
pub(super) use forward_mma::attention_forward_mma;
pub(super) use forward_tiled::attention_forward_tiled;

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;

/// Where the cube's block of rows of one head reads and writes: the head's index among all
/// sequences' heads `bh = b * H + h`, the unit's row `r` (query or key) and whether it is
/// a row at all (the last block of a sequence runs past `T`), and the offsets of row 0 of
/// the head's Q, K and V columns in `[B, T, 3D]` and of its output columns in `[B, T, D]`
/// (row `n` of each is `3D` or `D` further per row).
#[derive(CubeType, Clone, Copy)]
struct Block {
    bh: usize,
    r: usize,
    active: bool,
    /// The block's first row, and the end of its rows (`T` at most).
    first: usize,
    end: usize,
    q0: usize,
    k0: usize,
    v0: usize,
    o0: usize,
}

#[cube]
fn block_of(t: usize, #[comptime] k: usize, #[comptime] heads: usize) -> Block {
    let d = heads * k;
    let bh = CUBE_POS_Y as usize;
    let h = bh % heads;
    let b = bh / heads;
    let first = CUBE_POS_X as usize * CUBE_DIM_X as usize;
    let r = first + UNIT_POS_X as usize;
    let mut end = first + CUBE_DIM_X as usize;
    if end > t {
        end = t;
    }
    let q0 = b * t * 3 * d + h * k;
    Block {
        bh,
        r,
        active: r < t,
        first,
        end,
        q0,
        k0: q0 + d,
        v0: q0 + 2 * d,
        o0: b * t * d + h * k,
    }
}

/// Rows `j0..j0 + rows` of one head's `k` vectors of `src` (row 0 at `base`, rows `stride`
/// apart, both in vectors) into `tile`, row after row, zeros for rows past `t`. Every unit
/// of the cube takes part (consecutive units, consecutive vectors); the caller synchronises
/// the cube before reading the tile.
#[allow(clippy::too_many_arguments)]
#[cube]
fn load_tile<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    tile: &mut Shared<[Vector<F, N>]>,
    base: usize,
    stride: usize,
    j0: usize,
    t: usize,
    #[comptime] k: usize,
    #[comptime] rows: usize,
) {
    let units = CUBE_DIM_X as usize;
    let n = comptime!(rows * k);
    let mut e = UNIT_POS_X as usize;
    while e < n {
        let j = j0 + e / k;
        let mut x = Vector::<F, N>::new(F::new(0.0));
        if j < t {
            x = src[base + j * stride + e % k];
        }
        tile[e] = x;
        e += units;
    }
}

/// `src[base + j0..base + j0 + rows]` into `tile`, zeros past `t` (one value per row:
/// log-sum-exps, `delta`s), one per unit (a tile has no more rows than a cube has units).
#[cube]
fn load_scalars<F: Float>(
    src: &Tensor<F>,
    tile: &mut Shared<[F]>,
    base: usize,
    j0: usize,
    t: usize,
    #[comptime] rows: usize,
) {
    let u = UNIT_POS_X as usize;
    if u < rows {
        let mut x = F::new(0.0);
        if j0 + u < t {
            x = src[base + j0 + u];
        }
        tile[u] = x;
    }
}

/// Row `r` of one head's `k` vectors (row 0 at `base`, rows `stride` apart) into registers.
#[cube]
fn load_row<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    base: usize,
    stride: usize,
    r: usize,
    #[comptime] k: usize,
) -> Array<Vector<F, N>> {
    let mut row = Array::<Vector<F, N>>::new(k);
    #[unroll]
    for c in 0..k {
        row[c] = src[base + r * stride + c];
    }
    row
}

/// The sum of the `w` lanes of `v`.
#[cube]
fn lanes_sum<F: Float, N: Size>(v: Vector<F, N>, #[comptime] w: usize) -> F {
    let mut sum = F::new(0.0);
    #[unroll]
    for l in 0..w {
        sum += v.extract(l);
    }
    sum
}

/// `row . tile[jj]` (row `jj` of a shared tile of `k` vectors of `w` lanes): one load of
/// `w` values per `w` products.
#[cube]
fn dot_tile<F: Float, N: Size>(
    row: &Array<Vector<F, N>>,
    tile: &Shared<[Vector<F, N>]>,
    jj: usize,
    #[comptime] k: usize,
    #[comptime] w: usize,
) -> F {
    let mut sum = Vector::<F, N>::new(F::new(0.0));
    #[unroll]
    for c in 0..k {
        sum += row[c] * tile[jj * k + c];
    }
    lanes_sum::<F, N>(sum, w)
}

/// `acc += w * tile[jj]`.
#[cube]
fn add_scaled<F: Float, N: Size>(
    acc: &mut Array<Vector<F, N>>,
    w: F,
    tile: &Shared<[Vector<F, N>]>,
    jj: usize,
    #[comptime] k: usize,
) {
    let w = Vector::<F, N>::new(w);
    #[unroll]
    for c in 0..k {
        acc[c] += w * tile[jj * k + c];
    }
}

/// A row of `k` zero vectors in registers.
#[cube]
fn zeros<F: Float, N: Size>(#[comptime] k: usize) -> Array<Vector<F, N>> {
    let mut row = Array::<Vector<F, N>>::new(k);
    #[unroll]
    for c in 0..k {
        row[c] = Vector::<F, N>::new(F::new(0.0));
    }
    row
}

/// `min(hi, lo + rows) - lo` clamped at 0: how many of the tile rows `lo..lo + rows` lie
/// below `hi`.
#[cube]
fn rows_below(lo: usize, hi: usize, #[comptime] rows: usize) -> usize {
    let mut n = 0usize;
    if hi > lo {
        n = hi - lo;
        if n > rows {
            n = rows;
        }
    }
    n
}

/// `a[ai..ai + k] . b[bi..bi + k]` (`k` vectors of `w` lanes).
#[cube]
fn dot<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    ai: usize,
    b: &Tensor<Vector<F, N>>,
    bi: usize,
    #[comptime] k: usize,
    #[comptime] w: usize,
) -> F {
    let mut sum = Vector::<F, N>::new(F::new(0.0));
    #[unroll]
    for c in 0..k {
        sum += a[ai + c] * b[bi + c];
    }
    lanes_sum::<F, N>(sum, w)
}
