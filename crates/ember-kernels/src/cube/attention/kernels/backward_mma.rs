//! The backward pass on tensor cores, FlashAttention-2's: the weights recomputed from the
//! forward pass's log-sum-exps, `dS = P (dP - delta)`, and two kernels: one per block of
//! queries for `dQ` (and each row's `delta`), one per block of keys for `dK` and `dV`; every
//! product in `cmma` fragments ([`super::mma`]). The projection, the output, its gradient and
//! the projection's gradient are of type `I` (the projection's own), everything else `F`
//! (`f32`).

use super::mma::*;
use super::tiled::{TiledBlock, tiled_block};
use super::*;
use crate::cube::hashed_mask::Mask;

/// The queries' gradient of one block of `rows` query rows of one head, over tiles of `cols`
/// keys: `delta_i = dO_i . O_i` first (written out for the keys' kernel), then per tile
/// `S = Q K^T` and `dP = dO V^T` (fragments), `dS = P (dP * mask - delta)` row by row
/// (rounded to `E`), and `dQ += dS K`; `dQ` scaled into the projection's gradient.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn attention_backward_query_mma<F: Float, E: Float, I: Float>(
    qkv: &Tensor<I>,
    seed: &Tensor<F>,
    out: &Tensor<I>,
    grad: &Tensor<I>,
    lse: &Tensor<F>,
    delta: &mut Tensor<F>,
    dqkv: &mut Tensor<I>,
    scale: f32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] k: usize,
    #[comptime] heads: usize,
    #[comptime] dropout: bool,
    #[comptime] shape: (usize, usize, usize),
    #[comptime] rows: usize,
    #[comptime] cols: usize,
    #[comptime] parts: usize,
) {
    let t = qkv.shape(1);
    let d = heads * k;
    let TiledBlock {
        bh,
        first,
        q0,
        k0,
        v0,
        o0,
        ..
    } = tiled_block(t, k, heads, rows);
    let scale = F::cast_from(scale);
    let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);
    // This unit's row of the block and its part of the row (`parts` units per row).
    let r = UNIT_POS_X as usize % rows;
    let p = UNIT_POS_X as usize / rows;
    let row = first + r;
    let width = comptime!(cols / parts);
    let out_width = comptime!(k / parts);

    let mut queries = Shared::<[E]>::new_aligned_slice(comptime!(rows * k), FRAGMENT_ALIGN);
    let mut grads = Shared::<[E]>::new_aligned_slice(comptime!(rows * k), FRAGMENT_ALIGN);
    let mut keys = Shared::<[E]>::new_aligned_slice(comptime!(cols * k), FRAGMENT_ALIGN);
    let mut values = Shared::<[E]>::new_aligned_slice(comptime!(cols * k), FRAGMENT_ALIGN);
    let mut scores = Shared::<[F]>::new_aligned_slice(comptime!(rows * cols), FRAGMENT_ALIGN);
    let mut weight_grads = Shared::<[F]>::new_aligned_slice(comptime!(rows * cols), FRAGMENT_ALIGN);
    let mut score_grads = Shared::<[E]>::new_aligned_slice(comptime!(rows * cols), FRAGMENT_ALIGN);
    let mut acc = Shared::<[F]>::new_aligned_slice(comptime!(rows * k), FRAGMENT_ALIGN);
    let mut partial = Shared::<[F]>::new_slice(comptime!(rows * parts));
    let mut row_lse = Shared::<[F]>::new_slice(rows);
    let mut row_delta = Shared::<[F]>::new_slice(rows);

    load_rounded::<I, E>(qkv, &mut queries, q0, 3 * d, first, t, k, rows);
    load_rounded::<I, E>(grad, &mut grads, o0, d, first, t, k, rows);
    // delta_i = dO_i . O_i in f32, from the tensors themselves.
    let mut dot = F::new(0.0);
    #[unroll]
    for c in 0..out_width {
        let cc = p * out_width + c;
        acc[r * k + cc] = F::new(0.0);
        if row < t {
            dot += F::cast_from(grad[o0 + row * d + cc]) * F::cast_from(out[o0 + row * d + cc]);
        }
    }
    partial[p * rows + r] = dot;
    sync_cube();
    if p == 0 {
        let total = parts_sum::<F>(&partial, r, rows, parts);
        row_delta[r] = total;
        let mut l = F::new(0.0);
        if row < t {
            delta[bh * t + row] = total;
            l = lse[bh * t + row];
        }
        row_lse[r] = l;
    }
    let mut end = first + rows;
    if end > t {
        end = t;
    }
    let mut j0 = 0usize;
    while j0 < end {
        load_rounded::<I, E>(qkv, &mut keys, k0, 3 * d, j0, t, k, cols);
        load_rounded::<I, E>(qkv, &mut values, v0, 3 * d, j0, t, k, cols);
        sync_cube();
        strip_product::<F, E>(
            &queries,
            &keys,
            &mut scores,
            k,
            cols,
            true,
            false,
            shape,
            rows,
        );
        strip_product::<F, E>(
            &grads,
            &values,
            &mut weight_grads,
            k,
            cols,
            true,
            false,
            shape,
            rows,
        );
        sync_cube();
        let (l, dl) = (row_lse[r], row_delta[r]);
        #[unroll]
        for c in 0..width {
            let jj = p * width + c;
            let j = j0 + jj;
            let mut ds = F::new(0.0);
            if j <= row && row < t {
                let w = F::exp(scores[r * cols + jj] * scale - l);
                let factor = mask.factor((bh * t + row) * t + j, dropout);
                ds = w * (weight_grads[r * cols + jj] * factor - dl);
            }
            score_grads[r * cols + jj] = E::cast_from(ds);
        }
        sync_cube();
        strip_product::<F, E>(
            &score_grads,
            &keys,
            &mut acc,
            cols,
            k,
            false,
            true,
            shape,
            rows,
        );
        sync_cube();
        j0 += cols;
    }
    if row < t {
        #[unroll]
        for c in 0..out_width {
            let cc = p * out_width + c;
            dqkv[q0 + row * 3 * d + cc] = I::cast_from(acc[r * k + cc] * scale);
        }
    }
}

/// The keys' and values' gradients of one block of `rows` key rows of one head, over tiles
/// of `cols` queries from the block's first key on (earlier queries see none of its keys):
/// per tile `S^T = K Q^T` and `dP^T = V dO^T` (fragments), then row by row the weights `P^T`
/// from the queries' log-sum-exps, `P^T * mask` and `dS^T = P^T (dP^T * mask - delta)`
/// (both rounded to `E`, each into an array of its own), then `dV += (P^T * mask) dO` and
/// `dK += dS^T Q`: four barriers a tile. `dK` scaled and `dV` written into the projection's
/// gradient.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn attention_backward_key_value_mma<F: Float, E: Float, I: Float>(
    qkv: &Tensor<I>,
    seed: &Tensor<F>,
    grad: &Tensor<I>,
    lse: &Tensor<F>,
    delta: &Tensor<F>,
    dqkv: &mut Tensor<I>,
    scale: f32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] k: usize,
    #[comptime] heads: usize,
    #[comptime] dropout: bool,
    #[comptime] shape: (usize, usize, usize),
    #[comptime] rows: usize,
    #[comptime] cols: usize,
    #[comptime] parts: usize,
) {
    let t = qkv.shape(1);
    let d = heads * k;
    let TiledBlock {
        bh,
        first,
        q0,
        k0,
        v0,
        o0,
        ..
    } = tiled_block(t, k, heads, rows);
    let scale = F::cast_from(scale);
    let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);
    // This unit's row of the block and its part of the row (`parts` units per row).
    let r = UNIT_POS_X as usize % rows;
    let p = UNIT_POS_X as usize / rows;
    // This unit's key row.
    let key = first + r;
    let width = comptime!(cols / parts);
    let out_width = comptime!(k / parts);

    let mut keys = Shared::<[E]>::new_aligned_slice(comptime!(rows * k), FRAGMENT_ALIGN);
    let mut values = Shared::<[E]>::new_aligned_slice(comptime!(rows * k), FRAGMENT_ALIGN);
    let mut queries = Shared::<[E]>::new_aligned_slice(comptime!(cols * k), FRAGMENT_ALIGN);
    let mut grads = Shared::<[E]>::new_aligned_slice(comptime!(cols * k), FRAGMENT_ALIGN);
    let mut scores = Shared::<[F]>::new_aligned_slice(comptime!(rows * cols), FRAGMENT_ALIGN);
    let mut weight_grads = Shared::<[F]>::new_aligned_slice(comptime!(rows * cols), FRAGMENT_ALIGN);
    let mut value_operand =
        Shared::<[E]>::new_aligned_slice(comptime!(rows * cols), FRAGMENT_ALIGN);
    let mut key_operand = Shared::<[E]>::new_aligned_slice(comptime!(rows * cols), FRAGMENT_ALIGN);
    let mut key_acc = Shared::<[F]>::new_aligned_slice(comptime!(rows * k), FRAGMENT_ALIGN);
    let mut value_acc = Shared::<[F]>::new_aligned_slice(comptime!(rows * k), FRAGMENT_ALIGN);
    let mut tile_lse = Shared::<[F]>::new_slice(cols);
    let mut tile_delta = Shared::<[F]>::new_slice(cols);

    load_rounded::<I, E>(qkv, &mut keys, k0, 3 * d, first, t, k, rows);
    load_rounded::<I, E>(qkv, &mut values, v0, 3 * d, first, t, k, rows);
    #[unroll]
    for c in 0..out_width {
        let cc = p * out_width + c;
        key_acc[r * k + cc] = F::new(0.0);
        value_acc[r * k + cc] = F::new(0.0);
    }
    let mut i0 = first / cols * cols;
    while i0 < t {
        load_rounded::<I, E>(qkv, &mut queries, q0, 3 * d, i0, t, k, cols);
        load_rounded::<I, E>(grad, &mut grads, o0, d, i0, t, k, cols);
        load_scalars::<F>(lse, &mut tile_lse, bh * t, i0, t, cols);
        load_scalars::<F>(delta, &mut tile_delta, bh * t, i0, t, cols);
        sync_cube();
        strip_product::<F, E>(
            &keys,
            &queries,
            &mut scores,
            k,
            cols,
            true,
            false,
            shape,
            rows,
        );
        strip_product::<F, E>(
            &values,
            &grads,
            &mut weight_grads,
            k,
            cols,
            true,
            false,
            shape,
            rows,
        );
        sync_cube();
        // Row by row, the two operands of the tile's last products: the weights P^T dropped
        // (for dV) and dS^T = P^T (dP^T * mask - delta) (for dK), from one mask draw each.
        #[unroll]
        for c in 0..width {
            let ii = p * width + c;
            let i = i0 + ii;
            let mut dropped = F::new(0.0);
            let mut ds = F::new(0.0);
            if key <= i && i < t {
                let w = F::exp(scores[r * cols + ii] * scale - tile_lse[ii]);
                let factor = mask.factor((bh * t + i) * t + key, dropout);
                dropped = w * factor;
                ds = w * (weight_grads[r * cols + ii] * factor - tile_delta[ii]);
            }
            value_operand[r * cols + ii] = E::cast_from(dropped);
            key_operand[r * cols + ii] = E::cast_from(ds);
        }
        sync_cube();
        strip_product::<F, E>(
            &value_operand,
            &grads,
            &mut value_acc,
            cols,
            k,
            false,
            true,
            shape,
            rows,
        );
        strip_product::<F, E>(
            &key_operand,
            &queries,
            &mut key_acc,
            cols,
            k,
            false,
            true,
            shape,
            rows,
        );
        sync_cube();
        i0 += cols;
    }
    if key < t {
        #[unroll]
        for c in 0..out_width {
            let cc = p * out_width + c;
            dqkv[k0 + key * 3 * d + cc] = I::cast_from(key_acc[r * k + cc] * scale);
            dqkv[v0 + key * 3 * d + cc] = I::cast_from(value_acc[r * k + cc]);
        }
    }
}
