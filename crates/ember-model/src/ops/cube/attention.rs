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
//! [`crate::ops::causal_self_attention_reference`]; the tests below hold the kernels to it on
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
//! Decoding has too few query rows for one unit each, so its kernel gives each query row a
//! cube.

use crate::ops::GpuKernel;
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
        && crate::ops::gpu_kernels::uses(GpuKernel::Attention)
        && crate::ops::on_cubecl(&qkv.device());
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
        let dims = Dims::of(&qkv, heads);
        let out = super::empty(&qkv, [dims.b, dims.t, dims.d]);
        let lse = super::empty(&qkv, [dims.b, heads, dims.t]);
        let (count, dim) = dims.launch_size();
        let tile = dims.tile(&qkv);
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
        );
        (out, lse)
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
        let [qkv, out, lse, grad] = [qkv, out, lse, grad].map(into_contiguous);
        let dims = Dims::of(&qkv, heads);
        let dqkv = super::empty(&qkv, [dims.b, dims.t, 3 * dims.d]);
        let delta = super::empty(&qkv, [dims.b, heads, dims.t]);
        let client = qkv.client.clone();
        let (count, dim) = dims.launch_size();
        let tile = dims.tile(&qkv);
        let w = dims.lanes(&qkv);
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
        // Keys, then values: two launches of one kernel, each with one row of accumulators
        // per unit (with both, 2K accumulators per unit spilled out of registers on an H100:
        // 18 ms a launch against 1.3 ms for the queries' kernel, before the kernels were
        // tiled; docs/benchmarks.md).
        for values in [false, true] {
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
        // A bf16 (or f16) projection, mixed precision's: the kernels read it widened to f32
        // (a copy that lives for the call), and the op keeps it and its output in its own type,
        // the output rounded once, as PyTorch's autocast keeps them.
        let seed = Self::inner(seed);
        let dtype = qkv.dtype();
        match FusedAttention
            .prepare::<C>([qkv.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let qkv = qkv.into_primitive();
                let (out, lse) = B::causal_self_attention_forward(
                    wide::<B>(qkv.clone()),
                    seed.clone(),
                    heads,
                    dropout,
                );
                let out = cast_to::<B>(out, dtype);
                prep.finish((qkv, seed, out.clone(), lse, heads, dropout), out)
            }
            OpsKind::UnTracked(prep) => {
                let qkv = wide::<B>(qkv.into_primitive());
                let out = B::causal_self_attention_forward(qkv, seed, heads, dropout).0;
                prep.finish(cast_to::<B>(out, dtype))
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
        let dtype = qkv.dtype();
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let [qkv, out, grad] = [qkv, out, grad].map(wide::<B>);
            let dqkv = B::causal_self_attention_backward(qkv, seed, out, lse, grad, heads, dropout);
            cast_to::<B>(dqkv, dtype)
        });
    }
}

/// `x` in f32 (itself when it is).
fn wide<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    cast_to::<B>(x, DType::F32)
}

/// `x` in `dtype` (itself when it is).
fn cast_to<B: Backend>(x: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    match x.dtype() == dtype {
        true => x,
        false => B::float_cast(x, burn::tensor::FloatDType::from(dtype)),
    }
}

/// Units of the cached attention's cube (one cube per query row): a power of two.
const CACHED_UNITS: usize = 128;

/// The sizes of one call of the training kernels.
struct Dims {
    b: usize,
    t: usize,
    d: usize,
    heads: usize,
}

impl Dims {
    fn of(qkv: &CubeTensor, heads: usize) -> Self {
        let [b, t, d3] = qkv.shape().dims::<3>();
        assert_eq!(qkv.dtype(), DType::F32, "fused attention kernels: f32 only");
        Dims {
            b,
            t,
            d: d3 / 3,
            heads,
        }
    }

    fn k(&self) -> usize {
        self.d / self.heads
    }

    fn scale(&self) -> f32 {
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

    use crate::ops::cube::hashed_mask::Mask;
    use crate::ops::cube::{cube_row, reduce_cube};

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

    /// One key into a running softmax whose maximum is `m` (`first`: nothing seen yet):
    /// the new maximum, the factor that rescales what was accumulated, and the key's weight.
    #[cube]
    fn online_step<F: Float>(m: F, s: F, first: bool) -> (F, F, F) {
        let mut m_new = s;
        let mut correction = F::new(0.0);
        if !first {
            if m > s {
                m_new = m;
            }
            correction = F::exp(m - m_new);
        }
        (m_new, correction, F::exp(s - m_new))
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
        // A running maximum `m`, sum `l` and output `acc` over the keys seen so far.
        let mut m = F::new(0.0);
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
                for jj in 0..rows_below(j0, i + 1, tile) {
                    let s = dot_tile::<F, N>(&q, &keys, jj, k, w) * scale;
                    let (m_new, correction, p) = online_step::<F>(m, s, j0 + jj == 0);
                    l = l * correction + p;
                    let weight = p * mask.factor(row * t + j0 + jj, dropout);
                    let correction = Vector::<F, N>::new(correction);
                    let weight = Vector::<F, N>::new(weight);
                    #[unroll]
                    for c in 0..k {
                        acc[c] = acc[c] * correction + weight * values[jj * k + c];
                    }
                    m = m_new;
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
    use crate::ops::check::agrees_on;
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
                |qkv| crate::ops::causal_self_attention_reference(qkv, heads),
                1e-4,
                &format!("{b}x{t}, {heads} heads of {k}"),
            );
        }
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
            let reference = crate::ops::cached_causal_attention_reference(q, k, v, start, None);
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
        let normal = Distribution::Normal(0.0, 1.0);
        let (b, t, heads, k) = (2, 45, 3, 8);
        let d = heads * k;
        // Values f16 holds exactly, so both sides start from the same numbers.
        let exact = |dims: [usize; 3]| {
            Tensor::<3>::random(dims, normal, &device)
                .cast(FloatDType::F16)
                .cast(FloatDType::F32)
                .into_data()
        };
        let (x, g) = (exact([b, t, 3 * d]), exact([b, t, d]));
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

    /// The kernels' dropout factors `[B, H, T, T]`    /// The kernels' dropout factors `[B, H, T, T]` (0 or `1 / (1 - p)`), computed on the host.
    fn dropout_factors(b: usize, heads: usize, t: usize, seed: f32, p: f32) -> Vec<f32> {
        crate::ops::cube::hashed_mask::host_factors(seed, p, b * heads * t * t)
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
            let d = heads * k;
            let draw = |dims: [usize; 3]| {
                Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &device).into_data()
            };
            let (x, g) = (draw([b, t, 3 * d]), draw([b, t, d]));
            let factors = dropout_factors(b, heads, t, seed, p);
            agrees_on(
                &device,
                &x,
                &g,
                |qkv| {
                    let seed = |on: &Device| Tensor::<1>::from_floats([seed], on);
                    seeded(qkv, heads, p as f64, seed).expect("a wgpu f32 tensor")
                },
                |qkv| {
                    let on = qkv.device();
                    let part = |i: usize| {
                        qkv.clone()
                            .slice([0..b, 0..t, i * d..(i + 1) * d])
                            .reshape([b, t, heads, k])
                            .swap_dims(1, 2)
                    };
                    let (q, kk, v) = (part(0), part(1), part(2));
                    let scale = 1.0 / (k as f64).sqrt();
                    let weights =
                        crate::ops::causal_softmax_reference(q.matmul(kk.swap_dims(2, 3)), scale);
                    let mask = burn::tensor::TensorData::new(factors.clone(), [b, heads, t, t]);
                    let mask = Tensor::<4>::from_data(mask, &on);
                    (weights * mask)
                        .matmul(v)
                        .swap_dims(1, 2)
                        .reshape([b, t, d])
                },
                1e-4,
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
            crate::ops::causal_self_attention(qkv, heads, dropout)
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
