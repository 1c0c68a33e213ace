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
//! Decoding has too few query rows for one unit each, so its kernel gives each query row a
//! cube.

use crate::GpuKernel;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, TensorMetadata, backend_extension,
};
use burn::tensor::{DType, Device, Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::{CubeCount, CubeDim};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

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
    let plain = |t: &Tensor<4>| super::kernels_take_plain(GpuKernel::CachedAttention, t);
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
    let plain = |t: &Tensor<4>| super::kernels_take_plain(GpuKernel::CachedAttention, t);
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
    // Mixed precision's projection in bf16 (or f16) under autodiff: kept in its type, computed
    // in f32 (the autodiff op widens it for the kernels and keeps the narrow one).
    let narrow = matches!(qkv.dtype(), DType::BF16 | DType::F16)
        && qkv.device().is_autodiff()
        && !cfg!(feature = "fusion")
        && crate::gpu_kernels::uses(GpuKernel::Attention)
        && crate::on_cubecl(&qkv.device());
    if t == 0
        || d3 == 0
        || !(narrow || super::kernels_take(GpuKernel::Attention, &qkv))
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

/// The attention op on every backend that has the kernels: CubeCL's, Burn's fusion over it,
/// and autodiff over either.
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub trait AttentionKernels: Backend {
    /// The attention output `[B, T, D]` of the projection `qkv` `[B, T, 3D]`, weights dropped
    /// with probability `dropout` by the mask that `seed` (its first element) draws.
    #[fusion(default)]
    fn causal_self_attention(
        qkv: FloatTensor<Self>,
        seed: FloatTensor<Self>,
        heads: usize,
        dropout: f32,
    ) -> FloatTensor<Self> {
        Self::causal_self_attention_forward(qkv, seed, heads, dropout).0
    }

    /// The output `[B, T, D]` and each query row's log-sum-exp of its scaled scores `[B, H, T]`
    /// (before dropout).
    #[fusion(meta = forward_specs)]
    fn causal_self_attention_forward(
        qkv: FloatTensor<Self>,
        seed: FloatTensor<Self>,
        heads: usize,
        dropout: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradient of the projection `[B, T, 3D]` from the forward pass's input, seed, output
    /// and log-sum-exp and the output's gradient `grad` `[B, T, D]`.
    #[allow(clippy::too_many_arguments)]
    #[fusion(dtype = qkv, shape = qkv)]
    fn causal_self_attention_backward(
        qkv: FloatTensor<Self>,
        seed: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        heads: usize,
        dropout: f32,
    ) -> FloatTensor<Self>;

    /// Queries `q` `[B, H, T, K]` at positions `start..start + T` over the cache's whole
    /// buffer `k`, `v` `[B, H, C, K]`: `[B, H, T, K]`.
    #[fusion(dtype = q, shape = q)]
    fn cached_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        start: usize,
    ) -> FloatTensor<Self>;

    /// [`AttentionKernels::cached_causal_attention`] at the position `position` `[1]` holds.
    #[fusion(dtype = q, shape = q)]
    fn cached_causal_attention_at(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        position: IntTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// The shapes of the forward pass's two outputs, for fusion (which defers the kernels).
#[cfg(feature = "fusion")]
fn forward_specs(
    qkv: &burn::backend::fusion::custom::TensorSpec,
    _seed: &burn::backend::fusion::custom::TensorSpec,
    heads: &usize,
    _dropout: &f32,
) -> (
    burn::backend::fusion::custom::TensorSpec,
    burn::backend::fusion::custom::TensorSpec,
) {
    use burn::backend::fusion::custom::TensorSpec;
    let [b, t, d3] = qkv.shape.dims::<3>();
    (
        TensorSpec::new(burn::tensor::Shape::new([b, t, d3 / 3]), qkv.dtype),
        TensorSpec::new(burn::tensor::Shape::new([b, *heads, t]), qkv.dtype),
    )
}

impl AttentionKernels for CubeBackend {
    fn causal_self_attention_forward(
        qkv: CubeTensor,
        seed: CubeTensor,
        heads: usize,
        dropout: f32,
    ) -> (CubeTensor, CubeTensor) {
        let qkv = into_contiguous(qkv);
        #[cfg(feature = "cudnn")]
        if let Some(shape) = super::cudnn_attention::takes(&qkv, heads, dropout)
            && let Some(done) = on_device_thread(&qkv.client, || {
                super::cudnn_attention::forward(&qkv, &seed, &shape)
            })
        {
            return done;
        }
        if by_products(&qkv) {
            return on_device_thread(&qkv.client, || {
                super::attention_products::forward(&qkv, &seed, heads, dropout)
            });
        }
        // Mixed precision's bf16 (or f16) projection: the fused kernels read it widened (a
        // copy that lives for the call), and the output is rounded once to its type.
        let dtype = qkv.dtype();
        let (out, lse) = fused_forward(wide::<Self>(qkv), seed, heads, dropout);
        (cast_to::<Self>(out, dtype), lse)
    }

    fn causal_self_attention_backward(
        qkv: CubeTensor,
        seed: CubeTensor,
        out: CubeTensor,
        lse: CubeTensor,
        grad: CubeTensor,
        heads: usize,
        dropout: f32,
    ) -> CubeTensor {
        let [qkv, lse, grad] = [qkv, lse, grad].map(into_contiguous);
        let dtype = qkv.dtype();
        // cuDNN's backward pass exactly where its forward pass ran (its dropout mask is not the
        // fused kernels'): the same shape, type and dropout take the same path.
        #[cfg(feature = "cudnn")]
        if let Some(shape) = super::cudnn_attention::takes(&qkv, heads, dropout) {
            let (out, grad) = (
                into_contiguous(out.clone()),
                cast_to::<Self>(grad.clone(), dtype),
            );
            if let Some(dqkv) = on_device_thread(&qkv.client, || {
                super::cudnn_attention::backward(&qkv, &seed, &out, &lse, &grad, &shape)
            }) {
                return dqkv;
            }
        }
        if by_products(&qkv) {
            let grad = cast_to::<Self>(grad, dtype);
            return on_device_thread(&qkv.client, || {
                super::attention_products::backward(&qkv, &seed, &lse, &grad, heads, dropout)
            });
        }
        // In the projection's type, computed in f32 (widened copies for the call).
        let [qkv, out, grad] = [qkv, into_contiguous(out), grad].map(wide::<Self>);
        let dqkv = fused_backward(qkv, seed, out, lse, grad, heads, dropout);
        cast_to::<Self>(dqkv, dtype)
    }

    fn cached_causal_attention(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        start: usize,
    ) -> CubeTensor {
        cached_attention(q, k, v, CachedStart::Host(start as u32))
    }

    fn cached_causal_attention_at(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        position: CubeTensor,
    ) -> CubeTensor {
        cached_attention(q, k, v, CachedStart::Device(super::ids_i32(position)))
    }
}

/// `pass` (one of the attention's passes as batched products) run on CubeCL's device thread
/// ([`super::on_device_thread`]): its cuBLAS calls and kernel launches are then enqueued there
/// in order, where each cuBLAS call from another thread is a blocking round trip of its own (42
/// a layer for the two passes, against 2).
fn on_device_thread<R: Send + 'static>(
    client: &burn_cubecl::cubecl::client::Client,
    pass: impl FnOnce() -> R + Send,
) -> R {
    super::on_device_thread(client, pass)
        .unwrap_or_else(|| panic!("attention products failed on the device thread"))
}

/// Whether the training attention runs as batched products ([`super::attention_products`]):
/// `attention-products` and `cublas` on, `qkv` on a CUDA device whose cuBLAS loads, no graph being recorded,
/// and the products found to agree with the fused kernels there ([`products_agree`], once).
fn by_products(qkv: &CubeTensor) -> bool {
    #[cfg(all(test, feature = "wgpu"))]
    if tests::PRODUCTS.get() {
        return true;
    }
    #[cfg(feature = "cublas")]
    {
        use crate::gpu_kernels::uses;
        uses(GpuKernel::AttentionProducts)
            && uses(GpuKernel::Cublas)
            && matches!(qkv.device, burn_cubecl::CubeDevice::Cuda(_))
            && super::cublas::loadable()
            && !qkv.client.is_capturing()
            && products_agree_on(qkv)
    }
    #[cfg(not(feature = "cublas"))]
    {
        let _ = qkv;
        false
    }
}

/// Whether [`products_agree`] on `like`'s device, checked on the first call in the process (a
/// few small launches), so that a wrong call never trains a model: where they do not agree, says
/// so once on stderr, and the fused kernels run.
#[cfg(feature = "cublas")]
fn products_agree_on(like: &CubeTensor) -> bool {
    // Once for each float type: f32, bf16, f16.
    static AGREES: [std::sync::OnceLock<bool>; 3] = [const { std::sync::OnceLock::new() }; 3];
    let slot = match like.dtype() {
        DType::F32 => 0,
        DType::BF16 => 1,
        _ => 2,
    };
    *AGREES[slot].get_or_init(|| match products_agree(like) {
        Ok(()) => true,
        Err(why) => {
            eprintln!(
                "warning: the attention as cuBLAS's batched products disagrees with ember's fused \
                 kernels on this device ({why}); the attention runs on the fused kernels"
            );
            false
        }
    })
}

/// The attention as batched products against the fused kernels on `like`'s device, in
/// `like`'s float type: output, log-sum-exps and the projection's gradient of 3 sequences of 45
/// positions, 2 heads of 32, with dropout, within 1% of the largest value in f32 (TF32 products
/// round to 11 bits), 2% in bf16 or f16 (weights and outputs rounded to 8 or 11 bits, about
/// 0.05% of the largest value in f16 on lavapipe; the fused kernels compute from the same
/// rounded values in f32); a wrong matrix or dropout mask is off by its whole size. The error
/// names the first value that differs, or the failure to read one.
#[cfg_attr(not(feature = "cublas"), allow(dead_code))] // run by CUDA builds and tests
pub(crate) fn products_agree(like: &CubeTensor) -> Result<(), String> {
    use burn::backend::ops::FloatTensorOps;
    use burn::tensor::TensorData;
    let (b, t, heads, k, dropout) = (3, 45, 2, 32, 0.25_f32);
    let d = heads * k;
    let dtype = like.dtype();
    let tolerance = match dtype {
        DType::F32 => 0.01,
        _ => 0.02,
    };
    // Values of the check's type, and the same values in f32 for the fused kernels.
    let load = |n: usize, seed: usize, shape: Vec<usize>| {
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 + seed) % 61) as f32 / 60.0 - 0.5)
            .collect();
        let x = CubeBackend::float_from_data(TensorData::new(values, shape), &like.device);
        let narrow = cast_to::<CubeBackend>(x, dtype);
        (narrow.clone(), wide::<CubeBackend>(narrow))
    };
    let (qkv, wide_qkv) = load(b * t * 3 * d, 1, vec![b, t, 3 * d]);
    let (grad, wide_grad) = load(b * t * d, 2, vec![b, t, d]);
    let seed = CubeBackend::float_from_data(TensorData::new(vec![0.375_f32], [1]), &like.device);
    let (out, lse) = super::attention_products::forward(&qkv, &seed, heads, dropout);
    let dqkv = super::attention_products::backward(&qkv, &seed, &lse, &grad, heads, dropout);
    let (fused_out, fused_lse) = fused_forward(wide_qkv.clone(), seed.clone(), heads, dropout);
    let fused_dqkv = fused_backward(
        wide_qkv,
        seed,
        fused_out.clone(),
        fused_lse.clone(),
        wide_grad,
        heads,
        dropout,
    );
    for (what, ours, fused) in [
        ("output", out, fused_out),
        ("log-sum-exp", lse, fused_lse),
        ("gradient", dqkv, fused_dqkv),
    ] {
        let read = |x: CubeTensor| {
            burn_cubecl::ops::into_data_sync(wide::<CubeBackend>(x))
                .try_to_vec::<f32>()
                .map_err(|e| format!("reading the {what} back: {e:?}"))
        };
        let (ours, fused) = (read(ours)?, read(fused)?);
        let scale = fused.iter().fold(1f32, |m, v| m.max(v.abs()));
        for (i, (p, q)) in ours.iter().zip(&fused).enumerate() {
            let close = (p - q).abs() <= tolerance * scale;
            // A NaN is never close.
            if !close {
                return Err(format!(
                    "{dtype:?} {what} value {i} is {p}, the fused kernels' {q}"
                ));
            }
        }
    }
    Ok(())
}

/// The forward pass in ember's fused kernels (contiguous `qkv`).
pub(super) fn fused_forward(
    qkv: CubeTensor,
    seed: CubeTensor,
    heads: usize,
    dropout: f32,
) -> (CubeTensor, CubeTensor) {
    assert_eq!(qkv.dtype(), DType::F32, "fused attention kernels: f32 only");
    let dims = Dims::of(&qkv, heads);
    let out = super::empty(&qkv, [dims.b, dims.t, dims.d]);
    let lse = super::empty(&qkv, [dims.b, heads, dims.t]);
    if let Some(rows) = dims.tiled_rows(&qkv, Tiled::Forward) {
        #[cfg(all(test, feature = "wgpu"))]
        tests::TILED_LAUNCHES[rows / 64].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        kernels::attention_forward_tiled::launch::<f32>(
            &qkv.client.clone(),
            CubeCount::new_2d(dims.t.div_ceil(rows) as u32, (dims.b * heads) as u32),
            CubeDim::new_1d(TILED_UNITS as u32),
            4,
            qkv.into_tensor_arg(),
            seed.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            dims.scale(),
            super::hashed_mask::threshold(dropout),
            1.0 / (1.0 - dropout),
            dims.k() / 4,
            heads,
            dropout > 0.0,
            rows,
        );
        return (out, lse);
    }
    let (count, dim) = dims.launch_size();
    let tile = dims.tile(&qkv);
    let group = keys_per_rescale(tile);
    let w = dims.lanes(&qkv);
    kernels::attention_forward::launch::<f32>(
        &qkv.client.clone(),
        count,
        dim,
        w,
        qkv.into_tensor_arg(),
        seed.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        dims.scale(),
        super::hashed_mask::threshold(dropout),
        1.0 / (1.0 - dropout),
        dims.k() / w,
        w,
        heads,
        dropout > 0.0,
        tile,
        group,
    );
    (out, lse)
}

/// The backward pass in ember's fused kernels (contiguous tensors).
pub(super) fn fused_backward(
    qkv: CubeTensor,
    seed: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    grad: CubeTensor,
    heads: usize,
    dropout: f32,
) -> CubeTensor {
    assert_eq!(qkv.dtype(), DType::F32, "fused attention kernels: f32 only");
    let dims = Dims::of(&qkv, heads);
    let dqkv = super::empty(&qkv, [dims.b, dims.t, 3 * dims.d]);
    let delta = super::empty(&qkv, [dims.b, heads, dims.t]);
    let client = qkv.client.clone();
    let (count, dim) = dims.launch_size();
    let tile = dims.tile(&qkv);
    let w = dims.lanes(&qkv);
    if let Some(rows) = dims.tiled_rows(&qkv, Tiled::Queries) {
        #[cfg(all(test, feature = "wgpu"))]
        tests::TILED_QUERY_LAUNCHES[rows / 64].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        kernels::attention_backward_query_tiled::launch::<f32>(
            &client,
            CubeCount::new_2d(dims.t.div_ceil(rows) as u32, (dims.b * heads) as u32),
            CubeDim::new_1d(TILED_UNITS as u32),
            4,
            qkv.clone().into_tensor_arg(),
            seed.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dqkv.clone().into_tensor_arg(),
            dims.scale(),
            super::hashed_mask::threshold(dropout),
            1.0 / (1.0 - dropout),
            dims.k() / 4,
            heads,
            dropout > 0.0,
            rows,
        );
    } else {
        kernels::attention_backward_query::launch::<f32>(
            &client,
            count.clone(),
            dim,
            w,
            qkv.clone().into_tensor_arg(),
            seed.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dqkv.clone().into_tensor_arg(),
            dims.scale(),
            super::hashed_mask::threshold(dropout),
            1.0 / (1.0 - dropout),
            dims.k() / w,
            w,
            heads,
            dropout > 0.0,
            tile,
        );
    }
    // Keys, then values: two launches of one kernel, each with one row of accumulators
    // per unit (with both, 2K accumulators per unit spilled out of registers on an H100:
    // 18 ms a launch against 1.3 ms for the queries' kernel, before the kernels were
    // tiled; docs/benchmarks.md).
    for values in [false, true] {
        let kernel = if values { Tiled::Values } else { Tiled::Keys };
        if let Some(rows) = dims.tiled_rows(&qkv, kernel) {
            #[cfg(all(test, feature = "wgpu"))]
            tests::TILED_KEY_LAUNCHES[rows / 64].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            kernels::attention_backward_key_value_tiled::launch::<f32>(
                &client,
                CubeCount::new_2d(dims.t.div_ceil(rows) as u32, (dims.b * heads) as u32),
                CubeDim::new_1d(TILED_UNITS as u32),
                4,
                qkv.clone().into_tensor_arg(),
                seed.clone().into_tensor_arg(),
                grad.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                dqkv.clone().into_tensor_arg(),
                dims.scale(),
                super::hashed_mask::threshold(dropout),
                1.0 / (1.0 - dropout),
                dims.k() / 4,
                heads,
                dropout > 0.0,
                values,
                rows,
            );
            continue;
        }
        kernels::attention_backward_key_value::launch::<f32>(
            &client,
            count.clone(),
            dim,
            w,
            qkv.clone().into_tensor_arg(),
            seed.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dqkv.clone().into_tensor_arg(),
            dims.scale(),
            super::hashed_mask::threshold(dropout),
            1.0 / (1.0 - dropout),
            dims.k() / w,
            w,
            heads,
            dropout > 0.0,
            values,
            tile,
        );
    }
    dqkv
}

/// Where the cached attention's queries start: a number known when the kernel is launched, or
/// the `[1]` `i32` tensor holding it on the device (a captured step, replayed at each position).
#[allow(clippy::large_enum_variant)] // built once per launch, never stored
enum CachedStart {
    Host(u32),
    Device(CubeTensor),
}

/// The cached attention's launch: one cube per query row.
fn cached_attention(q: CubeTensor, k: CubeTensor, v: CubeTensor, start: CachedStart) -> CubeTensor {
    let [b, heads, t, head] = q.shape().dims::<4>();
    assert_eq!(q.dtype(), DType::F32, "cached attention kernel: f32 only");
    let capacity = k.shape().dims::<4>()[2];
    let out = super::empty(&q, [b, heads, t, head]);
    // One cube per query row: a token's step has one query row per head, too few rows to
    // keep a GPU busy with one unit each (measured on an H100: 350 us per layer and token).
    // A batch of prompts has many rows: in a grid, not one line.
    let client = q.client.clone();
    let (count, dim) = (
        super::row_grid(b * heads * t),
        CubeDim::new_1d(CACHED_UNITS as u32),
    );
    let scale = 1.0 / (head as f32).sqrt();
    let (q, k, v, o) = (
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        out.clone().into_tensor_arg(),
    );
    match start {
        CachedStart::Host(start) => kernels::cached_attention::launch::<f32>(
            &client,
            count,
            dim,
            q,
            k,
            v,
            o,
            start,
            scale,
            head,
            capacity,
            CACHED_UNITS,
        ),
        CachedStart::Device(position) => kernels::cached_attention_at::launch::<f32>(
            &client,
            count,
            dim,
            q,
            k,
            v,
            o,
            position.into_tensor_arg(),
            scale,
            head,
            capacity,
            CACHED_UNITS,
        ),
    }
    out
}

impl<B: AttentionKernels, C: CheckpointStrategy> AttentionKernels for Autodiff<B, C> {
    fn causal_self_attention(
        qkv: FloatTensor<Self>,
        seed: FloatTensor<Self>,
        heads: usize,
        dropout: f32,
    ) -> FloatTensor<Self> {
        // A bf16 (or f16) projection, mixed precision's: the op keeps it and its output in its
        // own type (the output rounded once), as PyTorch's autocast keeps them; the passes
        // compute in f32 (the batched products from the narrow matrices, the fused kernels from
        // widened copies).
        let seed = Self::inner(seed);
        match FusedAttention
            .prepare::<C>([qkv.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let qkv = qkv.into_primitive();
                let (out, lse) =
                    B::causal_self_attention_forward(qkv.clone(), seed.clone(), heads, dropout);
                prep.finish((qkv, seed, out.clone(), lse, heads, dropout), out)
            }
            OpsKind::UnTracked(prep) => {
                let out =
                    B::causal_self_attention_forward(qkv.into_primitive(), seed, heads, dropout).0;
                prep.finish(out)
            }
        }
    }

    // The two passes on their own are not differentiated: only the op above is.
    fn causal_self_attention_forward(
        qkv: FloatTensor<Self>,
        seed: FloatTensor<Self>,
        heads: usize,
        dropout: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (qkv, seed) = (Self::inner(qkv), Self::inner(seed));
        let (out, lse) = B::causal_self_attention_forward(qkv, seed, heads, dropout);
        (Self::from_inner(out), Self::from_inner(lse))
    }

    fn causal_self_attention_backward(
        qkv: FloatTensor<Self>,
        seed: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        heads: usize,
        dropout: f32,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::causal_self_attention_backward(
            Self::inner(qkv),
            Self::inner(seed),
            Self::inner(out),
            Self::inner(lse),
            Self::inner(grad),
            heads,
            dropout,
        ))
    }

    // Decoding is never differentiated (the entry point takes plain tensors only).
    fn cached_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        start: usize,
    ) -> FloatTensor<Self> {
        let [q, k, v] = [q, k, v].map(Self::inner);
        Self::from_inner(B::cached_causal_attention(q, k, v, start))
    }

    fn cached_causal_attention_at(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        position: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let [q, k, v] = [q, k, v].map(Self::inner);
        Self::from_inner(B::cached_causal_attention_at(q, k, v, position))
    }
}

/// The autodiff node of the fused attention.
#[derive(Debug)]
struct FusedAttention;

impl<B: AttentionKernels> Backward<B, 1> for FusedAttention {
    /// The projection, the dropout seed, the output, the log-sum-exp, the number of heads and
    /// the dropout probability.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        usize,
        f32,
    );

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (qkv, seed, out, lse, heads, dropout) = ops.state;
        // In the projection's type (f32, or mixed precision's bf16), computed in f32.
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::causal_self_attention_backward(qkv, seed, out, lse, grad, heads, dropout)
        });
    }
}

/// `x` in f32 (itself when it is).
pub(super) fn wide<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    cast_to::<B>(x, DType::F32)
}

/// `x` in `dtype` (itself when it is).
pub(super) fn cast_to<B: Backend>(x: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    match x.dtype() == dtype {
        true => x,
        false => B::float_cast(x, burn::tensor::FloatDType::from(dtype)),
    }
}

/// Units of the cached attention's cube (one cube per query row): a power of two.
const CACHED_UNITS: usize = 128;

/// The sizes of one call of the training kernels.
pub(super) struct Dims {
    pub(super) b: usize,
    pub(super) t: usize,
    pub(super) d: usize,
    heads: usize,
}

impl Dims {
    pub(super) fn of(qkv: &CubeTensor, heads: usize) -> Self {
        let [b, t, d3] = qkv.shape().dims::<3>();
        assert!(
            matches!(qkv.dtype(), DType::F32 | DType::BF16 | DType::F16),
            "attention kernels: f32, bf16 or f16, not {:?}",
            qkv.dtype()
        );
        Dims {
            b,
            t,
            d: d3 / 3,
            heads,
        }
    }

    pub(super) fn k(&self) -> usize {
        self.d / self.heads
    }

    pub(super) fn scale(&self) -> f32 {
        1.0 / (self.k() as f32).sqrt()
    }

    /// The values of a vector the kernels read and write at once: 4 where a head's columns
    /// are a multiple of 4 and the device reads 4 `f32`s at once, else 1. Every offset the
    /// kernels use is then a multiple of it (heads start at multiples of `K`, rows at
    /// multiples of `D`), and each load of a shared tile gives a unit 4 values for 4 products
    /// instead of 1.
    fn lanes(&self, like: &CubeTensor) -> usize {
        let four = self.k().is_multiple_of(4)
            && like
                .client
                .io_optimized_vector_sizes(size_of::<f32>())
                .any(|size| size == 4);
        if four { 4 } else { 1 }
    }

    /// The rows per cube (64, or else 32, whichever shared memory holds) of the register-tiled
    /// `kernel`; `None` where it does not run: [`Dims::tiles_apply`] false.
    fn tiled_rows(&self, like: &CubeTensor, kernel: Tiled) -> Option<usize> {
        let max = like.client.properties().hardware.max_shared_memory_size;
        self.tiles_apply(like)
            .then(|| {
                [64, 32]
                    .into_iter()
                    .find(|&rows| kernel.shared_bytes(self.k() / 4, rows) <= max)
            })
            .flatten()
    }

    /// Whether the register-tiled kernels apply: `attention-tiles` on, a head size of 32 or 64,
    /// read as vectors of 4.
    fn tiles_apply(&self, like: &CubeTensor) -> bool {
        crate::gpu_kernels::uses(GpuKernel::AttentionTiles)
            && matches!(self.k(), 32 | 64)
            && self.lanes(like) == 4
    }

    /// One cube per block of rows of one head of one sequence, one unit per row: blocks
    /// along `x`, heads of sequences along `y` (each within a launch's 65535 cubes a side on
    /// every backend). A block is [`ROWS`] rows, or fewer (down to a warp's 32) when the
    /// sequence is shorter, so that short sequences leave fewer units idle.
    fn launch_size(&self) -> (CubeCount, CubeDim) {
        let rows = self.t.next_power_of_two().clamp(32, ROWS);
        (
            CubeCount::new_2d(self.t.div_ceil(rows) as u32, (self.b * self.heads) as u32),
            CubeDim::new_1d(rows as u32),
        )
    }

    /// Rows of each tile that a cube streams through shared memory: the most, up to
    /// [`MAX_TILE`], whose two `K`-wide tiles and two scalar columns fit the device's shared
    /// memory (16 KiB on some wgpu adapters, 48 KiB on CUDA GPUs).
    fn tile(&self, like: &CubeTensor) -> usize {
        let bytes = like.client.properties().hardware.max_shared_memory_size;
        let mut tile = MAX_TILE;
        while tile > 1 && tile * (2 * self.k() + 2) * size_of::<f32>() > bytes {
            tile /= 2;
        }
        tile
    }
}

/// Rows per cube of the training kernels (units of a cube) for sequences of 64 or more: a
/// multiple of a warp.
const ROWS: usize = 64;

/// The most rows of a shared-memory tile.
const MAX_TILE: usize = 32;

/// Units per cube of the register-tiled kernels: 8 row groups by 8 column groups.
const TILED_UNITS: usize = 64;

/// Rows per tile that the register-tiled kernels stream (keys, or queries for the keys' and
/// values' gradients): 8 column groups of 4 (the kernels' `bc`).
const TILED_KEYS: usize = 32;

/// The register-tiled kernels, for the shared memory each needs.
#[derive(Clone, Copy)]
enum Tiled {
    Forward,
    Queries,
    Keys,
    Values,
}

impl Tiled {
    /// Bytes of shared memory of a cube of `rows` rows for a head of `row` vectors of 4: what
    /// the kernel declares.
    fn shared_bytes(self, row: usize, rows: usize) -> usize {
        let vector = 4 * size_of::<f32>();
        let tile = tile_vectors(row, rows);
        match self {
            // The block's queries, a tile's keys and values, the weights; the rows' 8 partial
            // maxima, maximum and sum.
            Tiled::Forward => {
                (row * (rows + 2 * TILED_KEYS) + TILED_KEYS * rows / 4) * vector
                    + rows * 10 * size_of::<f32>()
            }
            // The block's queries and output gradients (keys and values), two tiles.
            Tiled::Queries | Tiled::Keys => (2 * row * rows + 2 * tile) * vector,
            // The block's keys and one vector in place of its values, two tiles.
            Tiled::Values => (row * rows + 1 + 2 * tile) * vector,
        }
    }
}

/// Vectors of one of the backward kernels' two tiles: transposed tile rows (`row` vectors of
/// the head each) or the weights that replace them (`rows / 4` vectors each), whichever is
/// larger.
const fn tile_vectors(row: usize, rows: usize) -> usize {
    let (operand, weights) = (row * TILED_KEYS, TILED_KEYS * rows / 4);
    if operand > weights { operand } else { weights }
}

/// Keys the forward pass scores before it rescales its running output once for all of them
/// (FlashAttention-2's per-block rescale): a power of two, so that it divides every tile of
/// more rows. With one rescale per key, 64 of a key's 266 instructions in the loop were the
/// rescale's multiplications, beside 128 fused multiply-adds (head size 64, the kernel
/// compiled for an H100, sm_90, read offline); 8 keys cost 8 more registers for their scores.
const GROUP: usize = 8;

/// Keys per rescale of the one-row forward pass, for tiles of `tile` rows: [`GROUP`], at most
/// the tile (tests may force another).
fn keys_per_rescale(tile: usize) -> usize {
    #[cfg(all(test, feature = "wgpu"))]
    if let n @ 1.. = tests::FORCED_GROUP.load(std::sync::atomic::Ordering::Relaxed) {
        return n.min(tile);
    }
    GROUP.min(tile)
}

/// The CubeCL kernels (CubeCL's `Tensor`, not Burn's). Loops over a row's `K` columns are
/// unrolled (`K` is a compile-time constant), so the accumulators can stay in registers.
///
/// Dropout (`#[comptime] dropout`; without it the mask is never computed): weight `(r, j)` of
/// query row `r = (b * H + h) * T + i` is element `r * T + j` of a hashed mask
/// ([`super::hashed_mask`]). The log-sum-exp is that of the weights
/// before dropout, so `delta_i = dO_i . O_i` still equals `sum_j P_ij dP_ij` with the mask in
/// `dP`.
mod kernels {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use crate::cube::hashed_mask::Mask;
    use crate::cube::{cube_row, reduce_cube};

    /// Where the cube's block of rows of one head reads and writes: the head's index among all
    /// sequences' heads `bh = b * H + h`, the unit's row `r` (query or key) and whether it is
    /// a row at all (the last block of a sequence runs past `T`), and the offsets of row 0 of
    /// the head's Q, K and V columns in `[B, T, 3D]` and of its output columns in `[B, T, D]`
    /// (row `n` of each is `3D` or `D` further per row).
    #[derive(CubeType, Clone, Copy)]
    struct Block {
        bh: usize,
        r: usize,
        active: bool,
        /// The block's first row, and the end of its rows (`T` at most).
        first: usize,
        end: usize,
        q0: usize,
        k0: usize,
        v0: usize,
        o0: usize,
    }

    #[cube]
    fn block_of(t: usize, #[comptime] k: usize, #[comptime] heads: usize) -> Block {
        let d = heads * k;
        let bh = CUBE_POS_Y as usize;
        let h = bh % heads;
        let b = bh / heads;
        let first = CUBE_POS_X as usize * CUBE_DIM_X as usize;
        let r = first + UNIT_POS_X as usize;
        let mut end = first + CUBE_DIM_X as usize;
        if end > t {
            end = t;
        }
        let q0 = b * t * 3 * d + h * k;
        Block {
            bh,
            r,
            active: r < t,
            first,
            end,
            q0,
            k0: q0 + d,
            v0: q0 + 2 * d,
            o0: b * t * d + h * k,
        }
    }

    /// Rows `j0..j0 + rows` of one head's `k` vectors of `src` (row 0 at `base`, rows `stride`
    /// apart, both in vectors) into `tile`, row after row, zeros for rows past `t`. Every unit
    /// of the cube takes part (consecutive units, consecutive vectors); the caller synchronises
    /// the cube before reading the tile.
    #[allow(clippy::too_many_arguments)]
    #[cube]
    fn load_tile<F: Float, N: Size>(
        src: &Tensor<Vector<F, N>>,
        tile: &mut Shared<[Vector<F, N>]>,
        base: usize,
        stride: usize,
        j0: usize,
        t: usize,
        #[comptime] k: usize,
        #[comptime] rows: usize,
    ) {
        let units = CUBE_DIM_X as usize;
        let n = comptime!(rows * k);
        let mut e = UNIT_POS_X as usize;
        while e < n {
            let j = j0 + e / k;
            let mut x = Vector::<F, N>::new(F::new(0.0));
            if j < t {
                x = src[base + j * stride + e % k];
            }
            tile[e] = x;
            e += units;
        }
    }

    /// `src[base + j0..base + j0 + rows]` into `tile`, zeros past `t` (one value per row:
    /// log-sum-exps, `delta`s), one per unit (a tile has no more rows than a cube has units).
    #[cube]
    fn load_scalars<F: Float>(
        src: &Tensor<F>,
        tile: &mut Shared<[F]>,
        base: usize,
        j0: usize,
        t: usize,
        #[comptime] rows: usize,
    ) {
        let u = UNIT_POS_X as usize;
        if u < rows {
            let mut x = F::new(0.0);
            if j0 + u < t {
                x = src[base + j0 + u];
            }
            tile[u] = x;
        }
    }

    /// Row `r` of one head's `k` vectors (row 0 at `base`, rows `stride` apart) into registers.
    #[cube]
    fn load_row<F: Float, N: Size>(
        src: &Tensor<Vector<F, N>>,
        base: usize,
        stride: usize,
        r: usize,
        #[comptime] k: usize,
    ) -> Array<Vector<F, N>> {
        let mut row = Array::<Vector<F, N>>::new(k);
        #[unroll]
        for c in 0..k {
            row[c] = src[base + r * stride + c];
        }
        row
    }

    /// The sum of the `w` lanes of `v`.
    #[cube]
    fn lanes_sum<F: Float, N: Size>(v: Vector<F, N>, #[comptime] w: usize) -> F {
        let mut sum = F::new(0.0);
        #[unroll]
        for l in 0..w {
            sum += v.extract(l);
        }
        sum
    }

    /// `row . tile[jj]` (row `jj` of a shared tile of `k` vectors of `w` lanes): one load of
    /// `w` values per `w` products.
    #[cube]
    fn dot_tile<F: Float, N: Size>(
        row: &Array<Vector<F, N>>,
        tile: &Shared<[Vector<F, N>]>,
        jj: usize,
        #[comptime] k: usize,
        #[comptime] w: usize,
    ) -> F {
        let mut sum = Vector::<F, N>::new(F::new(0.0));
        #[unroll]
        for c in 0..k {
            sum += row[c] * tile[jj * k + c];
        }
        lanes_sum::<F, N>(sum, w)
    }

    /// `acc += w * tile[jj]`.
    #[cube]
    fn add_scaled<F: Float, N: Size>(
        acc: &mut Array<Vector<F, N>>,
        w: F,
        tile: &Shared<[Vector<F, N>]>,
        jj: usize,
        #[comptime] k: usize,
    ) {
        let w = Vector::<F, N>::new(w);
        #[unroll]
        for c in 0..k {
            acc[c] += w * tile[jj * k + c];
        }
    }

    /// A row of `k` zero vectors in registers.
    #[cube]
    fn zeros<F: Float, N: Size>(#[comptime] k: usize) -> Array<Vector<F, N>> {
        let mut row = Array::<Vector<F, N>>::new(k);
        #[unroll]
        for c in 0..k {
            row[c] = Vector::<F, N>::new(F::new(0.0));
        }
        row
    }

    /// `min(hi, lo + rows) - lo` clamped at 0: how many of the tile rows `lo..lo + rows` lie
    /// below `hi`.
    #[cube]
    fn rows_below(lo: usize, hi: usize, #[comptime] rows: usize) -> usize {
        let mut n = 0usize;
        if hi > lo {
            n = hi - lo;
            if n > rows {
                n = rows;
            }
        }
        n
    }

    /// `a[ai..ai + k] . b[bi..bi + k]` (`k` vectors of `w` lanes).
    #[cube]
    fn dot<F: Float, N: Size>(
        a: &Tensor<Vector<F, N>>,
        ai: usize,
        b: &Tensor<Vector<F, N>>,
        bi: usize,
        #[comptime] k: usize,
        #[comptime] w: usize,
    ) -> F {
        let mut sum = Vector::<F, N>::new(F::new(0.0));
        #[unroll]
        for c in 0..k {
            sum += a[ai + c] * b[bi + c];
        }
        lanes_sum::<F, N>(sum, w)
    }

    /// Forward pass: one unit per query row `(b, h, i)`, a running softmax over keys `0..=i`,
    /// the keys and values `tile` rows at a time through shared memory.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    pub(super) fn attention_forward<F: Float, N: Size>(
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

    /// Where a cube of the register-tiled kernels reads and writes: the head's index among all
    /// sequences' heads `bh = b * H + h`, the block's first row, the offsets (in vectors) of
    /// row 0 of the head's Q, K and V columns in `[B, T, 3D]` and of its columns in `[B, T, D]`,
    /// and the unit's row group `rg` and column group `g` (8 by 8 units).
    #[derive(CubeType, Clone, Copy)]
    struct TiledBlock {
        bh: usize,
        first: usize,
        q0: usize,
        k0: usize,
        v0: usize,
        o0: usize,
        rg: usize,
        g: usize,
    }

    #[cube]
    fn tiled_block(
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
    fn load_transposed<F: Float, N: Size>(
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
    pub(super) fn attention_forward_tiled<F: Float, N: Size>(
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

    /// `s[a * 4 + i] += A_r . B_g` over the head's `4 k` columns: the register tile of one
    /// unit, rows `r = rg * rv * 4 + a * 4 + i` of `A` (`4 rv` of them) against the 4 rows of
    /// `B` of group `g`; both read transposed from shared memory (`A`'s vector `c * a_cols + r
    /// / 4` at `a_at`, `B`'s `c * b_cols + g` at `b_at`: 4 rows' values of column `c`), so one
    /// load of each feeds `16 rv` products. Four columns per iteration, unrolled (the loop's
    /// own instructions were a fifth of a column's 40).
    #[allow(clippy::too_many_arguments)]
    #[cube]
    fn tile_products<F: Float, N: Size>(
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
    fn accumulate_tile<F: Float, N: Size>(
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
    fn store_weights<F: Float, N: Size>(
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
    fn write_gradient<F: Float, N: Size>(
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
    fn swizzled(j: usize, col: usize, #[comptime] cols: usize) -> usize {
        j * cols + (col ^ ((j / 4) % 8))
    }

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
    pub(super) fn attention_backward_query_tiled<F: Float, N: Size>(
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
        let tile = comptime!(crate::cube::attention::tile_vectors(k, br));
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
    pub(super) fn attention_backward_key_value_tiled<F: Float, N: Size>(
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
        let tile = comptime!(crate::cube::attention::tile_vectors(k, br));
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

    /// Attention over a KV cache's whole buffer: one cube of `units` units per query row
    /// `(b, h, i)` (at position `start + i`), over keys `0..=start + i`; inputs read through
    /// their strides (the queries are a view of the projection), the output contiguous. The
    /// units split the keys for the scores (kept in shared memory, `capacity` of them), reduce
    /// their maximum and sum through shared memory, and split the head's columns for the
    /// weighted sum of values.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    pub(super) fn cached_attention<F: Float>(
        q: &Tensor<F>,
        k: &Tensor<F>,
        v: &Tensor<F>,
        out: &mut Tensor<F>,
        start: u32,
        scale: f32,
        #[comptime] head: usize,
        #[comptime] capacity: usize,
        #[comptime] units: usize,
    ) {
        cached_rows::<F>(q, k, v, out, start, scale, head, capacity, units);
    }

    /// [`cached_attention`] for queries starting at `position[0]`, read on the device (a
    /// captured step attends wherever the position buffer says when it is replayed).
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    pub(super) fn cached_attention_at<F: Float>(
        q: &Tensor<F>,
        k: &Tensor<F>,
        v: &Tensor<F>,
        out: &mut Tensor<F>,
        position: &Tensor<i32>,
        scale: f32,
        #[comptime] head: usize,
        #[comptime] capacity: usize,
        #[comptime] units: usize,
    ) {
        let start = position[0] as u32;
        cached_rows::<F>(q, k, v, out, start, scale, head, capacity, units);
    }

    /// The body of [`cached_attention`], for either source of `start`.
    #[allow(clippy::too_many_arguments)]
    #[cube]
    fn cached_rows<F: Float>(
        q: &Tensor<F>,
        k: &Tensor<F>,
        v: &Tensor<F>,
        out: &mut Tensor<F>,
        start: u32,
        scale: f32,
        #[comptime] head: usize,
        #[comptime] capacity: usize,
        #[comptime] units: usize,
    ) {
        let row = cube_row();
        let t = q.shape(2);
        let heads = q.shape(1);
        if row >= q.shape(0) * heads * t {
            terminate!();
        }
        let u = UNIT_POS_X as usize;
        let i = row % t;
        let h = (row / t) % heads;
        let b = row / t / heads;
        let qi = b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
        let k0 = b * k.stride(0) + h * k.stride(1);
        let v0 = b * v.stride(0) + h * v.stride(1);
        let (qc, kc, vc) = (q.stride(3), k.stride(3), v.stride(3));
        let scale = F::cast_from(scale);
        let n = start as usize + i + 1; // keys this row sees

        // Scores of keys u, u + units, ..., and this unit's maximum.
        let mut scores = Shared::<[F]>::new_slice(capacity);
        let mut m = F::min_value();
        // The keys of unit u: u, u + units, ... below n.
        let mine = (n + units - 1 - u) / units;
        for r in 0..mine {
            let j = u + r * units;
            let kj = k0 + j * k.stride(2);
            let mut dot = F::new(0.0);
            #[unroll]
            for c in 0..head {
                dot += q[qi + c * qc] * k[kj + c * kc];
            }
            let s = dot * scale;
            scores[j] = s;
            if s > m {
                m = s;
            }
        }
        let mut partial = Shared::<[F]>::new_slice(units);
        let row_max = reduce_cube::<F>(&mut partial, m, true);

        // Weights `exp(s - m)` in place of the scores, and their sum.
        let mut l = F::new(0.0);
        for r in 0..mine {
            let j = u + r * units;
            let p = F::exp(scores[j] - row_max);
            scores[j] = p;
            l += p;
        }
        let total = reduce_cube::<F>(&mut partial, l, false);

        // Column c of the output: the weighted sum of the values' column c.
        let columns = (head + units - 1 - u) / units;
        for r in 0..columns {
            let c = u + r * units;
            let mut acc = F::new(0.0);
            for j in 0..n {
                acc += scores[j] * v[v0 + j * v.stride(2) + c * vc];
            }
            out[row * head + c] = acc / total;
        }
    }

    /// Backward pass, queries: one unit per query row `(b, h, i)` writes `delta_i` and `dQ_i`,
    /// the keys and values `tile` rows at a time through shared memory.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    pub(super) fn attention_backward_query<F: Float, N: Size>(
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
        #[comptime] w: usize,
        #[comptime] heads: usize,
        #[comptime] dropout: bool,
        #[comptime] tile: usize,
    ) {
        let t = qkv.shape(1);
        let d = heads * k;
        let at = block_of(t, k, heads);
        let i = at.r;
        let row = at.bh * t + i;
        let scale = F::cast_from(scale);
        let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);

        let mut q = zeros::<F, N>(k);
        let mut g = zeros::<F, N>(k);
        let mut di = F::new(0.0);
        let mut li = F::new(0.0);
        if at.active {
            q = load_row::<F, N>(qkv, at.q0, 3 * d, i, k);
            g = load_row::<F, N>(grad, at.o0, d, i, k);
            di = dot::<F, N>(grad, at.o0 + i * d, out, at.o0 + i * d, k, w);
            delta[row] = di;
            li = lse[row];
        }
        let mut acc = zeros::<F, N>(k);
        let mut keys = Shared::<[Vector<F, N>]>::new_slice(comptime!(tile * k));
        let mut values = Shared::<[Vector<F, N>]>::new_slice(comptime!(tile * k));
        let mut j0 = 0usize;
        while j0 < at.end {
            load_tile::<F, N>(qkv, &mut keys, at.k0, 3 * d, j0, t, k, tile);
            load_tile::<F, N>(qkv, &mut values, at.v0, 3 * d, j0, t, k, tile);
            sync_cube();
            if at.active {
                for jj in 0..rows_below(j0, i + 1, tile) {
                    let s = dot_tile::<F, N>(&q, &keys, jj, k, w) * scale;
                    let dp = dot_tile::<F, N>(&g, &values, jj, k, w);
                    let factor = mask.factor(row * t + j0 + jj, dropout);
                    let ds = F::exp(s - li) * (dp * factor - di);
                    add_scaled::<F, N>(&mut acc, ds, &keys, jj, k);
                }
            }
            sync_cube();
            j0 += tile;
        }
        if at.active {
            let q = at.q0 + i * 3 * d;
            let scale = Vector::<F, N>::new(scale);
            #[unroll]
            for c in 0..k {
                dqkv[q + c] = acc[c] * scale;
            }
        }
    }

    /// Backward pass, keys or values (`#[comptime] values`): one unit per key row `(b, h, j)`
    /// writes `dK_j` or `dV_j`, over queries `i >= j` read `tile` rows at a time through shared
    /// memory with their output gradients, log-sum-exps and `delta`s (after
    /// [`attention_backward_query`], which writes `delta`).
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    pub(super) fn attention_backward_key_value<F: Float, N: Size>(
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
        #[comptime] w: usize,
        #[comptime] heads: usize,
        #[comptime] dropout: bool,
        #[comptime] values: bool,
        #[comptime] tile: usize,
    ) {
        let t = qkv.shape(1);
        let d = heads * k;
        let at = block_of(t, k, heads);
        let j = at.r;
        let first = at.bh * t; // query row 0 of this (b, h)
        let scale = F::cast_from(scale);
        let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);

        let mut kj = zeros::<F, N>(k);
        let mut vj = zeros::<F, N>(k);
        if at.active {
            kj = load_row::<F, N>(qkv, at.k0, 3 * d, j, k);
            if !values {
                vj = load_row::<F, N>(qkv, at.v0, 3 * d, j, k);
            }
        }
        let mut acc = zeros::<F, N>(k);
        let mut queries = Shared::<[Vector<F, N>]>::new_slice(comptime!(tile * k));
        let mut grads = Shared::<[Vector<F, N>]>::new_slice(comptime!(tile * k));
        let mut lses = Shared::<[F]>::new_slice(tile);
        let mut deltas = Shared::<[F]>::new_slice(tile);
        // Queries before the block's first key see none of its keys.
        let mut i0 = at.first;
        while i0 < t {
            load_tile::<F, N>(qkv, &mut queries, at.q0, 3 * d, i0, t, k, tile);
            load_tile::<F, N>(grad, &mut grads, at.o0, d, i0, t, k, tile);
            load_scalars::<F>(lse, &mut lses, first, i0, t, tile);
            if !values {
                load_scalars::<F>(delta, &mut deltas, first, i0, t, tile);
            }
            sync_cube();
            if at.active {
                // Tile rows of queries i >= j (and below T).
                let mut start = 0usize;
                if j > i0 {
                    start = j - i0;
                }
                for ii in start..rows_below(i0, t, tile) {
                    let i = i0 + ii;
                    let s = dot_tile::<F, N>(&kj, &queries, ii, k, w) * scale;
                    let p = F::exp(s - lses[ii]);
                    let factor = mask.factor((first + i) * t + j, dropout);
                    if values {
                        // dV_j = sum_i P_ij (mask) dO_i
                        add_scaled::<F, N>(&mut acc, p * factor, &grads, ii, k);
                    } else {
                        // dK_j = scale * sum_i dS_ij Q_i, dS_ij = P_ij (dP_ij (mask) - delta_i)
                        let dp = dot_tile::<F, N>(&vj, &grads, ii, k, w);
                        let ds = p * (dp * factor - deltas[ii]);
                        add_scaled::<F, N>(&mut acc, ds, &queries, ii, k);
                    }
                }
            }
            sync_cube();
            i0 += tile;
        }
        if at.active {
            let scale = Vector::<F, N>::new(scale);
            #[unroll]
            for c in 0..k {
                if values {
                    dqkv[at.v0 + j * 3 * d + c] = acc[c];
                } else {
                    dqkv[at.k0 + j * 3 * d + c] = acc[c] * scale;
                }
            }
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use crate::check::agrees_on;
    use burn::tensor::{Device, DeviceKind, Distribution};

    /// Output and the projection's gradient against the op's reference (split heads, masked
    /// softmax, merge: what every other backend runs) on wgpu, plain, under autodiff and with
    /// checkpointing: head sizes 4 to 128 (smaller tiles), one position and several, lengths
    /// that are not a multiple of a cube's rows or of a tile (two and three blocks of rows), one
    /// head and several.
    #[test]
    fn equals_the_reference_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let cases = [
            (2, 9, 3, 4),
            (1, 1, 2, 7),
            (3, 37, 2, 16),
            (2, 70, 1, 32),
            (1, 150, 2, 64),
            (1, 40, 1, 128),
        ];
        for (b, t, heads, k) in cases {
            let d = heads * k;
            let draw = |dims: [usize; 3]| {
                Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &device).into_data()
            };
            let (x, g) = (draw([b, t, 3 * d]), draw([b, t, d]));
            for on in [device.clone(), device.clone().autodiff()] {
                let qkv = Tensor::<3>::from_data(x.clone(), &on);
                assert!(
                    super::super::kernels_take(GpuKernel::Attention, &qkv),
                    "kernels take wgpu f32"
                );
            }
            agrees_on(
                &device,
                &x,
                &g,
                |qkv| causal_self_attention(qkv, heads, 0.0).expect("a wgpu f32 tensor"),
                |qkv| crate::causal_self_attention_reference(qkv, heads),
                1e-4,
                &format!("{b}x{t}, {heads} heads of {k}"),
            );
        }
    }

    thread_local! {
        /// Whether this thread's training attention runs as batched products (on wgpu, Burn's
        /// products: the path CUDA takes with cuBLAS).
        pub(super) static PRODUCTS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// The attention as batched products, output and gradient, against the reference with the
    /// same dropout mask, plain, under autodiff and with checkpointing: head sizes 4 to 128, one
    /// position and several, lengths that are not a multiple of a cube's units, one head and
    /// several, with dropout and without, all sequences in one call and a few at a time.
    #[test]
    fn products_equal_the_reference_on_wgpu() {
        use crate::cube::attention_products::tests::SEQUENCES;
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        PRODUCTS.set(true);
        for (b, t, heads, k, p, per_call) in [
            (2, 9, 3, 4, 0.0, 0),
            (1, 1, 1, 8, 0.25, 0),
            (3, 37, 2, 16, 0.25, 0),
            (3, 37, 2, 16, 0.25, 2),
            (1, 70, 1, 32, 0.0, 0),
            (2, 33, 2, 64, 0.25, 1),
            (1, 40, 1, 128, 0.0, 0),
        ] {
            SEQUENCES.set(per_call);
            let seed = 0.125_f32;
            agrees_with_the_masked_reference(
                &device,
                [b, t, heads, k],
                seed,
                p,
                &format!(
                    "products, dropout {p}, {b}x{t}, {heads} heads of {k}, {per_call} per call"
                ),
            );
        }
        SEQUENCES.set(0);
        PRODUCTS.set(false);
    }

    /// The check CUDA runs before the attention takes the products passes on wgpu, where the
    /// products are Burn's: in f32, and in f16 (lavapipe has no bf16).
    #[test]
    fn the_products_check_passes_on_wgpu() {
        let like = crate::cube::attention_products::tests::cube(&[0.0], [1, 1, 1]);
        products_agree(&like).unwrap();
        let narrow = cast_to::<CubeBackend>(like, DType::F16);
        products_agree(&narrow).unwrap();
    }

    /// Mixed precision's f16 projection (lavapipe has no bf16; the path is the same) through the
    /// batched products under autodiff, with dropout and without, all sequences per call and
    /// one: the output stays f16, and output and gradient are near the reference's in f32 on
    /// the same values with the same mask (the weights and outputs rounded to f16, the rest
    /// computed in f32). A wrong matrix, mask or type is off by far more.
    #[test]
    fn narrow_products_stay_narrow_near_the_reference_on_wgpu() {
        use crate::cube::attention_products::tests::SEQUENCES;
        use burn::tensor::FloatDType;
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        PRODUCTS.set(true);
        for (b, t, heads, k, p, per_call) in [
            (2, 45, 3, 8, 0.0, 0),
            (3, 37, 2, 16, 0.25, 1),
            (1, 70, 1, 64, 0.25, 0),
        ] {
            SEQUENCES.set(per_call);
            let what = format!("f16 products, dropout {p}, {b}x{t}, {heads} heads of {k}");
            let d = heads * k;
            let (x, g) = (
                f16_exact([b, t, 3 * d], &device),
                f16_exact([b, t, d], &device),
            );
            let seed = 0.125_f32;
            let factors = dropout_factors(b, heads, t, seed, p);
            let leaf = |data| Tensor::<3>::from_data(data, &device).require_grad();
            let (narrow_in, wide_in) = (leaf(x.clone()), leaf(x));
            let narrow = seeded(
                narrow_in.clone().cast(FloatDType::F16),
                heads,
                p as f64,
                |on| Tensor::<1>::from_floats([seed], on),
            )
            .unwrap_or_else(|_| panic!("{what}: the kernels take an f16 projection"));
            assert_eq!(narrow.dtype(), DType::F16, "{what}");
            let narrow = narrow.cast(FloatDType::F32);
            let wide = masked_reference(wide_in.clone(), heads, &factors);
            let weights = Tensor::<3>::from_data(g, &device);
            let near = |a: Tensor<3>, r: Tensor<3>, part: &str| {
                let scale = r.clone().abs().max().into_scalar::<f32>();
                let diff = (a - r).abs().max().into_scalar::<f32>();
                assert!(
                    diff < 5e-3 * scale,
                    "{what}: {part} off by {diff} (scale {scale})"
                );
            };
            near(narrow.clone().inner(), wide.clone().inner(), "output");
            let loss = |y: Tensor<3>| (y * weights.clone()).sum();
            let (gn, gw) = (loss(narrow).backward(), loss(wide).backward());
            let (gn, gw) = (narrow_in.grad(&gn).unwrap(), wide_in.grad(&gw).unwrap());
            near(gn, gw, "gradient");
        }
        SEQUENCES.set(0);
        PRODUCTS.set(false);
    }

    /// Keys per rescale of the forward pass when set (0: the default).
    pub(super) static FORCED_GROUP: std::sync::atomic::AtomicUsize =
        std::sync::atomic::AtomicUsize::new(0);

    /// The one-row forward pass (heads other than 32 and 64) with one rescale per key, per 2
    /// keys and per 8, against the reference: groups cut by a query's last key (the causal
    /// edge), by the sequence's end and by tiles, with dropout and without. (Other tests running
    /// meanwhile take the forced group too; every group is correct.)
    #[test]
    fn every_group_of_keys_equals_the_reference() {
        use std::sync::atomic::Ordering;
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        for group in [1, 2, 8] {
            FORCED_GROUP.store(group, Ordering::Relaxed);
            for (b, t, heads, k, p) in [(2, 9, 3, 4, 0.0), (1, 45, 2, 16, 0.0), (1, 70, 2, 8, 0.25)]
            {
                let seed = 0.25_f32;
                agrees_with_the_masked_reference(
                    &device,
                    [b, t, heads, k],
                    seed,
                    p,
                    &format!("groups of {group}, dropout {p}, {b}x{t}, {heads} heads of {k}"),
                );
            }
        }
        FORCED_GROUP.store(0, Ordering::Relaxed);
    }

    /// Launches of the register-tiled backward pass of the queries with cubes of 32 rows
    /// (index 0) and 64.
    pub(super) static TILED_QUERY_LAUNCHES: [std::sync::atomic::AtomicUsize; 2] =
        [const { std::sync::atomic::AtomicUsize::new(0) }; 2];

    /// Launches of the register-tiled backward pass of keys and values with cubes of 32 keys
    /// (index 0) and 64.
    pub(super) static TILED_KEY_LAUNCHES: [std::sync::atomic::AtomicUsize; 2] =
        [const { std::sync::atomic::AtomicUsize::new(0) }; 2];

    /// Launches of the register-tiled forward pass with cubes of 32 rows (index 0) and 64.
    pub(super) static TILED_LAUNCHES: [std::sync::atomic::AtomicUsize; 2] =
        [const { std::sync::atomic::AtomicUsize::new(0) }; 2];

    /// The register-tiled forward pass and backward pass of keys and values (head sizes 32 and
    /// 64) against the reference, output and gradient: one position, a block's rows minus
    /// one, exactly one block, one more, several blocks ending inside a tile, several heads
    /// and sequences, with dropout and without; and it did run.
    #[test]
    fn tiled_kernels_equal_the_reference() {
        use std::sync::atomic::Ordering;
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let counts = || {
            [&TILED_LAUNCHES, &TILED_QUERY_LAUNCHES, &TILED_KEY_LAUNCHES]
                .map(|kernel| kernel.each_ref().map(|n| n.load(Ordering::Relaxed)))
        };
        let before = counts();
        for (b, t, heads, k, p) in [
            (1, 1, 1, 64, 0.0),
            (2, 63, 2, 32, 0.0),
            (1, 64, 1, 64, 0.0),
            (1, 65, 3, 32, 0.25),
            (2, 150, 2, 64, 0.0),
            (1, 200, 1, 64, 0.25),
        ] {
            let seed = 0.75_f32;
            agrees_with_the_masked_reference(
                &device,
                [b, t, heads, k],
                seed,
                p,
                &format!("tiled, dropout {p}, {b}x{t}, {heads} heads of {k}"),
            );
        }
        // lavapipe's 32 KiB of shared memory hold cubes of 64 rows (keys) for heads of 32 and
        // of 32 for heads of 64 (32 for both in the values' kernel): both sizes of every
        // kernel ran.
        let after = counts();
        for (kernel, name) in ["forward", "queries' backward", "keys' backward"]
            .iter()
            .enumerate()
        {
            for (size, rows) in [32, 64].iter().enumerate() {
                assert!(
                    after[kernel][size] > before[kernel][size],
                    "the register-tiled {name} pass never ran with cubes of {rows} rows"
                );
            }
        }
    }

    /// The op with dropout `p` by the mask of `seed` (0 for none) against the reference with
    /// the same mask applied to its weights (rebuilt on the host from the kernels' hash), on
    /// random `[B, T, 3D]` inputs of `heads` heads of `k`: output and gradient, plain, under
    /// autodiff and with checkpointing ([`agrees_on`], to 1e-4 of the largest value).
    fn agrees_with_the_masked_reference(
        device: &Device,
        [b, t, heads, k]: [usize; 4],
        seed: f32,
        p: f32,
        what: &str,
    ) {
        let d = heads * k;
        let draw = |dims: [usize; 3]| {
            Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), device).into_data()
        };
        let (x, g) = (draw([b, t, 3 * d]), draw([b, t, d]));
        let factors = dropout_factors(b, heads, t, seed, p);
        agrees_on(
            device,
            &x,
            &g,
            |qkv| {
                let seed = |on: &Device| Tensor::<1>::from_floats([seed], on);
                seeded(qkv, heads, p as f64, seed).expect("a wgpu f32 tensor")
            },
            |qkv| masked_reference(qkv, heads, &factors),
            1e-4,
            what,
        );
    }

    /// The reference attention of `qkv` `[B, T, 3D]` with each weight multiplied by its
    /// factor in `factors` (`[B, H, T, T]`, the dropout mask).
    fn masked_reference(qkv: Tensor<3>, heads: usize, factors: &[f32]) -> Tensor<3> {
        let [b, t, d3] = qkv.dims();
        let (d, on) = (d3 / 3, qkv.device());
        let k = d / heads;
        let part = |i: usize| {
            qkv.clone()
                .slice([0..b, 0..t, i * d..(i + 1) * d])
                .reshape([b, t, heads, k])
                .swap_dims(1, 2)
        };
        let (q, kk, v) = (part(0), part(1), part(2));
        let scale = 1.0 / (k as f64).sqrt();
        let weights = crate::causal_softmax_reference(q.matmul(kk.swap_dims(2, 3)), scale);
        let mask = burn::tensor::TensorData::new(factors.to_vec(), [b, heads, t, t]);
        (weights * Tensor::<4>::from_data(mask, &on))
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([b, t, d])
    }

    /// Queries over a cache's whole buffer against the reference (scores, mask by position,
    /// softmax): the queries a view with heads swapped in (as the model passes them), every
    /// buffer row filled (rows past `start + T` must be hidden by position alone), first step,
    /// middle and last rows of the buffer, one query and several.
    #[test]
    fn cached_attention_equals_the_reference_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(0.0, 1.0);
        for (b, heads, head, capacity, start, t) in [
            (2, 2, 8, 32, 0, 1),
            (1, 3, 16, 32, 5, 3),
            (2, 2, 8, 32, 29, 3),
            (1, 1, 4, 7, 6, 1),
            (1, 2, 64, 300, 250, 2),
            // A batch of long prompts: more query rows (66,560) than a launch has cubes a side.
            (64, 4, 8, 300, 0, 260),
        ] {
            let q = Tensor::<4>::random([b, t, heads, head], normal, &device).swap_dims(1, 2);
            let k = Tensor::<4>::random([b, heads, capacity, head], normal, &device) * 2.0;
            let v = Tensor::<4>::random([b, heads, capacity, head], normal, &device);
            let fast = cached_causal_attention(q.clone(), k.clone(), v.clone(), start)
                .expect("plain wgpu f32 tensors");
            // The same with the position read from a device tensor (a replayed step).
            let position = Tensor::<1, Int>::from_ints([start as i32], &device);
            let at = cached_causal_attention_at(q.clone(), k.clone(), v.clone(), &position)
                .expect("plain wgpu f32 tensors");
            let reference = crate::cached_causal_attention_reference(q, k, v, start, None);
            let diff = (fast - reference.clone()).abs().max().into_scalar::<f32>();
            assert!(
                diff < 1e-5,
                "{b}x{heads}x{head}, start {start}, {t} rows: {diff}"
            );
            let diff = (at - reference).abs().max().into_scalar::<f32>();
            assert!(diff < 1e-5, "at {start}, {t} rows: {diff}");
        }
        // Tracked tensors go back to the caller (decoding is never differentiated).
        let tracked = device.clone().autodiff();
        let x = Tensor::<4>::random([1, 1, 1, 4], normal, &tracked);
        assert!(cached_causal_attention(x.clone(), x.clone(), x, 0).is_err());
    }

    /// Mixed precision's f16 projection under autodiff (lavapipe has no bf16; the path is the
    /// same): the kernels take it, the output is f16, the f32 kernels' output on the same values
    /// rounded once; the projection's gradient comes back through the f16 op near the f32 one.
    #[test]
    fn a_narrow_projection_stays_narrow_and_is_computed_in_f32_on_wgpu() {
        use burn::tensor::FloatDType;
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let (b, t, heads, k) = (2, 45, 3, 8);
        let d = heads * k;
        let (x, g) = (
            f16_exact([b, t, 3 * d], &device),
            f16_exact([b, t, d], &device),
        );
        let leaf = |data| Tensor::<3>::from_data(data, &device).require_grad();
        let (narrow_in, wide_in) = (leaf(x.clone()), leaf(x));
        let narrow = causal_self_attention(narrow_in.clone().cast(FloatDType::F16), heads, 0.0)
            .unwrap_or_else(|_| panic!("the kernels take an f16 projection under autodiff"));
        assert_eq!(narrow.dtype(), DType::F16);
        let wide = causal_self_attention(wide_in.clone(), heads, 0.0).expect("f32");
        narrow.clone().cast(FloatDType::F32).into_data().assert_eq(
            &wide
                .clone()
                .cast(FloatDType::F16)
                .cast(FloatDType::F32)
                .into_data(),
            true,
        );
        let weights = Tensor::<3>::from_data(g, &device);
        let loss = |y: Tensor<3>| (y.cast(FloatDType::F32) * weights.clone()).sum();
        let (gn, gw) = (loss(narrow).backward(), loss(wide).backward());
        let (gn, gw) = (narrow_in.grad(&gn).unwrap(), wide_in.grad(&gw).unwrap());
        let scale = gw.clone().abs().max().into_scalar::<f32>();
        let diff = (gn - gw).abs().max().into_scalar::<f32>();
        assert!(
            diff < 5e-3 * scale,
            "gradient off by {diff} (scale {scale})"
        );
    }

    /// Normal random values that f16 holds exactly, so that an f16 path and an f32 one start
    /// from the same numbers.
    fn f16_exact(dims: [usize; 3], device: &Device) -> burn::tensor::TensorData {
        use burn::tensor::FloatDType;
        Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), device)
            .cast(FloatDType::F16)
            .cast(FloatDType::F32)
            .into_data()
    }

    /// The kernels' dropout factors `[B, H, T, T]` (0 or `1 / (1 - p)`), computed on the host.
    fn dropout_factors(b: usize, heads: usize, t: usize, seed: f32, p: f32) -> Vec<f32> {
        crate::cube::hashed_mask::host_factors(seed, p, b * heads * t * t)
    }

    /// With dropout: output and gradient against the reference with the same mask applied to
    /// its weights (the mask rebuilt on the host from the kernels' hash), on wgpu plain, under
    /// autodiff and with checkpointing, one block of rows and two; and the mask drops about `p`
    /// of the weights.
    #[test]
    fn dropout_equals_the_reference_with_the_same_mask() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let (seed, p) = (0.6180339_f32, 0.25_f32);
        for (b, t, heads, k) in [(2, 9, 3, 4), (1, 45, 2, 16), (1, 70, 2, 8)] {
            agrees_with_the_masked_reference(
                &device,
                [b, t, heads, k],
                seed,
                p,
                &format!("dropout {p}, {b}x{t}, {heads} heads of {k}"),
            );
        }
        let factors = dropout_factors(4, 4, 64, seed, p);
        let dropped = factors.iter().filter(|&&f| f == 0.0).count() as f32 / factors.len() as f32;
        assert!(
            (dropped - p).abs() < 0.01,
            "dropped {dropped} of the weights, not {p}"
        );
    }

    /// Through the op layer: a training-mode `Dropout` on an autodiff device drops weights (the
    /// output changes), repeatably under `Device::seed`; on a plain device it does nothing.
    #[test]
    fn dropout_in_training_only_and_repeatable() {
        use burn::nn::DropoutConfig;
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let (heads, dropout) = (2, DropoutConfig::new(0.3).init());
        let none = DropoutConfig::new(0.0).init();
        let x = Tensor::<3>::random([2, 17, 3 * 16], Distribution::Normal(0.0, 1.0), &device)
            .into_data();
        let run = |device: &Device, dropout: &burn::nn::Dropout, seed: u64| {
            device.seed(seed);
            let qkv = Tensor::<3>::from_data(x.clone(), device);
            crate::causal_self_attention(qkv, heads, dropout)
                .expect("kernels take wgpu")
                .into_data()
        };
        let tracked = device.clone().autodiff();
        let plain = run(&tracked, &none, 1);
        let (a, again, other) = (
            run(&tracked, &dropout, 1),
            run(&tracked, &dropout, 1),
            run(&tracked, &dropout, 2),
        );
        a.assert_eq(&again, true);
        assert_ne!(a, plain, "dropout changed nothing");
        assert_ne!(a, other, "another seed, the same mask");
        run(&device, &dropout, 1).assert_approx_eq::<f32>(&plain, Default::default());
    }
}
