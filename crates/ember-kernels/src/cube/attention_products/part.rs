//! The products' operands and outputs: [`Part`], one matrix per sequence of a contiguous
//! `[B, R, W]` tensor where it lies (a block of its rows and columns, read transposed or not),
//! and [`product`], the strided batched product of two of them written into a third.

use super::super::attention::{float_cast_to, wide};
use crate::blas::{Batched, Layout, Strided};
use burn::backend::TensorMetadata;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::Slice;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

/// One matrix per sequence from sequence `first` on: rows `row..row + rows` and columns
/// `col..col + cols` of a contiguous `[B, R, W]` tensor (`[rows, cols]` each), read transposed
/// where `transposed`.
#[derive(Clone, Copy)]
pub(super) struct Part<'a> {
    pub(super) x: &'a CubeTensor,
    pub(super) first: usize,
    pub(super) row: usize,
    pub(super) rows: usize,
    pub(super) col: usize,
    pub(super) cols: usize,
    pub(super) transposed: bool,
}

impl<'a> Part<'a> {
    /// Columns `col..col + cols` of every row.
    pub(super) fn cols(x: &'a CubeTensor, col: usize, cols: usize) -> Self {
        Part {
            x,
            first: 0,
            row: 0,
            rows: x.shape()[1],
            col,
            cols,
            transposed: false,
        }
    }

    /// From sequence `first` on.
    pub(super) fn from(self, first: usize) -> Self {
        Part { first, ..self }
    }

    /// Rows `start..end` of the tensor (before any transposition).
    pub(super) fn rows(self, start: usize, end: usize) -> Self {
        Part {
            row: start,
            rows: end - start,
            ..self
        }
    }

    /// Read transposed.
    pub(super) fn t(self) -> Self {
        Part {
            transposed: !self.transposed,
            ..self
        }
    }

    /// `[B, R, W]`.
    pub(super) fn dims(&self) -> [usize; 3] {
        self.x.shape().dims::<3>()
    }

    /// Rows and columns of the matrix as read.
    pub(super) fn read_shape(&self) -> [usize; 2] {
        match self.transposed {
            false => [self.rows, self.cols],
            true => [self.cols, self.rows],
        }
    }

    /// Whether `n` sequences of it lie inside its tensor.
    fn fits(&self, n: usize) -> bool {
        let [batch, rows, width] = self.dims();
        self.first + n <= batch && self.row + self.rows <= rows && self.col + self.cols <= width
    }

    /// Where its matrices lie in the buffer: row-major with rows `W` apart (column-major when
    /// read transposed), sequences `R W` apart.
    fn strided(&self) -> Strided {
        let [_, rows, width] = self.dims();
        Strided {
            offset: (self.first * rows + self.row) * width + self.col,
            stride: rows * width,
            layout: match self.transposed {
                false => Layout::RowMajor { ld: width },
                true => Layout::ColMajor { ld: width },
            },
        }
    }

    /// Its `n` sequences as Burn's tensor `[n, rows, cols]` as read, in `f32`.
    fn view(&self, n: usize) -> CubeTensor {
        type Ops = CubeBackend;
        let x = <Ops as FloatTensorOps<Ops>>::float_slice(
            self.x.clone(),
            &[
                Slice::from(self.first..self.first + n),
                Slice::from(self.row..self.row + self.rows),
                Slice::from(self.col..self.col + self.cols),
            ],
        );
        let x = match self.transposed {
            true => <Ops as FloatTensorOps<Ops>>::float_swap_dims(x, 1, 2),
            false => x,
        };
        wide::<Ops>(x)
    }
}

/// Where a product's matrices go: from sequence `first` on, rows and columns from `row` and
/// `col` on.
pub(super) type At = (usize, usize, usize);

/// The output of `n` sequences of `a @ b` at `at` in `out`, checked against the operands'
/// shapes and the tensors' bounds.
fn output<'a>(
    n: usize,
    a: &Part,
    b: &Part,
    out: &'a CubeTensor,
    (first, row, col): At,
) -> Part<'a> {
    let ([m, k], [k_b, cols]) = (a.read_shape(), b.read_shape());
    let c = Part::cols(out, col, cols).from(first).rows(row, row + m);
    assert!(
        k == k_b && c.fits(n),
        "attention products: {n} x [{m}, {k}] @ [{k_b}, {cols}] into rows {row}.. and \
         columns {col}.. of sequences {first}.. of {:?}",
        out.shape()
    );
    assert!(
        a.fits(n) && b.fits(n),
        "attention products: {n} sequences past an operand"
    );
    c
}

/// The strided batched call of `out[first + s, row.., col..] = a_s @ b_s` for `n` sequences
/// `s`, `out` a contiguous `[B, R, W]` tensor.
#[cfg_attr(not(feature = "cublas"), allow(dead_code))] // cuBLAS's, and the tests'
pub(super) fn call(n: usize, a: Part, b: Part, out: &CubeTensor, at: At) -> Batched {
    let c = output(n, &a, &b, out, at);
    let ([m, k], [_, cols]) = (a.read_shape(), b.read_shape());
    Batched::new([m, k, cols], a.strided(), b.strided(), c.strided(), n)
        .expect("a row-major output is a BLAS output")
}

/// `out` with `alpha a_s @ b_s` written into rows `row..` and columns `col..` of its sequence
/// `first + s`, for `n` sequences `s`: by one cuBLAS call in place where cuBLAS takes it, else
/// by Burn's `matmul` and `slice_assign`. `a` and `b` are of one type, `out` of theirs or
/// `f32`; the products of bf16 or f16 operands accumulate in `f32` (Burn's on operands widened
/// exactly), rounded once to `out`'s type.
pub(super) fn product(
    n: usize,
    a: Part,
    b: Part,
    alpha: f32,
    out: CubeTensor,
    at: At,
) -> CubeTensor {
    #[cfg(feature = "cublas")]
    if crate::products::cublas::batched_product(&call(n, a, b, &out, at), [a.x, b.x, &out], alpha) {
        return out;
    }
    type Ops = CubeBackend;
    let c = output(n, &a, &b, &out, at);
    let ranges = [
        Slice::from(c.first..c.first + n),
        Slice::from(c.row..c.row + c.rows),
        Slice::from(c.col..c.col + c.cols),
    ];
    let mut product = <Ops as FloatTensorOps<Ops>>::float_matmul(a.view(n), b.view(n));
    if alpha != 1.0 {
        product = <Ops as FloatTensorOps<Ops>>::float_mul_scalar(product, alpha.into());
    }
    let product = float_cast_to::<Ops>(product, out.dtype());
    <Ops as FloatTensorOps<Ops>>::float_slice_assign(out, &ranges, product)
}
