//! The one-row backward pass: the queries' gradient (one unit per query row, with `delta`), then
//! the keys' and the values' (one unit per key row).

use super::*;
use crate::cube::hashed_mask::Mask;

/// Backward pass, queries: one unit per query row `(b, h, i)` writes `delta_i` and `dQ_i`,
/// the keys and values `tile` rows at a time through shared memory.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn attention_backward_query<F: Float, N: Size>(
    qkv: &Tensor<Vector<F, N>>,
    seed: &Tensor<F>,
    out: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<F>,
    delta: &mut Tensor<F>,
    dqkv: &mut Tensor<Vector<F, N>>,
    scale: f32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] k: usize,
    #[comptime] w: usize,
    #[comptime] heads: usize,
    #[comptime] dropout: bool,
    #[comptime] tile: usize,
) {
    let t = qkv.shape(1);
    let d = heads * k;
    let at = block_of(t, k, heads);
    let i = at.r;
    let row = at.bh * t + i;
    let scale = F::cast_from(scale);
    let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);

    let mut q = zeros::<F, N>(k);
    let mut g = zeros::<F, N>(k);
    let mut di = F::new(0.0);
    let mut li = F::new(0.0);
    if at.active {
        q = load_row::<F, N>(qkv, at.q0, 3 * d, i, k);
        g = load_row::<F, N>(grad, at.o0, d, i, k);
        di = dot::<F, N>(grad, at.o0 + i * d, out, at.o0 + i * d, k, w);
        delta[row] = di;
        li = lse[row];
    }
    let mut acc = zeros::<F, N>(k);
    let mut keys = Shared::<[Vector<F, N>]>::new_slice(comptime!(tile * k));
    let mut values = Shared::<[Vector<F, N>]>::new_slice(comptime!(tile * k));
    let mut j0 = 0usize;
    while j0 < at.end {
        load_tile::<F, N>(qkv, &mut keys, at.k0, 3 * d, j0, t, k, tile);
        load_tile::<F, N>(qkv, &mut values, at.v0, 3 * d, j0, t, k, tile);
        sync_cube();
        if at.active {
            for jj in 0..rows_below(j0, i + 1, tile) {
                let s = dot_tile::<F, N>(&q, &keys, jj, k, w) * scale;
                let dp = dot_tile::<F, N>(&g, &values, jj, k, w);
                let factor = mask.factor(row * t + j0 + jj, dropout);
                let ds = F::exp(s - li) * (dp * factor - di);
                add_scaled::<F, N>(&mut acc, ds, &keys, jj, k);
            }
        }
        sync_cube();
        j0 += tile;
    }
    if at.active {
        let q = at.q0 + i * 3 * d;
        let scale = Vector::<F, N>::new(scale);
        #[unroll]
        for c in 0..k {
            dqkv[q + c] = acc[c] * scale;
        }
    }
}

/// Backward pass, keys or values (`#[comptime] values`): one unit per key row `(b, h, j)`
/// writes `dK_j` or `dV_j`, over queries `i >= j` read `tile` rows at a time through shared
/// memory with their output gradients, log-sum-exps and `delta`s (after
/// [`attention_backward_query`], which writes `delta`).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn attention_backward_key_value<F: Float, N: Size>(
    qkv: &Tensor<Vector<F, N>>,
    seed: &Tensor<F>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<F>,
    delta: &Tensor<F>,
    dqkv: &mut Tensor<Vector<F, N>>,
    scale: f32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] k: usize,
    #[comptime] w: usize,
    #[comptime] heads: usize,
    #[comptime] dropout: bool,
    #[comptime] values: bool,
    #[comptime] tile: usize,
) {
    let t = qkv.shape(1);
    let d = heads * k;
    let at = block_of(t, k, heads);
    let j = at.r;
    let first = at.bh * t; // query row 0 of this (b, h)
    let scale = F::cast_from(scale);
    let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);

    let mut kj = zeros::<F, N>(k);
    let mut vj = zeros::<F, N>(k);
    if at.active {
        kj = load_row::<F, N>(qkv, at.k0, 3 * d, j, k);
        if !values {
            vj = load_row::<F, N>(qkv, at.v0, 3 * d, j, k);
        }
    }
    let mut acc = zeros::<F, N>(k);
    let mut queries = Shared::<[Vector<F, N>]>::new_slice(comptime!(tile * k));
    let mut grads = Shared::<[Vector<F, N>]>::new_slice(comptime!(tile * k));
    let mut lses = Shared::<[F]>::new_slice(tile);
    let mut deltas = Shared::<[F]>::new_slice(tile);
    // Queries before the block's first key see none of its keys.
    let mut i0 = at.first;
    while i0 < t {
        load_tile::<F, N>(qkv, &mut queries, at.q0, 3 * d, i0, t, k, tile);
        load_tile::<F, N>(grad, &mut grads, at.o0, d, i0, t, k, tile);
        load_scalars::<F>(lse, &mut lses, first, i0, t, tile);
        if !values {
            load_scalars::<F>(delta, &mut deltas, first, i0, t, tile);
        }
        sync_cube();
        if at.active {
            // Tile rows of queries i >= j (and below T).
            let mut start = 0usize;
            if j > i0 {
                start = j - i0;
            }
            for ii in start..rows_below(i0, t, tile) {
                let i = i0 + ii;
                let s = dot_tile::<F, N>(&kj, &queries, ii, k, w) * scale;
                let p = F::exp(s - lses[ii]);
                let factor = mask.factor((first + i) * t + j, dropout);
                if values {
                    // dV_j = sum_i P_ij (mask) dO_i
                    add_scaled::<F, N>(&mut acc, p * factor, &grads, ii, k);
                } else {
                    // dK_j = scale * sum_i dS_ij Q_i, dS_ij = P_ij (dP_ij (mask) - delta_i)
                    let dp = dot_tile::<F, N>(&vj, &grads, ii, k, w);
                    let ds = p * (dp * factor - deltas[ii]);
                    add_scaled::<F, N>(&mut acc, ds, &queries, ii, k);
                }
            }
        }
        sync_cube();
        i0 += tile;
    }
    if at.active {
        let scale = Vector::<F, N>::new(scale);
        #[unroll]
        for c in 0..k {
            if values {
                dqkv[at.v0 + j * 3 * d + c] = acc[c];
            } else {
                dqkv[at.k0 + j * 3 * d + c] = acc[c] * scale;
            }
        }
    }
}
