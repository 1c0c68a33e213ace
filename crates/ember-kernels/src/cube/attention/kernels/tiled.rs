//! What the register-tiled kernels share: the block of rows of a cube of 64 units (8 row groups by
//! 8 column groups), transposed loads into shared memory, the products of a tile, the running
//! output's accumulation, the weights' store and the gradient's write.

use super::*;

/// Where a cube of the register-tiled kernels reads and writes: the head's index among all
/// sequences' heads `bh = b * H + h`, the block's first row, the offsets (in vectors) of
/// row 0 of the head's Q, K and V columns in `[B, T, 3D]` and of its columns in `[B, T, D]`,
/// and the unit's row group `rg` and column group `g` (8 by 8 units).
#[derive(CubeType, Clone, Copy)]
pub(super) struct TiledBlock {
    pub(super) bh: usize,
    pub(super) first: usize,
    pub(super) q0: usize,
    pub(super) k0: usize,
    pub(super) v0: usize,
    pub(super) o0: usize,
    pub(super) rg: usize,
    pub(super) g: usize,
}

#[cube]
pub(super) fn tiled_block(
    t: usize,
    #[comptime] k: usize,
    #[comptime] heads: usize,
    #[comptime] br: usize,
) -> TiledBlock {
    let d = heads * k;
    let bh = CUBE_POS_Y as usize;
    let h = bh % heads;
    let b = bh / heads;
    let q0 = b * t * 3 * d + h * k;
    let u = UNIT_POS_X as usize;
    TiledBlock {
        bh,
        first: CUBE_POS_X as usize * br,
        q0,
        k0: q0 + d,
        v0: q0 + 2 * d,
        o0: b * t * d + h * k,
        rg: u / 8,
        g: u % 8,
    }
}

/// Rows `r0..r0 + rows` of one head's `k` vectors of `src` (row 0 at `base`, rows `stride`
/// apart, zeros for rows past `t`) into `tile` from vector `at` on, transposed: vector
/// `at + c * rows / 4 + r / 4` holds column `c` of rows `r..r + 4` (`r` a multiple of 4), so that a unit
/// reads 4 rows' values of one column at once. Each unit moves blocks of 4 rows by 4
/// columns (four loads, a transpose in registers, four stores); consecutive units read
/// consecutive vectors of a row. Vectors of 4 lanes only.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn load_transposed<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    tile: &mut Shared<[Vector<F, N>]>,
    at: usize,
    base: usize,
    stride: usize,
    r0: usize,
    t: usize,
    #[comptime] k: usize,
    #[comptime] rows: usize,
) {
    let units = CUBE_DIM_X as usize;
    let blocks = comptime!(rows / 4 * k);
    let mut e = UNIT_POS_X as usize;
    while e < blocks {
        let cv = e % k;
        let rb = e / k;
        let mut block = Array::<Vector<F, N>>::new(4usize);
        #[unroll]
        for l in 0..4 {
            let r = r0 + rb * 4 + l;
            let mut x = Vector::<F, N>::new(F::new(0.0));
            if r < t {
                x = src[base + r * stride + cv];
            }
            block[l] = x;
        }
        #[unroll]
        for c in 0..4 {
            let mut column = Vector::<F, N>::new(F::new(0.0));
            #[unroll]
            for l in 0..4 {
                column.insert(l, block[l].extract(c));
            }
            tile[at + (cv * 4 + c) * comptime!(rows / 4) + rb] = column;
        }
        e += units;
    }
}

/// `s[a * 4 + i] += A_r . B_g` over the head's `4 k` columns: the register tile of one
/// unit, rows `r = rg * rv * 4 + a * 4 + i` of `A` (`4 rv` of them) against the 4 rows of
/// `B` of group `g`; both read transposed from shared memory (`A`'s vector `c * a_cols + r
/// / 4` at `a_at`, `B`'s `c * b_cols + g` at `b_at`: 4 rows' values of column `c`), so one
/// load of each feeds `16 rv` products. Four columns per iteration, unrolled (the loop's
/// own instructions were a fifth of a column's 40).
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn tile_products<F: Float, N: Size>(
    s: &mut Array<Vector<F, N>>,
    a: &Shared<[Vector<F, N>]>,
    a_at: usize,
    b: &Shared<[Vector<F, N>]>,
    b_at: usize,
    rg: usize,
    g: usize,
    #[comptime] a_cols: usize,
    #[comptime] b_cols: usize,
    #[comptime] k: usize,
    #[comptime] rv: usize,
) {
    for c4 in 0..k {
        #[unroll]
        for l in 0..4 {
            let c = c4 * 4 + l;
            let bv = b[b_at + c * b_cols + g];
            #[unroll]
            for x in 0..rv {
                let av = a[a_at + c * a_cols + rg * rv + x];
                #[unroll]
                for i in 0..4 {
                    s[x * 4 + i] += Vector::<F, N>::new(av.extract(i)) * bv;
                }
            }
        }
    }
}

/// `acc[r][cc] += sum_j W[j][r] T[j][c]` over a tile's 32 rows `j`, for the unit's `4 rv`
/// rows `r` (vector `rg * rv + x` of a row of weights) and its `cw` columns
/// `c = g * cw + cc`: the weights `W` at `w_at` (rows of `wc` vectors, [`swizzled`]), the
/// tile `T` transposed at `t_at` (vector `c * 8 + j / 4`: 4 rows' values of column `c`).
/// Four rows `j` at a time: `4 rv` loads of weights and `cw` of the tile feed `16 rv cw`
/// products.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn accumulate_tile<F: Float, N: Size>(
    acc: &mut Array<F>,
    tiles: &Shared<[Vector<F, N>]>,
    w_at: usize,
    t_at: usize,
    rg: usize,
    g: usize,
    #[comptime] wc: usize,
    #[comptime] cw: usize,
    #[comptime] rv: usize,
) {
    for j4 in 0..8usize {
        let mut w = Array::<Vector<F, N>>::new(comptime!(4 * rv));
        #[unroll]
        for l in 0..4usize {
            #[unroll]
            for x in 0..rv {
                w[l * rv + x] = tiles[w_at + swizzled(j4 * 4 + l, rg * rv + x, wc)];
            }
        }
        #[unroll]
        for cc in 0..cw {
            let c = g * cw + cc;
            let tv = tiles[t_at + c * 8 + j4];
            #[unroll]
            for x in 0..rv {
                #[unroll]
                for i in 0..4usize {
                    let mut sum = acc[(x * 4 + i) * cw + cc];
                    #[unroll]
                    for l in 0..4usize {
                        sum += w[l * rv + x].extract(i) * tv.extract(l);
                    }
                    acc[(x * 4 + i) * cw + cc] = sum;
                }
            }
        }
    }
}

/// Writes a unit's register tile `s` (`4 rv` rows by its 4 columns `g * 4..g * 4 + 4`) into
/// the weights at `w_at` transposed: row `j = g * 4 + jj` of the weights holds the unit's
/// rows as vectors `rg * rv + x` ([`swizzled`]).
#[cube]
pub(super) fn store_weights<F: Float, N: Size>(
    s: &Array<Vector<F, N>>,
    tiles: &mut Shared<[Vector<F, N>]>,
    w_at: usize,
    rg: usize,
    g: usize,
    #[comptime] wc: usize,
    #[comptime] rv: usize,
) {
    #[unroll]
    for jj in 0..4usize {
        #[unroll]
        for x in 0..rv {
            let mut w = Vector::<F, N>::new(F::new(0.0));
            #[unroll]
            for i in 0..4usize {
                w.insert(i, s[x * 4 + i].extract(jj));
            }
            tiles[w_at + swizzled(g * 4 + jj, rg * rv + x, wc)] = w;
        }
    }
}

/// A unit's `rows` rows of a gradient (`acc`, `cw` columns per row) times `factor` into
/// its columns `g * cw..(g + 1) * cw` of rows `r0..r0 + rows` (below `t`) of `dqkv`
/// `[B, T, 3D]`, row 0 of the head's Q, K or V columns at `at`.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn write_gradient<F: Float, N: Size>(
    acc: &Array<F>,
    dqkv: &mut Tensor<Vector<F, N>>,
    at: usize,
    r0: usize,
    t: usize,
    g: usize,
    factor: F,
    d: usize,
    #[comptime] cw: usize,
    #[comptime] rows: usize,
) {
    let factor = Vector::<F, N>::new(factor);
    #[unroll]
    for i in 0..rows {
        let r = r0 + i;
        if r < t {
            #[unroll]
            for x in 0..comptime!(cw / 4) {
                let mut o = Vector::<F, N>::new(F::new(0.0));
                #[unroll]
                for l in 0..4usize {
                    o.insert(l, acc[i * cw + x * 4 + l]);
                }
                dqkv[at + r * 3 * d + g * comptime!(cw / 4) + x] = o * factor;
            }
        }
    }
}

/// Where vector `col` of row `j` of a tile's weights lives (rows of `cols` vectors; row `j`
/// is one of the tile's 32 rows, each vector 4 of the block's rows): `col` XOR-ed with
/// `j / 4`, the column group of the unit that writes it, so that the 8 units of a
/// quarter-warp, which write one vector column of 8 groups' rows, reach 8 different banks.
#[cube]
pub(super) fn swizzled(j: usize, col: usize, #[comptime] cols: usize) -> usize {
    j * cols + (col ^ ((j / 4) % 8))
}
