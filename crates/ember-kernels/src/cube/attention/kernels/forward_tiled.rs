//! The register-tiled forward pass (head sizes 32 and 64).

use super::*;
use crate::cube::hashed_mask::Mask;

use super::tiled::*;

/// Forward pass in register tiles: a cube of 64 units per block of `br` query rows of one
/// head (64, or 32 where shared memory is small), over tiles of 32 keys. The units form 8
/// row groups of `rows = br / 8` rows by 8 key groups. For each tile the cube computes the
/// block's scores `S = Q K^T`, each unit `rows` rows by 4 keys of them: per column of the
/// head one load of `rows` query values and one of 4 key values feed `4 * rows` products,
/// where the one-row kernel's load of a key's 4 values fed 4. Then the rows' new maxima
/// through shared memory, the weights `P` into shared memory, and `O += P V`, each unit
/// `rows` rows by `K / 8` columns of the output. The rows' running maximum and sum live in
/// shared memory, the block's queries too (transposed: read by column). Head sizes 32 and
/// 64 (`k` 8 or 16 vectors of 4).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn attention_forward_tiled<F: Float, N: Size>(
    qkv: &Tensor<Vector<F, N>>,
    seed: &Tensor<F>,
    out: &mut Tensor<Vector<F, N>>,
    lse: &mut Tensor<F>,
    scale: f32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] k: usize,
    #[comptime] heads: usize,
    #[comptime] dropout: bool,
    #[comptime] br: usize,
) {
    // Keys per tile; rows per unit and their vectors of 4; vectors of a key's row of
    // weights ([`swizzled`]); output vectors per unit along a row.
    let bc = comptime!(32usize);
    let rows = comptime!(br / 8);
    let rv = comptime!(br / 32);
    let wc = comptime!(br / 4);
    let cv = comptime!(k / 8);
    let t = qkv.shape(1);
    let d = heads * k;
    // This unit's rows of the block, `rg * rows..(rg + 1) * rows`; its keys of a tile,
    // `kg * 4..kg * 4 + 4`, and output columns, vectors `kg * cv..(kg + 1) * cv`.
    let TiledBlock {
        bh,
        first,
        q0,
        k0,
        v0,
        o0,
        rg,
        g: kg,
    } = tiled_block(t, k, heads, br);
    let u = UNIT_POS_X as usize;
    let scale = F::cast_from(scale);
    let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);

    let mut queries = Shared::<[Vector<F, N>]>::new_slice(comptime!(k * br));
    let mut keys = Shared::<[Vector<F, N>]>::new_slice(comptime!(k * bc));
    let mut values = Shared::<[Vector<F, N>]>::new_slice(comptime!(k * bc));
    let mut weights = Shared::<[Vector<F, N>]>::new_slice(comptime!(bc * wc));
    let mut partial = Shared::<[F]>::new_slice(comptime!(br * 8));
    let mut row_max = Shared::<[F]>::new_slice(br);
    let mut row_sum = Shared::<[F]>::new_slice(br);
    load_transposed::<F, N>(qkv, &mut queries, 0, q0, 3 * d, first, t, k, br);
    if u < br {
        row_max[u] = F::min_value();
        row_sum[u] = F::new(0.0);
    }
    let mut acc = Array::<Vector<F, N>>::new(comptime!(rows * cv));
    #[unroll]
    for x in 0..comptime!(rows * cv) {
        acc[x] = Vector::<F, N>::new(F::new(0.0));
    }
    let mut end = first + br;
    if end > t {
        end = t;
    }
    let mut j0 = 0usize;
    while j0 < end {
        load_transposed::<F, N>(qkv, &mut keys, 0, k0, 3 * d, j0, t, k, bc);
        load_tile::<F, N>(qkv, &mut values, v0, 3 * d, j0, t, k, bc);
        sync_cube();
        // Scores: s[i] holds row rg * rows + i against the unit's 4 keys.
        let mut s = Array::<Vector<F, N>>::new(rows);
        #[unroll]
        for i in 0..rows {
            s[i] = Vector::<F, N>::new(F::new(0.0));
        }
        let (a, b) = (&queries, &keys);
        tile_products::<F, N>(
            &mut s,
            a,
            0usize,
            b,
            0usize,
            rg,
            kg,
            comptime!(br / 4),
            8usize,
            k,
            rv,
        );
        // Scaled and masked (keys after the row, or past the sequence: only in tiles that
        // reach the block's first row or the sequence's end), each row's maximum over the
        // unit's 4 keys to the others.
        let masked = j0 + bc > first || j0 + bc > t;
        #[unroll]
        for i in 0..rows {
            let r = first + rg * rows + i;
            let mut row = s[i] * Vector::<F, N>::new(scale);
            if masked {
                #[unroll]
                for jj in 0..4usize {
                    let j = j0 + kg * 4 + jj;
                    row.insert(jj, select(j <= r && j < t, row.extract(jj), F::min_value()));
                }
            }
            let mut m = F::min_value();
            #[unroll]
            for jj in 0..4usize {
                m = F::max(m, row.extract(jj));
            }
            s[i] = row;
            partial[(rg * rows + i) * 8 + kg] = m;
        }
        sync_cube();
        // Each unit reads its rows' maxima over the tile (the 8 units of a row compute the
        // same), the factor that rescales what the rows accumulated, the weights (each
        // key's, `rows` of them, stored as vectors of 4 rows), and its 4 weights' sum.
        let mut m_new = Array::<F>::new(rows);
        let mut correction = Array::<F>::new(rows);
        let mut sums = Array::<F>::new(rows);
        #[unroll]
        for i in 0..rows {
            let row = rg * rows + i;
            let m_old = row_max[row];
            let mut m = m_old;
            #[unroll]
            for g in 0..8usize {
                m = F::max(m, partial[row * 8 + g]);
            }
            m_new[i] = m;
            correction[i] = F::exp(m_old - m);
            let mut p = Vector::<F, N>::new(F::new(0.0));
            #[unroll]
            for jj in 0..4usize {
                p.insert(jj, F::exp(s[i].extract(jj) - m));
            }
            sums[i] = lanes_sum::<F, N>(p, 4usize);
            if dropout {
                #[unroll]
                for jj in 0..4usize {
                    let global = (bh * t + first + row) * t + j0 + kg * 4 + jj;
                    p.insert(jj, p.extract(jj) * mask.factor(global, dropout));
                }
            }
            s[i] = p;
        }
        store_weights::<F, N>(&s, &mut weights, 0usize, rg, kg, wc, rv);
        sync_cube();
        #[unroll]
        for i in 0..rows {
            partial[(rg * rows + i) * 8 + kg] = sums[i];
        }
        sync_cube();
        // One unit per row (kg 0) keeps the running maximum and sum.
        if kg == 0 {
            #[unroll]
            for i in 0..rows {
                let row = rg * rows + i;
                let mut sum = F::new(0.0);
                #[unroll]
                for g in 0..8usize {
                    sum += partial[row * 8 + g];
                }
                row_sum[row] = row_sum[row] * correction[i] + sum;
                row_max[row] = m_new[i];
            }
        }
        // The output: rescaled, then the tile's weighted values, four keys per iteration.
        #[unroll]
        for i in 0..rows {
            let f = Vector::<F, N>::new(correction[i]);
            #[unroll]
            for x in 0..cv {
                acc[i * cv + x] *= f;
            }
        }
        for j4 in 0..comptime!(bc / 4) {
            #[unroll]
            for l in 0..4 {
                let j = j4 * 4 + l;
                let mut v = Array::<Vector<F, N>>::new(cv);
                #[unroll]
                for x in 0..cv {
                    v[x] = values[j * k + kg * cv + x];
                }
                #[unroll]
                for a in 0..rv {
                    let w = weights[swizzled(j, rg * rv + a, wc)];
                    #[unroll]
                    for i in 0..4 {
                        let p = Vector::<F, N>::new(w.extract(i));
                        #[unroll]
                        for x in 0..cv {
                            acc[(a * 4 + i) * cv + x] += p * v[x];
                        }
                    }
                }
            }
        }
        sync_cube();
        j0 += bc;
    }
    #[unroll]
    for i in 0..rows {
        let r = first + rg * rows + i;
        if r < t {
            let row = rg * rows + i;
            let l = row_sum[row];
            let inverse = Vector::<F, N>::new(F::new(1.0) / l);
            let o = o0 + r * d + kg * cv;
            #[unroll]
            for x in 0..cv {
                out[o + x] = acc[i * cv + x] * inverse;
            }
            if kg == 0 {
                lse[bh * t + r] = row_max[row] + F::ln(l);
            }
        }
    }
}
