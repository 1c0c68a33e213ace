//! The kernels between the products, over one head `h` of `H` and the sequences from `first` on:
//! rows `r = s * T + i` of the call's `[n, T, T]` buffers (query `i` of sequence `first + s`,
//! key `j` along the row; `rows` or `elements` of them in this call). Weight `(i, j)` of that
//! head is element `(((first + s) * H + h) * T + i) * T + j` of the dropout mask, as in the fused
//! kernels, and `L` is read from and written to `lse[((first + s) * H + h) * T + i]`.
//!
//! The products run in blocks of `block` query rows (`T` for one block), and read a row's
//! weights or scores' gradients up to its block's last key, never past it: the kernels write
//! row `i` up to there ([`row_end`]), zeros past the diagonal included.

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;

use super::ROW_UNITS;
use crate::cube::hashed_mask::Mask;
use crate::cube::{cube_row, reduce_cube};

/// The index among every sequence's and head's query rows, `(s * H + h) * T + i`, of row
/// `r` of the call (the dropout mask's row and `lse`'s element).
#[cube]
fn head_row(r: usize, t: usize, first: usize, h: usize, heads: usize) -> usize {
    ((first + r / t) * heads + h) * t + r % t
}

/// The end of row `i`'s keys that the products read: its block's (of `block` rows) last row
/// plus one, at most `t`.
#[cube]
fn row_end(i: usize, t: usize, block: usize) -> usize {
    let mut end = (i / block + 1) * block;
    if end > t {
        end = t;
    }
    end
}

/// One cube per row: its log-sum-exp `L` over keys `0..=i` of the scaled scores `s` (one read
/// of the row), and `exp(s - L)` times the dropout factor into `w` (0 past `i`, up to the row's
/// block's end), computed in `f32` and stored in the weights' type `N`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_weights<N: Float>(
    s: &Tensor<f32>,
    lse: &mut Tensor<f32>,
    seed: &Tensor<f32>,
    w: &mut Tensor<N>,
    threshold: u32,
    keep_scale: f32,
    rows: usize,
    first: usize,
    h: usize,
    heads: usize,
    block: usize,
    #[comptime] dropout: bool,
) {
    let t = s.shape(1);
    let r = cube_row();
    if r >= rows {
        terminate!();
    }
    let (u, units) = (UNIT_POS_X as usize, CUBE_DIM_X as usize);
    let (i, at, row) = (r % t, r * t, head_row(r, t, first, h, heads));
    let mut scratch = Shared::<[f32]>::new_slice(ROW_UNITS);
    // One read of the row for `L`: each unit's running maximum and its sum of exponentials
    // rescaled whenever the maximum grows (the online softmax), met over the cube after.
    let mut own_max = f32::min_value();
    let mut own_sum = 0.0f32;
    for j in range_stepped(u, i + 1, units) {
        let x = s[at + j];
        if x > own_max {
            own_sum = own_sum * f32::exp(own_max - x) + 1.0;
            own_max = x;
        } else {
            own_sum += f32::exp(x - own_max);
        }
    }
    let max = reduce_cube::<f32>(&mut scratch, own_max, true);
    // A unit that saw no key has a sum of 0 (its maximum the lowest float: no overflow).
    let sum = reduce_cube::<f32>(&mut scratch, own_sum * f32::exp(own_max - max), false);
    let l = max + f32::ln(sum);
    if u == 0 {
        lse[row] = l;
    }
    let mask = Mask::<f32>::new(seed, threshold, keep_scale, dropout);
    for j in range_stepped(u, row_end(i, t, block), units) {
        let mut value = 0.0f32;
        if j <= i {
            value = f32::exp(s[at + j] - l) * mask.factor(row * t + j, dropout);
        }
        w[at + j] = N::cast_from(value);
    }
}

/// One cube per row of the backward pass: from the scaled scores `s`, `L` and the dropped
/// weights' gradient `g = dO V^T` (all `f32`), the dropped weights `P M` into `w` and the
/// scores' gradient `P (g M - delta)` into `ds`, both in their type `N` (0 past the diagonal,
/// up to the row's block's end), `delta = sum_j P_j M_j g_j`: one pass over the row for
/// `delta`, one that writes both.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_backward_rows<N: Float>(
    s: &Tensor<f32>,
    lse: &Tensor<f32>,
    seed: &Tensor<f32>,
    g: &Tensor<f32>,
    w: &mut Tensor<N>,
    ds: &mut Tensor<N>,
    threshold: u32,
    keep_scale: f32,
    rows: usize,
    first: usize,
    h: usize,
    heads: usize,
    block: usize,
    #[comptime] dropout: bool,
) {
    let t = s.shape(1);
    let r = cube_row();
    if r >= rows {
        terminate!();
    }
    let (u, units) = (UNIT_POS_X as usize, CUBE_DIM_X as usize);
    let (i, at, row) = (r % t, r * t, head_row(r, t, first, h, heads));
    let l = lse[row];
    let mask = Mask::<f32>::new(seed, threshold, keep_scale, dropout);
    let mut scratch = Shared::<[f32]>::new_slice(ROW_UNITS);
    let mut delta = 0.0f32;
    for j in range_stepped(u, i + 1, units) {
        let p = f32::exp(s[at + j] - l);
        delta += p * mask.factor(row * t + j, dropout) * g[at + j];
    }
    let delta = reduce_cube::<f32>(&mut scratch, delta, false);
    for j in range_stepped(u, row_end(i, t, block), units) {
        let mut kept = 0.0f32;
        let mut value = 0.0f32;
        if j <= i {
            let p = f32::exp(s[at + j] - l);
            let m = mask.factor(row * t + j, dropout);
            kept = p * m;
            value = p * (g[at + j] * m - delta);
        }
        w[at + j] = N::cast_from(kept);
        ds[at + j] = N::cast_from(value);
    }
}
