//! The training attention's two passes (the op of [`super::attention`]) as batched matrix
//! products, one head at a time, with small kernels over that head's scores between them:
//! the textbook `softmax(Q K^T / sqrt(K)) V` with its `[T, T]` scores stored, where the fused
//! kernels never store them.
//!
//! On CUDA the products are cuBLAS's (TF32 tensor cores, as PyTorch's attention uses for `f32`),
//! which ember's own kernels do not reach: on an H200, the fused backward pass took 1057 µs per
//! layer of nanoGPT's GPU config against about 290 µs computed for these products and kernels
//! (docs/benchmarks.md; not measured yet). Each head's matrices are read and written where they lie in the
//! projection `[B, T, 3D]`, its gradient and the output `[B, T, D]` (rows `3D` or `D` apart,
//! sequences `T` rows apart: one strided batched call per product and head, batched over the
//! sequences), so nothing is copied; one head's scores `[B, T, T]` are the only extra memory,
//! reused for every head and taken a few sequences at a time where one would pass 64 MiB: the
//! scores (and in the backward pass their gradient `dG`) in `f32`, and the dropped weights (then
//! the scores' gradient) in the projection's type, what the products after them read. For
//! nanoGPT's GPU config that is 32 MiB forward and 48 MiB backward in `f32`, 24 and 40 MiB in
//! bf16.
//!
//! Mixed precision's bf16 (or f16) projection is read as it is: its products accumulate in
//! `f32` (cuBLAS's `CUBLAS_COMPUTE_32F`, twice TF32's rate on tensor cores), the scores, their
//! log-sum-exps and `dG` are `f32`, and the weights, `dS`, the output and the gradient are
//! rounded once to the projection's type, as FlashAttention rounds them in bf16. No widened
//! copy of the projection, the output or their gradients is made.
//!
//! Per head `h`, with `S = scale Q K^T` (scaled scores), `L` each row's log-sum-exp over the keys
//! it sees, `P = exp(S - L)` below the diagonal (0 above) and `M` the dropout factors (the
//! fused kernels' hashed mask, the same element for element):
//!
//! - forward: `S`; kernel: `L`, and `P M` in place of `S`; `O = (P M) V`;
//! - backward: `S` again; kernel: `P M`; `dV = (P M)^T dO`; `dG = dO V^T`; kernel:
//!   `dS = P (dG M - delta)` in place of `dG`, `delta_i = sum_j (P M)_ij dG_ij`;
//!   `dQ = scale dS K`, `dK = scale dS^T Q`.
//!
//! Elsewhere than CUDA (and for a product cuBLAS does not take) the products are Burn's
//! `matmul` on the same views: how the tests run this path on wgpu against the op's reference.

use super::attention::{Dims, float_cast_to, wide};
use crate::blas::{Batched, Layout, Strided};
use crate::cube::{ROW_UNITS, launch_size, row_cubes};
use burn::backend::TensorMetadata;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Slice, bf16, f16};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

/// The small kernels between the products.
mod kernels;
#[cfg(all(test, feature = "wgpu"))]
pub(crate) mod tests;

/// The most bytes of one `[B, T, T]` buffer: longer sequences or larger batches are taken a few
/// sequences at a time (nanoGPT's GPU config, 64 sequences of 256, in one: 16 MiB).
const BUFFER_BYTES: usize = 64 << 20;

/// Sequences per call of the products: as many as one buffer of [`BUFFER_BYTES`] holds, at
/// least one (the policy's `attention.sequences_per_call` where set).
fn sequences_per_call(b: usize, t: usize) -> usize {
    if let Some(n) = crate::gpu_kernels::policy().attention.sequences_per_call {
        return n.clamp(1, b.max(1));
    }
    (BUFFER_BYTES / (t * t * size_of::<f32>()).max(1)).clamp(1, b.max(1))
}

/// `kernels::$kernel::launch::<N>(args)`, `N` the Rust type of the float type `dtype`.
macro_rules! launch_as {
    ($dtype:expr, $kernel:ident, $($arg:expr),* $(,)?) => {
        match $dtype {
            DType::F32 => kernels::$kernel::launch::<f32>($($arg),*),
            DType::BF16 => kernels::$kernel::launch::<bf16>($($arg),*),
            DType::F16 => kernels::$kernel::launch::<f16>($($arg),*),
            other => unreachable!("attention products: {other:?} (Dims::of checks the type)"),
        }
    };
}

/// The forward pass: the output `[B, T, D]` (in the projection's type) and each query row's
/// log-sum-exp `[B, H, T]` (`f32`) of the contiguous projection `qkv` `[B, T, 3D]` (`f32`, or
/// mixed precision's bf16 or f16), weights dropped with probability `dropout` by the mask of
/// `seed`.
pub(super) fn forward(
    qkv: &CubeTensor,
    seed: &CubeTensor,
    heads: usize,
    dropout: f32,
) -> (CubeTensor, CubeTensor) {
    // The products read rows `3D` apart: no padded rows (CubeCL's CUDA allocator pads them
    // where their width is not a multiple of its pitch alignment).
    let qkv = &burn_cubecl::kernel::into_contiguous(qkv.clone());
    let dims = Dims::of(qkv, heads);
    let (d, k, t, scale) = (dims.d, dims.k(), dims.t, dims.scale());
    let dtype = qkv.dtype();
    let mut out = super::empty_of(qkv, [dims.b, t, d], dtype);
    let lse = super::empty(qkv, [dims.b, heads, t]);
    let per_call = sequences_per_call(dims.b, t);
    // The scores in `f32`, the dropped weights in the projection's type (what the product
    // with `V` reads).
    let mut scores = super::empty(qkv, [per_call, t, t]);
    let weights = super::empty_of(qkv, [per_call, t, t], dtype);
    let mask = Dropout::of(dropout);
    for first in (0..dims.b).step_by(per_call) {
        let n = per_call.min(dims.b - first);
        for h in 0..heads {
            let (q, keys, values) = (
                Part::cols(qkv, h * k, k).from(first),
                Part::cols(qkv, d + h * k, k).from(first),
                Part::cols(qkv, 2 * d + h * k, k).from(first),
            );
            scores = product(n, q, keys.t(), scale, scores, (0, 0));
            let (count, dim) = row_cubes(n * t);
            launch_as!(
                dtype,
                attention_weights,
                &qkv.client,
                count,
                dim,
                scores.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                seed.clone().into_tensor_arg(),
                weights.clone().into_tensor_arg(),
                mask.threshold,
                mask.keep,
                n * t,
                first,
                h,
                heads,
                mask.on,
            );
            out = product(n, Part::all(&weights), values, 1.0, out, (first, h * k));
        }
    }
    (out, lse)
}

/// The backward pass: the gradient `[B, T, 3D]` (in the projection's type) of the contiguous
/// projection `qkv` `[B, T, 3D]` from the forward pass's seed and log-sum-exp `lse` and the
/// output's contiguous gradient `grad` `[B, T, D]` (in the projection's type).
pub(super) fn backward(
    qkv: &CubeTensor,
    seed: &CubeTensor,
    lse: &CubeTensor,
    grad: &CubeTensor,
    heads: usize,
    dropout: f32,
) -> CubeTensor {
    let [qkv, lse, grad] =
        &[qkv, lse, grad].map(|x| burn_cubecl::kernel::into_contiguous(x.clone()));
    let dims = Dims::of(qkv, heads);
    let (d, k, t, scale) = (dims.d, dims.k(), dims.t, dims.scale());
    let dtype = qkv.dtype();
    assert_eq!(
        grad.dtype(),
        dtype,
        "attention products: the output's gradient in the projection's type"
    );
    let per_call = sequences_per_call(dims.b, t);
    let mut dqkv = super::empty_of(qkv, [dims.b, t, 3 * d], dtype);
    // For every head: the scores and the dropped weights' gradient `dG` in `f32`; the dropped
    // weights in the projection's type (what the product for `dV` reads), then the scores'
    // gradient in their place (what the products for `dQ` and `dK` read).
    let (mut scores, mut dg, work) = (
        super::empty(qkv, [per_call, t, t]),
        super::empty(qkv, [per_call, t, t]),
        super::empty_of(qkv, [per_call, t, t], dtype),
    );
    let mask = Dropout::of(dropout);
    for first in (0..dims.b).step_by(per_call) {
        let n = per_call.min(dims.b - first);
        for h in 0..heads {
            let (q, keys, values, dout) = (
                Part::cols(qkv, h * k, k).from(first),
                Part::cols(qkv, d + h * k, k).from(first),
                Part::cols(qkv, 2 * d + h * k, k).from(first),
                Part::cols(grad, h * k, k).from(first),
            );
            scores = product(n, q, keys.t(), scale, scores, (0, 0));
            let (count, dim) = launch_size(qkv, n * t * t);
            launch_as!(
                dtype,
                attention_weights_backward,
                &qkv.client,
                count,
                dim,
                scores.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                seed.clone().into_tensor_arg(),
                work.clone().into_tensor_arg(),
                mask.threshold,
                mask.keep,
                n * t * t,
                first,
                h,
                heads,
                mask.on,
            );
            let (q_at, k_at, v_at) = ((first, h * k), (first, d + h * k), (first, 2 * d + h * k));
            dqkv = product(n, Part::all(&work).t(), dout, 1.0, dqkv, v_at);
            dg = product(n, dout, values.t(), 1.0, dg, (0, 0));
            let (count, dim) = row_cubes(n * t);
            launch_as!(
                dtype,
                attention_scores_backward,
                &qkv.client,
                count,
                dim,
                scores.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                seed.clone().into_tensor_arg(),
                dg.clone().into_tensor_arg(),
                work.clone().into_tensor_arg(),
                mask.threshold,
                mask.keep,
                n * t,
                first,
                h,
                heads,
                mask.on,
            );
            dqkv = product(n, Part::all(&work), keys, scale, dqkv, q_at);
            dqkv = product(n, Part::all(&work).t(), q, scale, dqkv, k_at);
        }
    }
    dqkv
}

/// The dropout arguments of the kernels: the mask's threshold, the kept weights' factor, and
/// whether anything is dropped.
struct Dropout {
    threshold: u32,
    keep: f32,
    on: bool,
}

impl Dropout {
    fn of(p: f32) -> Self {
        Dropout {
            threshold: super::hashed_mask::threshold(p),
            keep: 1.0 / (1.0 - p),
            on: p > 0.0,
        }
    }
}

/// One matrix per sequence from sequence `first` on: columns `col..col + cols` of every row of a
/// contiguous `[B, R, W]` tensor (`[R, cols]` each), read transposed where `transposed`.
#[derive(Clone, Copy)]
struct Part<'a> {
    x: &'a CubeTensor,
    first: usize,
    col: usize,
    cols: usize,
    transposed: bool,
}

impl<'a> Part<'a> {
    fn cols(x: &'a CubeTensor, col: usize, cols: usize) -> Self {
        Part {
            x,
            first: 0,
            col,
            cols,
            transposed: false,
        }
    }

    /// From sequence `first` on.
    fn from(self, first: usize) -> Self {
        Part { first, ..self }
    }

    /// Every column.
    fn all(x: &'a CubeTensor) -> Self {
        Part::cols(x, 0, x.shape()[2])
    }

    /// Read transposed.
    fn t(self) -> Self {
        Part {
            transposed: !self.transposed,
            ..self
        }
    }

    /// `[B, R, W]`.
    fn dims(&self) -> [usize; 3] {
        self.x.shape().dims::<3>()
    }

    /// Rows and columns of the matrix as read.
    fn read_shape(&self) -> [usize; 2] {
        let rows = self.dims()[1];
        match self.transposed {
            false => [rows, self.cols],
            true => [self.cols, rows],
        }
    }

    /// Where its matrices lie in the buffer: row-major with rows `W` apart (column-major when
    /// read transposed), sequences `R W` apart.
    fn strided(&self) -> Strided {
        let [_, rows, width] = self.dims();
        Strided {
            offset: self.first * rows * width + self.col,
            stride: rows * width,
            layout: match self.transposed {
                false => Layout::RowMajor { ld: width },
                true => Layout::ColMajor { ld: width },
            },
        }
    }
}

/// The strided batched call of `out[first + s, :, col..] = a_s @ b_s` for `n` sequences `s`,
/// `out` a contiguous `[B, R, W]` tensor.
#[cfg_attr(not(feature = "cublas"), allow(dead_code))] // cuBLAS's, and the tests'
fn call(n: usize, a: Part, b: Part, out: &CubeTensor, (first, col): (usize, usize)) -> Batched {
    let ([m, k], [_, cols]) = (a.read_shape(), b.read_shape());
    let [batch, rows, width] = out.shape().dims::<3>();
    let fits = |p: &Part| p.first + n <= p.dims()[0];
    assert!(
        rows == m && col + cols <= width && b.read_shape()[0] == k && first + n <= batch,
        "attention products: {n} x [{m}, {k}] @ {:?} into columns {col}.. of sequences \
         {first}.. of {:?}",
        b.read_shape(),
        out.shape()
    );
    assert!(
        fits(&a) && fits(&b),
        "attention products: {n} sequences past an operand"
    );
    let c = Strided {
        offset: first * rows * width + col,
        stride: rows * width,
        layout: Layout::RowMajor { ld: width },
    };
    Batched::new([m, k, cols], a.strided(), b.strided(), c, n)
        .expect("a row-major output is a BLAS output")
}

/// `out` with `alpha a_s @ b_s` written into columns `col..` of its sequence `first + s`, for
/// `n` sequences `s`: by one cuBLAS call in place where cuBLAS takes it, else by Burn's `matmul`
/// and `slice_assign`. `a` and `b` are of one type, `out` of theirs or `f32`; the products of
/// bf16 or f16 operands accumulate in `f32` (Burn's on operands widened exactly), rounded once
/// to `out`'s type.
fn product(
    n: usize,
    a: Part,
    b: Part,
    alpha: f32,
    out: CubeTensor,
    (first, col): (usize, usize),
) -> CubeTensor {
    #[cfg(feature = "cublas")]
    if crate::products::cublas::batched_product(
        &call(n, a, b, &out, (first, col)),
        [a.x, b.x, &out],
        alpha,
    ) {
        return out;
    }
    type Ops = CubeBackend;
    let view = |p: Part| {
        let rows = p.dims()[1];
        let x = <Ops as FloatTensorOps<Ops>>::float_slice(
            p.x.clone(),
            &[
                Slice::from(p.first..p.first + n),
                Slice::from(0..rows),
                Slice::from(p.col..p.col + p.cols),
            ],
        );
        let x = match p.transposed {
            true => <Ops as FloatTensorOps<Ops>>::float_swap_dims(x, 1, 2),
            false => x,
        };
        wide::<Ops>(x)
    };
    let mut c = <Ops as FloatTensorOps<Ops>>::float_matmul(view(a), view(b));
    if alpha != 1.0 {
        c = <Ops as FloatTensorOps<Ops>>::float_mul_scalar(c, alpha.into());
    }
    let c = float_cast_to::<Ops>(c, out.dtype());
    let rows = out.shape()[1];
    let cols = b.read_shape()[1];
    <Ops as FloatTensorOps<Ops>>::float_slice_assign(
        out,
        &[
            Slice::from(first..first + n),
            Slice::from(0..rows),
            Slice::from(col..col + cols),
        ],
        c,
    )
}
