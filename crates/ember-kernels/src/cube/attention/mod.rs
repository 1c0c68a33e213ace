//! Causal self-attention from the fused `[Q | K | V]` projection to the merged heads in one op
//! on the GPU, with its own backward pass (CubeCL kernels).
//!
//! The general path on a GPU splits the heads (three copies), multiplies per head through the
//! backend's matmul, writes the `[B, H, T, T]` scores and weights to memory and reads them back
//! several times, forward and backward, and merges the heads with another copy. Here each query
//! row is one unit of work that reads its query, key and value columns where the projection
//! wrote them and streams over the keys it may see with a running softmax (the online softmax
//! of FlashAttention), so no `T x T` matrix is ever stored: the forward pass keeps only each
//! row's log-sum-exp `L` (`[B, H, T]`) for the backward pass, which recomputes the weights
//! `P = exp(S - L)` from it, FlashAttention-2 style:
//!
//! - `delta_i = sum_c dO_ic O_ic` (one number per query row),
//! - `dS_ij = P_ij (dO_i . V_j - delta_i)`,
//! - `dQ_i = scale sum_{j<=i} dS_ij K_j` (one unit per query row, with `delta_i`),
//! - `dK_j = scale sum_{i>=j} dS_ij Q_i`, `dV_j = sum_{i>=j} P_ij dO_i` (one unit per key row),
//!
//! written straight into the gradient of the projection `[B, T, 3D]`. The reference is
//! [`crate::causal_self_attention_reference`]; the tests below hold the kernels to it on
//! wgpu (Mesa's lavapipe in CI).
//!
//! The training kernels give each cube a block of rows of one head (one unit per row) and
//! stream the other side through shared memory in tiles: the forward pass and the queries'
//! gradient keep their query row (and its output gradient) and accumulator in registers and read
//! tiles of keys and values, which every unit of the cube loads together once per tile instead
//! of each unit reading every key from global memory; the key and value gradients keep their key
//! row and read tiles of queries, output gradients, log-sum-exps and `delta`s the same way (in
//! two launches, keys then values, so that one row of accumulators fits in registers). Every
//! unit of a cube reads the same tile row at the same time (a broadcast, no bank conflicts).
//! Rows are read as vectors of 4 values where a head's width allows (`Dims::lanes`): each
//! load from a shared tile then feeds 4 products, where one value per load held the kernels to
//! the shared memory's rate of loads rather than the arithmetic's.
//!
//! For head sizes 32 and 64 the training kernels compute in register tiles instead (the
//! `*_tiled` kernels), as matrix-product kernels do: a cube of 64 units takes a block of 64 rows
//! (32 where shared memory is small), both operands of each product sit in shared memory
//! transposed (a 4-value load gives 4 rows' values of one column), and each unit holds 8 rows by
//! 4 columns of the scores and 8 rows by `K / 8` columns of its output, so that one load feeds
//! 8 or 16 products where the one-row kernels' load of 4 values fed 4: those kernels read each
//! pair's `2K` values from shared memory for `2K` products, which on an H100 costs as many of
//! the shared memory's cycles as the arithmetic costs issue slots (docs/benchmarks.md).
//! `EMBER_GPU_KERNELS=-attention-tiles` runs the one-row kernels everywhere.
//!
//! Where the device has matrix fragments of the projection's type (TF32 for `f32` on CUDA,
//! bf16, f16), the same passes run on tensor cores instead ([`mma`]: every product in
//! CubeCL's `cmma`, the softmax in shared memory between them; `-attention-mma` turns it off).
//!
//! Decoding has too few query rows for one unit each, so its kernel gives each query row a
//! cube.
//!
//! Layout: this file holds the op's entry points; [`backend`] the backend extension trait and
//! its CubeCL implementation (each pass's paths), [`autodiff`] the autodiff op, [`route`] where
//! the batched products apply and their start-up check, [`tune`] the timed choice of each
//! pass's path, [`launch`] the kernels' launches, [`mma`] the tensor-core kernels' plans and
//! launches, [`dims`] the sizes and tiling rules, [`kernels`] the CubeCL kernels (one file per family), and `tests` their tests on wgpu
//! (`tests_mma` on Vulkan with cooperative matrices, `tests_ptx` lowered for an H200).

mod autodiff;
mod backend;
mod dims;
mod kernels;
mod launch;
mod mma;
mod route;
#[cfg(all(test, feature = "wgpu"))]
mod tests;
#[cfg(all(test, feature = "wgpu", feature = "vulkan"))]
mod tests_mma;
#[cfg(all(test, feature = "cuda"))]
mod tests_ptx;
mod tune;

pub use backend::AttentionKernels;
pub(super) use dims::{Dims, float_cast_to, wide};
#[cfg_attr(not(feature = "cudnn"), allow(unused_imports))]
pub(super) use launch::{fused_backward, fused_forward};
// What the tests name through `use super::*`.
#[cfg(all(test, feature = "wgpu"))]
use {burn_cubecl::CubeBackend, route::products_agree};

use crate::GpuKernel;
use burn::backend::Dispatch;
use burn::tensor::{DType, Device, Int, Tensor};

/// `dropout(softmax(Q K^T / sqrt(K) + causal mask)) V` per head, heads merged, from the fused
/// projection `qkv`, each weight dropped with probability `dropout` (0: none); `qkv` back where
/// these kernels do not apply (not an `f32` tensor on a CubeCL device, no rows).
///
/// The dropout mask is a hash of a seed drawn from the device's random numbers (so
/// `Device::seed` makes it repeatable) and each weight's index; the backward pass computes the
/// same mask again instead of storing it.
///
/// # Shapes
/// - qkv: `[B, T, 3D]`, columns `[Q | K | V]`, head `h` at columns `h*K..(h+1)*K` of each
/// - output: `[B, T, D]`
pub(crate) fn causal_self_attention(
    qkv: Tensor<3>,
    heads: usize,
    dropout: f64,
) -> Result<Tensor<3>, Tensor<3>> {
    seeded(qkv, heads, dropout, super::hashed_mask::draw_seed)
}

/// `softmax(Q K^T / sqrt(K) + mask) V` for `T` queries at positions `start..start + T` over a
/// KV cache's whole buffer `k`, `v` (query `i` sees keys `0..=start + i`); the inputs back where
/// these kernels do not apply (not plain `f32` tensors on a CubeCL device: decoding is never
/// differentiated). `start` is a kernel argument, not part of its shape: one kernel serves
/// every decoding step.
///
/// # Shapes
/// - q: `[B, H, T, K]`, k and v: `[B, H, C, K]`, `C >= start + T`
/// - output: `[B, H, T, K]`
pub(crate) fn cached_causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    start: usize,
) -> Result<Tensor<4>, (Tensor<4>, Tensor<4>, Tensor<4>)> {
    let [_, _, t, _] = q.dims();
    let capacity = k.dims()[2];
    let plain = |t: &Tensor<4>| super::gpu_kernel_takes_plain(GpuKernel::CachedAttention, t);
    if t == 0 || start + t > capacity || !(plain(&q) && plain(&k) && plain(&v)) {
        return Err((q, k, v));
    }
    let context = <Dispatch as AttentionKernels>::cached_causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        start,
    );
    Ok(Tensor::from_dispatch(context))
}

/// [`cached_causal_attention`] for queries at the position `position` `[1]` holds on the
/// device.
pub(crate) fn cached_causal_attention_at(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    position: &Tensor<1, Int>,
) -> Result<Tensor<4>, (Tensor<4>, Tensor<4>, Tensor<4>)> {
    let [_, _, t, _] = q.dims();
    let capacity = k.dims()[2];
    let plain = |t: &Tensor<4>| super::gpu_kernel_takes_plain(GpuKernel::CachedAttention, t);
    if t == 0 || t > capacity || !(plain(&q) && plain(&k) && plain(&v)) {
        return Err((q, k, v));
    }
    let context = <Dispatch as AttentionKernels>::cached_causal_attention_at(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        position.clone().into_dispatch(),
    );
    Ok(Tensor::from_dispatch(context))
}

/// [`causal_self_attention`] with the dropout seed drawn by `seed` on the tensor's device: a
/// uniform number in `[0, 1)` (its first 24 bits are used), drawn only where the kernels take
/// the tensor and drop (so other backends' random numbers are left as they were).
fn seeded(
    qkv: Tensor<3>,
    heads: usize,
    dropout: f64,
    seed: impl FnOnce(&Device) -> Tensor<1>,
) -> Result<Tensor<3>, Tensor<3>> {
    let [_, t, d3] = qkv.dims();
    // Mixed precision's projection in bf16 (or f16), in training and in evaluation: kept in
    // its type, computed in f32 or on cuDNN's tensor cores (the passes widen it for the fused
    // kernels; on CUDA cuDNN's flash attention reads it as it is, where an evaluation widening
    // it first would run the `f32` path with its `[B, T, T]` scores).
    let narrow = matches!(qkv.dtype(), DType::BF16 | DType::F16)
        && !cfg!(feature = "fusion")
        && crate::gpu_kernels::uses(GpuKernel::Attention)
        && crate::on_cubecl(&qkv.device());
    if t == 0
        || d3 == 0
        || !(narrow || super::gpu_kernel_takes(GpuKernel::Attention, &qkv))
        || !(0.0..1.0).contains(&dropout)
    {
        return Err(qkv);
    }
    assert!(
        d3 % 3 == 0 && (d3 / 3) % heads == 0,
        "fused attention: {d3} columns do not split into Q, K, V of {heads} heads"
    );
    // Without dropout the kernels never read the seed: any f32 tensor will do.
    let seed = match (dropout > 0.0, narrow) {
        (true, _) => seed(&qkv.device()).into_dispatch(),
        (false, false) => qkv.clone().into_dispatch(),
        (false, true) => Tensor::<1>::zeros([1], &qkv.device()).into_dispatch(),
    };
    let out = <Dispatch as AttentionKernels>::causal_self_attention(
        qkv.into_dispatch(),
        seed,
        heads,
        dropout as f32,
    );
    Ok(Tensor::from_dispatch(out))
}
