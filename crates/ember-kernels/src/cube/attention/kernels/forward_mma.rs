//! The forward pass on tensor cores: FlashAttention-2's loop over tiles of keys, its two
//! products per tile in `cmma` fragments, the online softmax in shared memory.

use super::mma::*;
use super::tiled::{TiledBlock, tiled_block};
use super::*;
use crate::cube::hashed_mask::Mask;

/// Forward pass of one block of `rows` query rows of one head (`planes` planes of `fm` rows)
/// over tiles of `cols` keys: per tile the block's scores `S = Q K^T` (a plane's strip in
/// fragments), then row by row the scaled, masked scores' new maxima, the weights `P` (rounded
/// to `E`, dropped where the mask says) and the rescale of the running output, then
/// `O += P V` (fragments over the output accumulated in shared memory). The queries are
/// loaded once, rounded to `E`; the output is divided by the rows' sums at the end and each
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
    let mut row_max = Shared::<[F]>::new_slice(rows);
    let mut row_sum = Shared::<[F]>::new_slice(rows);
    let mut correction = Shared::<[F]>::new_slice(rows);

    load_rounded::<I, E>(qkv, &mut queries, q0, 3 * d, first, t, k, rows);
    #[unroll]
    for c in 0..out_width {
        acc[r * k + p * out_width + c] = F::new(0.0);
    }
    if p == 0 {
        row_max[r] = F::min_value();
        row_sum[r] = F::new(0.0);
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
        sync_cube();
        // Scaled and masked (keys after the row or past the sequence), the part's maximum.
        let mut m = F::min_value();
        #[unroll]
        for c in 0..width {
            let jj = p * width + c;
            let j = j0 + jj;
            let s = select(
                j <= row && j < t,
                scores[r * cols + jj] * scale,
                F::min_value(),
            );
            scores[r * cols + jj] = s;
            m = F::max(m, s);
        }
        partial[p * rows + r] = m;
        sync_cube();
        let m_old = row_max[r];
        let m_new = F::max(m_old, parts_max::<F>(&partial, r, rows, parts));
        // The weights (a key's below the row's maximum by the float range's width gives
        // 0), their part's sum before dropout, and the weights the values are summed with.
        let mut sum = F::new(0.0);
        #[unroll]
        for c in 0..width {
            let jj = p * width + c;
            let w = F::exp(scores[r * cols + jj] - m_new);
            sum += w;
            let factor = mask.factor((bh * t + row) * t + j0 + jj, dropout);
            weights[r * cols + jj] = E::cast_from(w * factor);
        }
        sync_cube();
        partial[p * rows + r] = sum;
        sync_cube();
        if p == 0 {
            let f = F::exp(m_old - m_new);
            correction[r] = f;
            row_sum[r] = row_sum[r] * f + parts_sum::<F>(&partial, r, rows, parts);
            row_max[r] = m_new;
        }
        sync_cube();
        // The running output rescaled where the row's maximum moved (once the maximum has
        // settled, most tiles leave every row's alone).
        let f = correction[r];
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
    if row < t {
        let l = row_sum[r];
        let inverse = F::new(1.0) / l;
        #[unroll]
        for c in 0..out_width {
            let cc = p * out_width + c;
            out[o0 + row * d + cc] = I::cast_from(acc[r * k + cc] * inverse);
        }
        if p == 0 {
            lse[bh * t + row] = row_max[r] + F::ln(l);
        }
    }
}
