//! A row-major matrix product as a column-major BLAS call (`gemm`), for a vendor's library
//! (cuBLAS, `products/cublas`).
//!
//! BLAS reads a matrix column by column: element `(i, j)` of an operand with leading dimension
//! `ld` sits at `i + j * ld`. Burn's tensors are row-major, or a transposed view of a row-major
//! tensor (the tied output head's `x @ wte^T`, a weight gradient's `x^T @ dy`). A row-major `C =
//! A B` is the column-major `C^T = B^T A^T`, and a row-major `[R, C]` operand with row stride `s`
//! read column by column with `ld = s` is its own transpose `[C, R]`; so the call takes `B` first
//! and `A` second, each transposed by BLAS exactly when it is a transposed (column-major) view,
//! and no operand is copied. [`Gemm::reference`] computes what BLAS computes for a call, so the
//! mapping is checked without a GPU.

/// How a 2-D operand `[rows, cols]` lies in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Element `(i, j)` at `i * ld + j` (`ld >= cols`).
    RowMajor { ld: usize },
    /// Element `(i, j)` at `i + j * ld` (`ld >= rows`): a transposed view of a row-major tensor.
    ColMajor { ld: usize },
}

impl Layout {
    /// The layout of a `[rows, cols]` operand with `strides` (in elements), or `None` when it is
    /// neither (a copy first). Dimensions of one element take any stride.
    pub fn of(shape: [usize; 2], strides: [usize; 2]) -> Option<Layout> {
        let [rows, cols] = shape;
        if strides[1] == 1 || cols == 1 {
            let ld = if rows == 1 { cols.max(1) } else { strides[0] };
            if ld >= cols.max(1) {
                return Some(Layout::RowMajor { ld });
            }
        }
        if strides[0] == 1 || rows == 1 {
            let ld = if cols == 1 { rows.max(1) } else { strides[1] };
            if ld >= rows.max(1) {
                return Some(Layout::ColMajor { ld });
            }
        }
        None
    }
}

/// One column-major `gemm` call: `C = op(first) op(second)` with `C` `[m, n]` column-major of
/// leading dimension `ldc`; `op` transposes where `transpose_*` is set (`CUBLAS_OP_T`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    /// `transa`: the first operand is read transposed.
    pub transpose_first: bool,
    /// `transb`: the second operand is read transposed.
    pub transpose_second: bool,
    /// Rows of `C` and of `op(first)`.
    pub m: usize,
    /// Columns of `C` and of `op(second)`.
    pub n: usize,
    /// The reduction: columns of `op(first)`, rows of `op(second)`.
    pub k: usize,
    /// `lda`: the first operand's leading dimension, as stored.
    pub ld_first: usize,
    /// `ldb`: the second operand's leading dimension, as stored.
    pub ld_second: usize,
    /// `ldc`: the output's leading dimension.
    pub ldc: usize,
}

impl Gemm {
    /// The call for the row-major product `[M, N] = a [M, K] @ b [K, N]` into a contiguous
    /// row-major output: `first` is `b`, `second` is `a`.
    pub fn row_major(m: usize, k: usize, n: usize, a: Layout, b: Layout) -> Gemm {
        let (transpose_first, ld_first) = match b {
            Layout::RowMajor { ld } => (false, ld),
            Layout::ColMajor { ld } => (true, ld),
        };
        let (transpose_second, ld_second) = match a {
            Layout::RowMajor { ld } => (false, ld),
            Layout::ColMajor { ld } => (true, ld),
        };
        Gemm {
            transpose_first,
            transpose_second,
            m: n,
            n: m,
            k,
            ld_first,
            ld_second,
            ldc: n.max(1),
        }
    }

    /// What BLAS computes for this call, on the host (`f64` sums): `c` column-major.
    pub fn reference(&self, first: &[f32], second: &[f32], c: &mut [f32]) {
        let at = |data: &[f32], transposed: bool, ld: usize, i: usize, j: usize| match transposed {
            false => data[i + j * ld],
            true => data[j + i * ld],
        };
        for j in 0..self.n {
            for i in 0..self.m {
                let mut sum = 0f64;
                for p in 0..self.k {
                    let x = at(first, self.transpose_first, self.ld_first, i, p);
                    let y = at(second, self.transpose_second, self.ld_second, p, j);
                    sum += x as f64 * y as f64;
                }
                c[i + j * self.ldc] = sum as f32;
            }
        }
    }
}

/// Where each matrix of a batch lies in its buffer: matrix `i` from element `offset + i * stride`,
/// laid out as `layout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    pub offset: usize,
    pub stride: usize,
    pub layout: Layout,
}

/// A strided batched call (`gemmStridedBatched`): for each `i < batch`, the row-major product
/// `c_i = a_i @ b_i` (`[M, K] @ [K, N]`), `c_i` row-major with its own row stride, written in
/// place into `c`'s buffer. As in [`Gemm::row_major`], BLAS's first operand is `b` and its second
/// `a`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batched {
    pub gemm: Gemm,
    pub a: Strided,
    pub b: Strided,
    pub c: Strided,
    pub batch: usize,
}

impl Batched {
    /// The call for `[m, k, n]` products of `a`'s and `b`'s matrices into `c`'s, or `None`
    /// where `c` is not row-major (BLAS writes its output column-major: a row-major one only).
    pub fn new(
        [m, k, n]: [usize; 3],
        a: Strided,
        b: Strided,
        c: Strided,
        batch: usize,
    ) -> Option<Self> {
        let Layout::RowMajor { ld: ldc } = c.layout else {
            return None;
        };
        let gemm = Gemm {
            ldc,
            ..Gemm::row_major(m, k, n, a.layout, b.layout)
        };
        Some(Batched {
            gemm,
            a,
            b,
            c,
            batch,
        })
    }

    /// What BLAS computes for this call with `alpha` (and `beta = 0`), on the host: every
    /// matrix of the batch written into `c`, nothing else of it touched.
    pub fn reference(&self, a: &[f32], b: &[f32], c: &mut [f32], alpha: f32) {
        let g = &self.gemm;
        for i in 0..self.batch {
            let first = &b[self.b.offset + i * self.b.stride..];
            let second = &a[self.a.offset + i * self.a.stride..];
            let out = &mut c[self.c.offset + i * self.c.stride..];
            g.reference(first, second, out);
            for col in 0..g.n {
                for row in 0..g.m {
                    out[row + col * g.ldc] *= alpha;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Gemm, Layout};

    /// A `[rows, cols]` matrix stored in `layout` (with padding past each row or column), with
    /// its values row-major.
    fn stored(
        rows: usize,
        cols: usize,
        transposed: bool,
        pad: usize,
        seed: u32,
    ) -> (Vec<f32>, Vec<f32>, [usize; 2]) {
        let value = |i: usize, j: usize| ((i * 31 + j * 17 + seed as usize) % 23) as f32 - 11.0;
        let values: Vec<f32> = (0..rows * cols)
            .map(|x| value(x / cols, x % cols))
            .collect();
        let (ld, strides) = match transposed {
            false => (cols + pad, [cols + pad, 1]),
            true => (rows + pad, [1, rows + pad]),
        };
        let outer = if transposed { cols } else { rows };
        let mut data = vec![f32::NAN; ld * outer];
        for i in 0..rows {
            for j in 0..cols {
                let at = if transposed { i + j * ld } else { i * ld + j };
                data[at] = values[i * cols + j];
            }
        }
        (data, values, strides)
    }

    /// Row-major, column-major and padded operands of several shapes (ones included): the
    /// call's result, read row-major, is the product of the operands' values.
    #[test]
    fn the_call_computes_the_row_major_product() {
        let shapes = [
            (3, 4, 5),
            (1, 7, 2),
            (6, 1, 3),
            (2, 5, 1),
            (1, 1, 1),
            (4, 3, 4),
        ];
        for (m, k, n) in shapes {
            for (ta, tb, pad) in [
                (false, false, 0),
                (true, false, 0),
                (false, true, 2),
                (true, true, 1),
            ] {
                let (a, av, a_strides) = stored(m, k, ta, pad, 1);
                let (b, bv, b_strides) = stored(k, n, tb, pad, 5);
                let la = Layout::of([m, k], a_strides).unwrap();
                let lb = Layout::of([k, n], b_strides).unwrap();
                let call = Gemm::row_major(m, k, n, la, lb);
                let mut c = vec![f32::NAN; m * n];
                call.reference(&b, &a, &mut c);
                for i in 0..m {
                    for j in 0..n {
                        let want: f32 = (0..k).map(|p| av[i * k + p] * bv[p * n + j]).sum();
                        assert_eq!(
                            c[i * n + j],
                            want,
                            "[{m}, {k}] @ [{k}, {n}], {ta} {tb}: ({i}, {j})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn layouts_of_strides() {
        assert_eq!(Layout::of([3, 4], [4, 1]), Some(Layout::RowMajor { ld: 4 }));
        assert_eq!(Layout::of([3, 4], [1, 3]), Some(Layout::ColMajor { ld: 3 }));
        assert_eq!(Layout::of([3, 4], [6, 1]), Some(Layout::RowMajor { ld: 6 }));
        // A stride that overlaps rows, and one of neither kind.
        assert_eq!(Layout::of([3, 4], [2, 1]), None);
        assert_eq!(Layout::of([3, 4], [8, 2]), None);
        // One row: any stride of the rows.
        assert_eq!(Layout::of([1, 4], [0, 1]), Some(Layout::RowMajor { ld: 4 }));
        // One column: rows `strides[0]` apart, whatever the stride of the columns.
        assert_eq!(Layout::of([3, 1], [1, 7]), Some(Layout::RowMajor { ld: 1 }));
        assert_eq!(Layout::of([3, 1], [2, 1]), Some(Layout::RowMajor { ld: 2 }));
    }
}
