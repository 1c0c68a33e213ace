//! The one-row forward pass: each unit a query row, keys and values streamed through shared memory
//! in tiles, the online softmax rescaled once per group of keys.

use super::*;
use crate::cube::hashed_mask::Mask;

/// Forward pass: one unit per query row `(b, h, i)`, a running softmax over keys `0..=i`,
/// the keys and values `tile` rows at a time through shared memory.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn attention_forward<F: Float, N: Size>(
    qkv: &Tensor<Vector<F, N>>,
    seed: &Tensor<F>,
    out: &mut Tensor<Vector<F, N>>,
    lse: &mut Tensor<F>,
    scale: f32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] k: usize,
    #[comptime] w: usize,
    #[comptime] heads: usize,
    #[comptime] dropout: bool,
    #[comptime] tile: usize,
    #[comptime] group: usize,
) {
    let t = qkv.shape(1);
    let d = heads * k;
    let at = block_of(t, k, heads);
    let i = at.r;
    let row = at.bh * t + i;
    let scale = F::cast_from(scale);
    let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);

    let mut q = zeros::<F, N>(k);
    if at.active {
        q = load_row::<F, N>(qkv, at.q0, 3 * d, i, k);
    }
    // A running maximum `m`, sum `l` and output `acc` over the keys seen so far (`m`
    // starts at the lowest float: the first group's rescale multiplies zeros by 0).
    let mut m = F::min_value();
    let mut l = F::new(0.0);
    let mut acc = zeros::<F, N>(k);
    let mut keys = Shared::<[Vector<F, N>]>::new_slice(comptime!(tile * k));
    let mut values = Shared::<[Vector<F, N>]>::new_slice(comptime!(tile * k));
    // Keys up to the block's last row; every unit runs every tile (they synchronise).
    let mut j0 = 0usize;
    while j0 < at.end {
        load_tile::<F, N>(qkv, &mut keys, at.k0, 3 * d, j0, t, k, tile);
        load_tile::<F, N>(qkv, &mut values, at.v0, 3 * d, j0, t, k, tile);
        sync_cube();
        if at.active {
            // `group` keys at a time: their scores first, then one rescale of the
            // accumulator for all of them (where one per key cost `K` multiplications
            // per key), then their weighted values. Keys past the unit's last
            // (`i`) score the lowest float, so their weights are 0.
            let n = rows_below(j0, i + 1, tile);
            let mut g0 = 0usize;
            while g0 < n {
                let mut s = Array::<F>::new(group);
                let mut m_new = m;
                #[unroll]
                for g in 0..group {
                    let score = dot_tile::<F, N>(&q, &keys, g0 + g, k, w) * scale;
                    s[g] = select(g0 + g < n, score, F::min_value());
                    m_new = F::max(m_new, s[g]);
                }
                let correction = F::exp(m - m_new);
                l *= correction;
                let correction = Vector::<F, N>::new(correction);
                #[unroll]
                for c in 0..k {
                    acc[c] *= correction;
                }
                #[unroll]
                for g in 0..group {
                    let p = F::exp(s[g] - m_new);
                    l += p;
                    let weight = p * mask.factor(row * t + j0 + g0 + g, dropout);
                    add_scaled::<F, N>(&mut acc, weight, &values, g0 + g, k);
                }
                m = m_new;
                g0 += group;
            }
        }
        sync_cube();
        j0 += tile;
    }
    if at.active {
        let o = at.o0 + i * d;
        let l_lanes = Vector::<F, N>::new(l);
        #[unroll]
        for c in 0..k {
            out[o + c] = acc[c] / l_lanes;
        }
        lse[row] = m + F::ln(l);
    }
}
