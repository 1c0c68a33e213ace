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
//! scores (and in the backward pass the dropped weights' gradient `dG`) in `f32`, and the
//! dropped weights (and in the backward pass the scores' gradient) in the projection's type,
//! what the products after them read. For nanoGPT's GPU config that is 32 MiB forward and 64
//! MiB backward in `f32`, 24 and 48 MiB in bf16.
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
//! - backward: `S` again and `dG = dO V^T`; one kernel: `P M` and `dS = P (dG M - delta)`,
//!   `delta_i = sum_j (P M)_ij dG_ij`; `dQ = scale dS K`, `dV = (P M)^T dO`,
//!   `dK = scale dS^T Q`.
//!
//! On sequences longer than [`BLOCK_ROWS`] (`causal-blocks` on) each product runs in blocks
//! of query rows: the products for `S`, `O`, `dG` and `dQ` of a block over the keys up to its
//! last row, those for `dV` and `dK` of a block of keys over the queries from its first row on,
//! so that the masked half of the scores is neither computed nor read (at context 1024, 5/8 of
//! one product's work in 4 calls); the kernels write each row up to its block's end.
//!
//! Elsewhere than CUDA (and for a product cuBLAS does not take) the products are Burn's
//! `matmul` on the same views ([`part`]): how the tests run this path on wgpu against the op's
//! reference.

use super::attention::Dims;
use crate::cube::{ROW_UNITS, row_cubes};
use burn::backend::TensorMetadata;
use burn::tensor::{DType, bf16, f16};
use burn_cubecl::tensor::CubeTensor;
use part::{Part, product};

/// The small kernels between the products.
mod kernels;
/// The products' operands and outputs as views of their tensors, and the products.
mod part;
#[cfg(all(test, feature = "wgpu"))]
pub(crate) mod tests;

/// The most bytes of one `[B, T, T]` buffer: longer sequences or larger batches are taken a few
/// sequences at a time (nanoGPT's GPU config, 64 sequences of 256, in one: 16 MiB).
const BUFFER_BYTES: usize = 64 << 20;

/// Query rows per block of the products with `causal-blocks` on: at context 1024, 4 blocks
/// and 5/8 of one product's work; contexts up to 256 in one block.
const BLOCK_ROWS: usize = 256;

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

/// Query rows per block of the products for sequences of `t` positions: [`BLOCK_ROWS`] (the
/// policy's `attention.block_rows` where set) with `causal-blocks` on, else `t` (one block).
fn block_rows(t: usize) -> usize {
    let t = t.max(1);
    if !crate::gpu_kernels::applies(crate::GpuStrategy::CausalBlocks) {
        return t;
    }
    let rows = crate::gpu_kernels::policy().attention.block_rows;
    rows.unwrap_or(BLOCK_ROWS).clamp(1, t)
}

/// The blocks `start..end` of `block` rows that cover `0..t`, the last one shorter where
/// `block` does not divide `t`.
fn blocks(t: usize, block: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t)
        .step_by(block)
        .map(move |start| (start, (start + block).min(t)))
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
    let block = block_rows(t);
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
            // Each block of queries against the keys up to its last one.
            for (start, end) in blocks(t, block) {
                let (q, keys) = (q.rows(start, end), keys.rows(0, end).t());
                scores = product(n, q, keys, scale, scores, (0, start, 0));
            }
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
                block,
                mask.on,
            );
            for (start, end) in blocks(t, block) {
                let w = Part::cols(&weights, 0, end).rows(start, end);
                let at = (first, start, h * k);
                out = product(n, w, values.rows(0, end), 1.0, out, at);
            }
        }
    }
    (out, lse)
}

/// The backward pass: the gradient `[B, T, 3D]` (in the projection's type) of the contiguous
/// projection `qkv` `[B, T, 3D]` from the forward pass's seed and log-sum-exp `lse` and the
/// output's contiguous gradient `grad` `[B, T, D]` (in the projection's type).
///
/// The queries' products run in blocks of query rows (each against the keys up to its last
/// one), the keys' and values' in blocks of key rows (each against the queries from its first
/// one on).
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
    let block = block_rows(t);
    let mut dqkv = super::empty_of(qkv, [dims.b, t, 3 * d], dtype);
    // For every head: the scores and the dropped weights' gradient `dG` in `f32`; the dropped
    // weights (what the product for `dV` reads) and the scores' gradient (what the products for
    // `dQ` and `dK` read) in the projection's type.
    let (mut scores, mut dg, weights, ds) = (
        super::empty(qkv, [per_call, t, t]),
        super::empty(qkv, [per_call, t, t]),
        super::empty_of(qkv, [per_call, t, t], dtype),
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
            for (start, end) in blocks(t, block) {
                let (q, keys) = (q.rows(start, end), keys.rows(0, end).t());
                scores = product(n, q, keys, scale, scores, (0, start, 0));
                let (dout, values) = (dout.rows(start, end), values.rows(0, end).t());
                dg = product(n, dout, values, 1.0, dg, (0, start, 0));
            }
            let (count, dim) = row_cubes(n * t);
            launch_as!(
                dtype,
                attention_backward_rows,
                &qkv.client,
                count,
                dim,
                scores.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                seed.clone().into_tensor_arg(),
                dg.clone().into_tensor_arg(),
                weights.clone().into_tensor_arg(),
                ds.clone().into_tensor_arg(),
                mask.threshold,
                mask.keep,
                n * t,
                first,
                h,
                heads,
                block,
                mask.on,
            );
            for (start, end) in blocks(t, block) {
                // `dQ` of each block of queries from the keys they see; `dV` and `dK` of each
                // block of keys from the queries that see them.
                let at = (first, start, h * k);
                let rows = Part::cols(&ds, 0, end).rows(start, end);
                dqkv = product(n, rows, keys.rows(0, end), scale, dqkv, at);
                let at = (first, start, 2 * d + h * k);
                let cols = Part::cols(&weights, start, end - start).rows(start, t).t();
                dqkv = product(n, cols, dout.rows(start, t), 1.0, dqkv, at);
                let at = (first, start, d + h * k);
                let cols = Part::cols(&ds, start, end - start).rows(start, t).t();
                dqkv = product(n, cols, q.rows(start, t), scale, dqkv, at);
            }
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
