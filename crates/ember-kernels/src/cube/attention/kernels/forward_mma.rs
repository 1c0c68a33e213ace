//! The forward pass on tensor cores: FlashAttention-2's loop over tiles of keys, its two
//! products per tile in `cmma` fragments, the online softmax row by row.

use super::mma::*;
use super::tiled::{TiledBlock, tiled_block};
use super::*;
use crate::cube::hashed_mask::Mask;

/// Forward pass of one block of `rows` query rows of one head (`planes` planes of `fm` rows)
/// over tiles of `cols` keys: per tile the block's scores `S = Q K^T` (a plane's strip in
/// fragments), then row by row the scaled, masked scores' new maxima, the weights `P` (rounded
/// to `E`, dropped where the mask says) and the rescale of the running output, then
/// `O += P V` (fragments over the output accumulated in shared memory): five barriers a tile.
/// Each of a row's `parts` units keeps the row's maximum and its own part of the row's sum in
/// registers and rescales its own columns of the output. The queries are loaded once, rounded
/// to `E`; at the end the parts' sums meet, the output is divided by the rows' sums and each
/// row's log-sum-exp written beside it. The projection and the output are of type `I` (the
/// projection's own: `f32`, bf16 or f16), everything else `F` (`f32`).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn attention_forward_mma<F: Float, E: Float, I: Float>(
    qkv: &Tensor<I>,
    seed: &Tensor<F>,
    out: &mut Tensor<I>,
    lse: &mut Tensor<F>,
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
    let mut keys = Shared::<[E]>::new_aligned_slice(comptime!(cols * k), FRAGMENT_ALIGN);
    let mut values = Shared::<[E]>::new_aligned_slice(comptime!(cols * k), FRAGMENT_ALIGN);
    let mut scores = Shared::<[F]>::new_aligned_slice(comptime!(rows * cols), FRAGMENT_ALIGN);
    let mut weights = Shared::<[E]>::new_aligned_slice(comptime!(rows * cols), FRAGMENT_ALIGN);
    let mut acc = Shared::<[F]>::new_aligned_slice(comptime!(rows * k), FRAGMENT_ALIGN);
    let mut partial = Shared::<[F]>::new_slice(comptime!(rows * parts));

    load_rounded::<I, E>(qkv, &mut queries, q0, 3 * d, first, t, k, rows);
    #[unroll]
    for c in 0..out_width {
        acc[r * k + p * out_width + c] = F::new(0.0);
    }
    // The row's running maximum, the same in every unit of the row (each finds it from the
    // same partial maxima), and this unit's part of the row's running sum: registers, so a
    // tile needs no barrier to publish them.
    let mut row_max = F::min_value();
    let mut part_sum = F::new(0.0);
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
        sync_cube();
        // The part's maximum of the scaled, masked scores (keys after the row or past the
        // sequence masked).
        let mut m = F::min_value();
        #[unroll]
        for c in 0..width {
            let jj = p * width + c;
            m = F::max(
                m,
                masked::<F>(scores[r * cols + jj], scale, j0 + jj, row, t),
            );
        }
        partial[p * rows + r] = m;
        sync_cube();
        let m_new = F::max(row_max, parts_max::<F>(&partial, r, rows, parts));
        // The weights (a key's below the row's maximum by the float range's width gives 0),
        // the part's sum before dropout, and the weights the values are summed with.
        let mut sum = F::new(0.0);
        #[unroll]
        for c in 0..width {
            let jj = p * width + c;
            let w = F::exp(masked::<F>(scores[r * cols + jj], scale, j0 + jj, row, t) - m_new);
            sum += w;
            let factor = mask.factor((bh * t + row) * t + j0 + jj, dropout);
            weights[r * cols + jj] = E::cast_from(w * factor);
        }
        // This unit's columns of the running output (and its part of the sum) rescaled where
        // the row's maximum moved (once it has settled, most tiles leave every row's alone).
        let f = F::exp(row_max - m_new);
        part_sum = part_sum * f + sum;
        row_max = m_new;
        if f != F::new(1.0) {
            #[unroll]
            for c in 0..out_width {
                acc[r * k + p * out_width + c] *= f;
            }
        }
        sync_cube();
        strip_product::<F, E>(
            &weights, &values, &mut acc, cols, k, false, true, shape, rows,
        );
        sync_cube();
        j0 += cols;
    }
    // The row's sum from its parts.
    partial[p * rows + r] = part_sum;
    sync_cube();
    if row < t {
        let l = parts_sum::<F>(&partial, r, rows, parts);
        let inverse = F::new(1.0) / l;
        #[unroll]
        for c in 0..out_width {
            let cc = p * out_width + c;
            out[o0 + row * d + cc] = I::cast_from(acc[r * k + cc] * inverse);
        }
        if p == 0 {
            lse[bh * t + row] = row_max + F::ln(l);
        }
    }
}

/// Score `s` of key `j` for query `row` scaled, or the float range's minimum where the key is
/// masked (after the row, or past the sequence's `t` positions).
#[cube]
fn masked<F: Float>(s: F, scale: F, j: usize, row: usize, t: usize) -> F {
    select(j <= row && j < t, s * scale, F::min_value())
}
