//! What the tensor-core kernels share (the block a cube takes is the register tiles'
//! [`super::tiled::tiled_block`]): the tile loads, rounded to the products' operand type `E`;
//! the products of one plane's strip of rows through CubeCL's `cmma` fragments; the row-wise
//! reductions done by the whole cube in shared memory.
//!
//! Planes `0..planes` of a cube each own `fm` rows of the cube's block (`fm` the fragments'
//! rows), so a block is `planes * fm` rows. Every product `C += A B` of a pass is split along
//! `C`'s rows by plane and along its columns in fragments of `fn` columns, summed over `A`'s
//! columns in fragments of `fk`: `A` and `B` are read from shared memory in `E` (TF32 on CUDA
//! for `f32`, f16 or bf16), `C` accumulates in `f32` and is stored back to shared memory, where
//! the softmax and the scaling are done row by row by all units of the cube (`parts` units per
//! row: the cube has `rows * parts` units, and planes past `planes` take part only there).

use super::*;
use burn_cubecl::cubecl::cmma;

/// Bytes shared memory that fragments are loaded from and stored to is aligned to (CUDA's
/// `wmma` loads and stores need 256 bits); every fragment's offset in it is a multiple of 8
/// values of 4 bytes or 16 of 2.
pub(super) const FRAGMENT_ALIGN: usize = 32;

/// Rows `r0..r0 + rows` of one head's `k` columns of `src` (row 0 at `base`, rows `stride`
/// apart) into `tile` row after row, rounded to `E`, zeros past `t`; all units of the cube
/// take part, and the caller synchronises before reading.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn load_rounded<F: Float, E: Float>(
    src: &Tensor<F>,
    tile: &mut Shared<[E]>,
    base: usize,
    stride: usize,
    r0: usize,
    t: usize,
    #[comptime] k: usize,
    #[comptime] rows: usize,
) {
    let units = CUBE_DIM_X as usize;
    let n = comptime!(rows * k);
    let mut e = UNIT_POS_X as usize;
    while e < n {
        let r = r0 + e / k;
        let mut x = E::new(0.0);
        if r < t {
            x = E::cast_from(src[base + r * stride + e % k]);
        }
        tile[e] = x;
        e += units;
    }
}

/// `c[strip rows, :] (+)= a[strip rows, :] b` for this unit's plane: `a` is `rows x inner`
/// (row-major, `inner` apart), `b` is `inner x cols`, row-major (`cols` apart) or, with
/// `b_transposed`, the transpose of a row-major `cols x inner` tile (`inner` apart); `c` is
/// `rows x cols` in `f32`, row-major, read first when `accumulate` (else the product
/// replaces it). Each plane computes its `fm` rows in fragments of `fn` columns (planes past
/// the block's rows skip it).
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn strip_product<F: Float, E: Float>(
    a: &Shared<[E]>,
    b: &Shared<[E]>,
    c: &mut Shared<[F]>,
    #[comptime] inner: usize,
    #[comptime] cols: usize,
    #[comptime] b_transposed: bool,
    #[comptime] accumulate: bool,
    #[comptime] shape: (usize, usize, usize),
    #[comptime] rows: usize,
) {
    let fm = comptime!(shape.0);
    let fn_ = comptime!(shape.1);
    let fk = comptime!(shape.2);
    let plane = (UNIT_POS_X / PLANE_DIM) as usize;
    let strip = plane * fm;
    let a_len = comptime!(rows * inner);
    let c_len = comptime!(rows * cols);
    let b_len = comptime!(inner * cols);
    // Planes past the block's rows (more units per row than a plane has per fragment row)
    // take no part; the condition is the same for a whole plane.
    if plane < comptime!(rows / fm) {
        #[unroll]
        for jn in 0..comptime!(cols / fn_) {
            let c_at = strip * cols + jn * fn_;
            let mut acc = cmma::Matrix::<F>::from_value(
                cmma::MatrixIdent::Accumulator,
                fm,
                fn_,
                fk,
                cmma::MatrixLayout::Undefined,
                F::new(0.0),
            );
            if accumulate {
                cmma::load_with_layout(
                    &mut acc,
                    &c[c_at..c_len],
                    comptime!(cols as u32),
                    cmma::MatrixLayout::RowMajor,
                );
            }
            #[unroll]
            for kk in 0..comptime!(inner / fk) {
                let a_frag = cmma::Matrix::<E>::from_slice(
                    cmma::MatrixIdent::A,
                    fm,
                    fn_,
                    fk,
                    cmma::MatrixLayout::RowMajor,
                    &a[strip * inner + kk * fk..a_len],
                    comptime!(inner as u32),
                );
                // With `b_transposed`, column `j` of the product's `B` is row `j` of the tile.
                let b_at = if b_transposed {
                    jn * fn_ * inner + kk * fk
                } else {
                    kk * fk * cols + jn * fn_
                };
                let b_frag = cmma::Matrix::<E>::from_slice(
                    cmma::MatrixIdent::B,
                    fm,
                    fn_,
                    fk,
                    comptime!(if b_transposed {
                        cmma::MatrixLayout::ColMajor
                    } else {
                        cmma::MatrixLayout::RowMajor
                    }),
                    &b[b_at..b_len],
                    comptime!((if b_transposed { inner } else { cols }) as u32),
                );
                cmma::execute(&a_frag, &b_frag, &acc, &acc);
            }
            cmma::store(
                &mut c[c_at..c_len],
                &acc,
                comptime!(cols as u32),
                cmma::MatrixLayout::RowMajor,
            );
        }
    }
}

/// The maximum over the `parts` partial values of row `r` (`partial[p * rows + r]`).
#[cube]
pub(super) fn parts_max<F: Float>(
    partial: &Shared<[F]>,
    r: usize,
    #[comptime] rows: usize,
    #[comptime] parts: usize,
) -> F {
    let mut m = F::min_value();
    #[unroll]
    for p in 0..parts {
        m = F::max(m, partial[p * rows + r]);
    }
    m
}

/// The sum over the `parts` partial values of row `r`.
#[cube]
pub(super) fn parts_sum<F: Float>(
    partial: &Shared<[F]>,
    r: usize,
    #[comptime] rows: usize,
    #[comptime] parts: usize,
) -> F {
    let mut s = F::new(0.0);
    #[unroll]
    for p in 0..parts {
        s += partial[p * rows + r];
    }
    s
}
