//! The register-tiled backward pass (head sizes 32 and 64): the queries' gradient, then the keys'
//! and the values' in two launches of one kernel.

use super::*;
use crate::cube::hashed_mask::Mask;

use super::tiled::*;

/// Backward pass in register tiles, queries: a cube of 64 units per block of `br` query
/// rows of one head (64, or 32 where shared memory is small) writes `delta` and `dQ`, over
/// tiles of 32 keys up to the block's last row. The units form 8 row groups of
/// `rows = br / 8` rows by 8 key groups. Per tile: `S = Q K^T` and `dP = dO V^T`, each unit
/// `rows` rows by 4 keys, from the block's queries and output gradients and the tile's keys
/// and values, all in shared memory transposed; `dS = P (dP - delta)` into shared memory in
/// place of the values; then `dQ += dS K`, each unit `rows` rows by `K / 8` columns. Head
/// sizes 32 and 64.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn attention_backward_query_tiled<F: Float, N: Size>(
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
    #[comptime] heads: usize,
    #[comptime] dropout: bool,
    #[comptime] br: usize,
) {
    // Keys per tile; rows per unit and their vectors of 4; vectors of a tile's row of
    // weights; output columns per unit; one tile's vectors (transposed keys or values, or
    // the weights).
    let bc = comptime!(32usize);
    let rows = comptime!(br / 8);
    let rv = comptime!(br / 32);
    let wc = comptime!(br / 4);
    let cw = comptime!(k / 2);
    let tile = comptime!(crate::cube::attention::dims::tile_vectors(k, br));
    let t = qkv.shape(1);
    let d = heads * k;
    // This unit's rows of the block, `rg * rows..(rg + 1) * rows`; its keys of a tile,
    // `kg * 4..kg * 4 + 4`, and its output columns `kg * cw..(kg + 1) * cw`.
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
    let scale = F::cast_from(scale);
    let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);

    let mut block_queries = Shared::<[Vector<F, N>]>::new_slice(comptime!(k * br));
    let mut block_grads = Shared::<[Vector<F, N>]>::new_slice(comptime!(k * br));
    let mut tiles = Shared::<[Vector<F, N>]>::new_slice(comptime!(2 * tile));
    load_transposed::<F, N>(qkv, &mut block_queries, 0, q0, 3 * d, first, t, k, br);
    load_transposed::<F, N>(grad, &mut block_grads, 0, o0, d, first, t, k, br);
    // delta_r = dO_r . O_r: each unit over its columns of its rows, the 8 parts of a row
    // summed through the tiles' memory (not in use yet).
    #[unroll]
    for i in 0..rows {
        let r = first + rg * rows + i;
        let mut part = F::new(0.0);
        if r < t {
            #[unroll]
            for x in 0..comptime!(cw / 4) {
                let at = o0 + r * d + kg * comptime!(cw / 4) + x;
                part += lanes_sum::<F, N>(grad[at] * out[at], 4usize);
            }
        }
        tiles[(rg * rows + i) * 8 + kg] = Vector::<F, N>::new(part);
    }
    sync_cube();
    let mut di = Array::<F>::new(rows);
    let mut li = Array::<F>::new(rows);
    #[unroll]
    for i in 0..rows {
        let row = rg * rows + i;
        let r = first + row;
        let mut sum = F::new(0.0);
        #[unroll]
        for g in 0..8usize {
            sum += tiles[row * 8 + g].extract(0usize);
        }
        di[i] = sum;
        li[i] = F::new(0.0);
        if r < t {
            li[i] = lse[bh * t + r];
            if kg == 0 {
                delta[bh * t + r] = sum;
            }
        }
    }
    sync_cube();
    let mut acc = Array::<F>::new(comptime!(rows * cw));
    #[unroll]
    for x in 0..comptime!(rows * cw) {
        acc[x] = F::new(0.0);
    }
    let mut end = first + br;
    if end > t {
        end = t;
    }
    let mut j0 = 0usize;
    while j0 < end {
        load_transposed::<F, N>(qkv, &mut tiles, 0, k0, 3 * d, j0, t, k, bc);
        load_transposed::<F, N>(qkv, &mut tiles, tile, v0, 3 * d, j0, t, k, bc);
        sync_cube();
        let mut s = Array::<Vector<F, N>>::new(rows);
        let mut dp = Array::<Vector<F, N>>::new(rows);
        #[unroll]
        for i in 0..rows {
            s[i] = Vector::<F, N>::new(F::new(0.0));
            dp[i] = Vector::<F, N>::new(F::new(0.0));
        }
        let (a, b) = (&block_queries, &tiles);
        tile_products::<F, N>(&mut s, a, 0usize, b, 0usize, rg, kg, wc, 8usize, k, rv);
        let a = &block_grads;
        tile_products::<F, N>(&mut dp, a, 0usize, b, tile, rg, kg, wc, 8usize, k, rv);
        // dS = P (dP (factors) - delta), P masked (keys after the row or past the
        // sequence, only in tiles that reach the block's first row or the sequence's end).
        let masked = j0 + bc > first || j0 + bc > t;
        #[unroll]
        for i in 0..rows {
            let r = first + rg * rows + i;
            let mut p = Vector::<F, N>::new(F::new(0.0));
            #[unroll]
            for jj in 0..4usize {
                p.insert(jj, F::exp(s[i].extract(jj) * scale - li[i]));
            }
            if masked {
                #[unroll]
                for jj in 0..4usize {
                    let j = j0 + kg * 4 + jj;
                    p.insert(jj, select(j <= r && j < t, p.extract(jj), F::new(0.0)));
                }
            }
            let mut factor = Vector::<F, N>::new(F::new(1.0));
            if dropout {
                #[unroll]
                for jj in 0..4usize {
                    let j = j0 + kg * 4 + jj;
                    factor.insert(jj, mask.factor((bh * t + r) * t + j, dropout));
                }
            }
            s[i] = p * (dp[i] * factor - Vector::<F, N>::new(di[i]));
        }
        // Every unit has read the values the weights replace.
        sync_cube();
        store_weights::<F, N>(&s, &mut tiles, tile, rg, kg, wc, rv);
        sync_cube();
        // dQ += dS K.
        accumulate_tile::<F, N>(&mut acc, &tiles, tile, 0usize, rg, kg, wc, cw, rv);
        sync_cube();
        j0 += bc;
    }
    let rows_at = first + rg * rows;
    write_gradient::<F, N>(&acc, dqkv, q0, rows_at, t, kg, scale, d, cw, rows);
}

/// Backward pass in register tiles, keys or values (`#[comptime] values`): a cube of 64
/// units per block of `br` keys of one head (64, or 32 where shared memory is small), over
/// tiles of 32 queries from the block's first key on (after
/// [`attention_backward_query`], which writes `delta`). The units form 8 key groups of
/// `rows = br / 8` keys by 8 query groups. For each tile: `S^T = K Q^T` (and for the keys
/// `dP^T = V dO^T`), each unit `rows` keys by 4 queries, from the block's keys (and values)
/// and the tile's queries and output gradients, all in shared memory transposed; the
/// weights `P^T` (values) or `dS^T = P^T (dP^T - delta)` (keys) into shared memory; then
/// `dV += P^T dO` or `dK += dS^T Q`, each unit `rows` keys by `K / 8` columns, reading the
/// tile transposed (4 queries of a column at once). The weights take the place of the tile
/// the accumulation does not read. Head sizes 32 and 64.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn attention_backward_key_value_tiled<F: Float, N: Size>(
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
    #[comptime] heads: usize,
    #[comptime] dropout: bool,
    #[comptime] values: bool,
    #[comptime] br: usize,
) {
    // Queries per tile; keys per unit and their vectors of 4; vectors of a tile's row of
    // weights; output columns per unit; one tile's vectors in shared memory (transposed
    // queries or output gradients, or the weights).
    let bc = comptime!(32usize);
    let rows = comptime!(br / 8);
    let rv = comptime!(br / 32);
    let wc = comptime!(br / 4);
    let cw = comptime!(k / 2);
    let tile = comptime!(crate::cube::attention::dims::tile_vectors(k, br));
    let t = qkv.shape(1);
    let d = heads * k;
    // This unit's keys of the block, `rg * rows..(rg + 1) * rows`; its queries of a tile,
    // `qg * 4..qg * 4 + 4`, and its output columns `qg * cw..(qg + 1) * cw`.
    let TiledBlock {
        bh,
        first,
        q0,
        k0,
        v0,
        o0,
        rg,
        g: qg,
    } = tiled_block(t, k, heads, br);
    let scale = F::cast_from(scale);
    let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);
    // Tiles: the queries at 0, the output gradients at `tile`; the weights where the
    // accumulation does not read (the queries' place for the values, the gradients' for
    // the keys).
    let w_at = comptime!(if values { 0 } else { tile });
    let t_at = comptime!(if values { tile } else { 0 });

    let mut block_keys = Shared::<[Vector<F, N>]>::new_slice(comptime!(k * br));
    let mut block_values =
        Shared::<[Vector<F, N>]>::new_slice(comptime!(if values { 1 } else { k * br }));
    let mut tiles = Shared::<[Vector<F, N>]>::new_slice(comptime!(2 * tile));
    load_transposed::<F, N>(qkv, &mut block_keys, 0, k0, 3 * d, first, t, k, br);
    if !values {
        load_transposed::<F, N>(qkv, &mut block_values, 0, v0, 3 * d, first, t, k, br);
    }
    let mut acc = Array::<F>::new(comptime!(rows * cw));
    #[unroll]
    for x in 0..comptime!(rows * cw) {
        acc[x] = F::new(0.0);
    }
    // Queries before the block's first key see none of its keys.
    let mut i0 = first;
    while i0 < t {
        load_transposed::<F, N>(qkv, &mut tiles, 0, q0, 3 * d, i0, t, k, bc);
        load_transposed::<F, N>(grad, &mut tiles, tile, o0, d, i0, t, k, bc);
        // The unit's 4 queries' log-sum-exps and deltas (0 past the sequence).
        let mut lq = Vector::<F, N>::new(F::new(0.0));
        let mut dq = Vector::<F, N>::new(F::new(0.0));
        #[unroll]
        for jj in 0..4usize {
            let q = i0 + qg * 4 + jj;
            if q < t {
                lq.insert(jj, lse[bh * t + q]);
                if !values {
                    dq.insert(jj, delta[bh * t + q]);
                }
            }
        }
        sync_cube();
        // s[i]: key rg * rows + i against the unit's 4 queries; for the keys, dp[i] the
        // same of `dP^T`.
        let mut s = Array::<Vector<F, N>>::new(rows);
        let mut dp = Array::<Vector<F, N>>::new(comptime!(if values { 1 } else { rows }));
        #[unroll]
        for i in 0..rows {
            s[i] = Vector::<F, N>::new(F::new(0.0));
            if !values {
                dp[i] = Vector::<F, N>::new(F::new(0.0));
            }
        }
        tile_products::<F, N>(
            &mut s,
            &block_keys,
            0usize,
            &tiles,
            0usize,
            rg,
            qg,
            wc,
            8usize,
            k,
            rv,
        );
        if !values {
            let (a, b) = (&block_values, &tiles);
            tile_products::<F, N>(&mut dp, a, 0usize, b, tile, rg, qg, wc, 8usize, k, rv);
        }
        // The weights: P^T (masked: queries before the key or past the sequence, only in
        // tiles that reach the block's first key or the sequence's end), with dropout's
        // factors for dV; for dK, dS^T = P^T (dP^T (factors) - delta).
        let masked = i0 < first + br || i0 + bc > t;
        #[unroll]
        for i in 0..rows {
            let j = first + rg * rows + i;
            let mut p = Vector::<F, N>::new(F::new(0.0));
            #[unroll]
            for jj in 0..4usize {
                p.insert(jj, F::exp(s[i].extract(jj) * scale - lq.extract(jj)));
            }
            if masked {
                #[unroll]
                for jj in 0..4usize {
                    let q = i0 + qg * 4 + jj;
                    p.insert(jj, select(q >= j && q < t, p.extract(jj), F::new(0.0)));
                }
            }
            let mut factor = Vector::<F, N>::new(F::new(1.0));
            if dropout {
                #[unroll]
                for jj in 0..4usize {
                    let q = i0 + qg * 4 + jj;
                    factor.insert(jj, mask.factor((bh * t + q) * t + j, dropout));
                }
            }
            if values {
                s[i] = p * factor;
            } else {
                s[i] = p * (dp[i] * factor - dq);
            }
        }
        // Every unit has read the tile the weights replace.
        sync_cube();
        store_weights::<F, N>(&s, &mut tiles, w_at, rg, qg, wc, rv);
        sync_cube();
        // dV += P^T dO or dK += dS^T Q.
        accumulate_tile::<F, N>(&mut acc, &tiles, w_at, t_at, rg, qg, wc, cw, rv);
        sync_cube();
        i0 += bc;
    }
    let rows_at = first + rg * rows;
    if values {
        let one = F::new(1.0);
        write_gradient::<F, N>(&acc, dqkv, v0, rows_at, t, qg, one, d, cw, rows);
    } else {
        write_gradient::<F, N>(&acc, dqkv, k0, rows_at, t, qg, scale, d, cw, rows);
    }
}
