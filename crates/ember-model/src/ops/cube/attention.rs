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
//! The training kernels keep one row's accumulator in registers (`K` values, the head size, a
//! compile-time constant; the key and value gradients in two launches, so one row each) and read
//! keys and values from global memory; units of one cube read the same keys at the same time.
//! Tiling through shared memory is the next step for speed on large GPUs (on an H100 the three
//! take about a third of a step of nanoGPT's GPU config; docs/benchmarks.md). Decoding has too
//! few query rows for one unit each, so its kernel gives each query row a cube.

use crate::ops::GpuKernel;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, TensorMetadata, backend_extension,
};
use burn::tensor::{DType, Device, Distribution, Tensor};
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
    seeded(qkv, heads, dropout, |device| {
        Tensor::<1>::random([1], Distribution::Uniform(0.0, 1.0), device)
    })
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
    if t == 0
        || d3 == 0
        || !super::kernels_take(GpuKernel::Attention, &qkv)
        || !(0.0..1.0).contains(&dropout)
    {
        return Err(qkv);
    }
    assert!(
        d3 % 3 == 0 && (d3 / 3) % heads == 0,
        "fused attention: {d3} columns do not split into Q, K, V of {heads} heads"
    );
    // Without dropout the kernels never read the seed: any tensor will do.
    let seed = match dropout > 0.0 {
        true => seed(&qkv.device()).into_dispatch(),
        false => qkv.clone().into_dispatch(),
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
        let (count, dim) = dims.launch_size(&qkv);
        kernels::attention_forward::launch::<f32>(
            &qkv.client.clone(),
            count,
            dim,
            qkv.into_tensor_arg(),
            seed.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            dims.scale(),
            dropout_threshold(dropout),
            1.0 / (1.0 - dropout),
            dims.k(),
            heads,
            dropout > 0.0,
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
        let (count, dim) = dims.launch_size(&qkv);
        kernels::attention_backward_query::launch::<f32>(
            &client,
            count.clone(),
            dim,
            qkv.clone().into_tensor_arg(),
            seed.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dqkv.clone().into_tensor_arg(),
            dims.scale(),
            dropout_threshold(dropout),
            1.0 / (1.0 - dropout),
            dims.k(),
            heads,
            dropout > 0.0,
        );
        // Keys, then values: two launches of one kernel, each with one row of accumulators
        // per unit (with both, 2K accumulators per unit spilled out of registers on an H100:
        // 18 ms a launch against 1.3 ms for the queries' kernel; docs/benchmarks.md).
        for values in [false, true] {
            kernels::attention_backward_key_value::launch::<f32>(
                &client,
                count.clone(),
                dim,
                qkv.clone().into_tensor_arg(),
                seed.clone().into_tensor_arg(),
                grad.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                dqkv.clone().into_tensor_arg(),
                dims.scale(),
                dropout_threshold(dropout),
                1.0 / (1.0 - dropout),
                dims.k(),
                heads,
                dropout > 0.0,
                values,
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
        let [b, heads, t, head] = q.shape().dims::<4>();
        assert_eq!(q.dtype(), DType::F32, "cached attention kernel: f32 only");
        let capacity = k.shape().dims::<4>()[2];
        let out = super::empty(&q, [b, heads, t, head]);
        // One cube per query row: a token's step has one query row per head, too few rows to
        // keep a GPU busy with one unit each (measured on an H100: 350 us per layer and token).
        kernels::cached_attention::launch::<f32>(
            &q.client.clone(),
            CubeCount::new_1d((b * heads * t) as u32),
            CubeDim::new_1d(CACHED_UNITS as u32),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            start as u32,
            1.0 / (head as f32).sqrt(),
            head,
            capacity,
            CACHED_UNITS,
        );
        out
    }
}

impl<B: AttentionKernels, C: CheckpointStrategy> AttentionKernels for Autodiff<B, C> {
    fn causal_self_attention(
        qkv: FloatTensor<Self>,
        seed: FloatTensor<Self>,
        heads: usize,
        dropout: f32,
    ) -> FloatTensor<Self> {
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
                let qkv = qkv.into_primitive();
                prep.finish(B::causal_self_attention_forward(qkv, seed, heads, dropout).0)
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
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::causal_self_attention_backward(qkv, seed, out, lse, grad, heads, dropout)
        });
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

    /// One unit per row of every head of every sequence.
    fn launch_size(&self, like: &CubeTensor) -> (CubeCount, CubeDim) {
        super::launch_size(like, self.b * self.heads * self.t)
    }
}

/// The hash threshold for dropping with probability `dropout`: `dropout * 2^32`, rounded.
fn dropout_threshold(dropout: f32) -> u32 {
    (dropout as f64 * 4_294_967_296.0)
        .round()
        .min(u32::MAX as f64) as u32
}

/// The CubeCL kernels (CubeCL's `Tensor`, not Burn's). Loops over a row's `K` columns are
/// unrolled (`K` is a compile-time constant), so the accumulators can stay in registers.
///
/// Dropout (`#[comptime] dropout`; without it the mask is never computed): weight `(r, j)` of
/// query row `r = (b * H + h) * T + i` is kept when `mix(mix(seed) ^ (r * T + j))` is at least
/// `threshold`, and then multiplied by `keep_scale`; `seed` is the first 24 bits of the seed
/// tensor's first value (a uniform number in `[0, 1)`). The log-sum-exp is that of the weights
/// before dropout, so `delta_i = dO_i . O_i` still equals `sum_j P_ij dP_ij` with the mask in
/// `dP`.
mod kernels {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use crate::ops::cube::reduce_cube;

    /// Chris Wellons' `lowbias32` integer hash (a bijection of `u32`).
    #[cube]
    pub(super) fn mix(x: u32) -> u32 {
        let mut x = x;
        x ^= x >> 16;
        x *= 0x7feb_352d;
        x ^= x >> 15;
        x *= 0x846c_a68b;
        x ^= x >> 16;
        x
    }

    /// The dropout mask of one kernel call.
    #[derive(CubeType, Clone, Copy)]
    struct Mask<F: Float> {
        /// The seed's 24 bits, hashed.
        seed: u32,
        threshold: u32,
        keep_scale: F,
    }

    #[cube]
    impl<F: Float> Mask<F> {
        fn new(
            seed: &Tensor<F>,
            threshold: u32,
            keep_scale: f32,
            #[comptime] dropout: bool,
        ) -> Mask<F> {
            let mut hashed = 0u32;
            if dropout {
                hashed = mix(u32::cast_from(seed[0] * F::new(16_777_216.0)));
            }
            Mask::<F> {
                seed: hashed,
                threshold,
                keep_scale: F::cast_from(keep_scale),
            }
        }

        /// What weight `index` is multiplied by: 1 without dropout, else 0 or `keep_scale`.
        fn factor(&self, index: usize, #[comptime] dropout: bool) -> F {
            let mut factor = F::new(1.0);
            if dropout {
                factor = F::new(0.0);
                if mix(self.seed ^ (index as u32)) >= self.threshold {
                    factor = self.keep_scale;
                }
            }
            factor
        }
    }

    /// Where row `row = (b * H + h) * T + r` of a training kernel reads and writes: `r`, and
    /// the offsets of row 0 of its head's Q, K and V columns in `[B, T, 3D]` and of its output
    /// columns in `[B, T, D]` (row `n` of each is `3D` or `D` further per row).
    #[derive(CubeType, Clone, Copy)]
    struct Head {
        r: usize,
        q0: usize,
        k0: usize,
        v0: usize,
        o0: usize,
    }

    #[cube]
    fn head_of(row: usize, t: usize, #[comptime] k: usize, #[comptime] heads: usize) -> Head {
        let d = heads * k;
        let h = (row / t) % heads;
        let b = row / t / heads;
        let q0 = b * t * 3 * d + h * k;
        Head {
            r: row % t,
            q0,
            k0: q0 + d,
            v0: q0 + 2 * d,
            o0: b * t * d + h * k,
        }
    }

    /// `a[ai..ai + k] . b[bi..bi + k]`.
    #[cube]
    fn dot<F: Float>(
        a: &Tensor<F>,
        ai: usize,
        b: &Tensor<F>,
        bi: usize,
        #[comptime] k: usize,
    ) -> F {
        let mut sum = F::new(0.0);
        #[unroll]
        for c in 0..k {
            sum += a[ai + c] * b[bi + c];
        }
        sum
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

    /// Forward pass: one unit per query row `(b, h, i)`, a running softmax over keys `0..=i`.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    pub(super) fn attention_forward<F: Float>(
        qkv: &Tensor<F>,
        seed: &Tensor<F>,
        out: &mut Tensor<F>,
        lse: &mut Tensor<F>,
        scale: f32,
        threshold: u32,
        keep_scale: f32,
        #[comptime] k: usize,
        #[comptime] heads: usize,
        #[comptime] dropout: bool,
    ) {
        let row = ABSOLUTE_POS;
        if row >= lse.len() {
            terminate!();
        }
        let t = qkv.shape(1);
        let d = heads * k;
        let at = head_of(row, t, k, heads);
        let i = at.r;
        let q = at.q0 + i * 3 * d;
        let scale = F::cast_from(scale);
        let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);

        // A running maximum `m`, sum `l` and output `acc` over the keys seen so far.
        let mut m = F::new(0.0);
        let mut l = F::new(0.0);
        let mut acc = Array::<F>::new(k);
        #[unroll]
        for c in 0..k {
            acc[c] = F::new(0.0);
        }
        for j in 0..i + 1 {
            let vj = at.v0 + j * 3 * d;
            let s = dot::<F>(qkv, q, qkv, at.k0 + j * 3 * d, k) * scale;
            let (m_new, correction, p) = online_step::<F>(m, s, j == 0);
            l = l * correction + p;
            let weight = p * mask.factor(row * t + j, dropout);
            #[unroll]
            for c in 0..k {
                acc[c] = acc[c] * correction + weight * qkv[vj + c];
            }
            m = m_new;
        }
        let o = at.o0 + i * d;
        #[unroll]
        for c in 0..k {
            out[o + c] = acc[c] / l;
        }
        lse[row] = m + F::ln(l);
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
        let row = CUBE_POS;
        let u = UNIT_POS_X as usize;
        let t = q.shape(2);
        let heads = q.shape(1);
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

    /// Backward pass, queries: one unit per query row `(b, h, i)` writes `delta_i` and `dQ_i`.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    pub(super) fn attention_backward_query<F: Float>(
        qkv: &Tensor<F>,
        seed: &Tensor<F>,
        out: &Tensor<F>,
        grad: &Tensor<F>,
        lse: &Tensor<F>,
        delta: &mut Tensor<F>,
        dqkv: &mut Tensor<F>,
        scale: f32,
        threshold: u32,
        keep_scale: f32,
        #[comptime] k: usize,
        #[comptime] heads: usize,
        #[comptime] dropout: bool,
    ) {
        let row = ABSOLUTE_POS;
        if row >= lse.len() {
            terminate!();
        }
        let t = qkv.shape(1);
        let d = heads * k;
        let at = head_of(row, t, k, heads);
        let i = at.r;
        let q = at.q0 + i * 3 * d;
        let o = at.o0 + i * d;
        let scale = F::cast_from(scale);
        let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);

        let di = dot::<F>(grad, o, out, o, k);
        delta[row] = di;
        let li = lse[row];
        let mut acc = Array::<F>::new(k);
        #[unroll]
        for c in 0..k {
            acc[c] = F::new(0.0);
        }
        for j in 0..i + 1 {
            let kj = at.k0 + j * 3 * d;
            let s = dot::<F>(qkv, q, qkv, kj, k) * scale;
            let dp = dot::<F>(grad, o, qkv, at.v0 + j * 3 * d, k);
            let ds = F::exp(s - li) * (dp * mask.factor(row * t + j, dropout) - di);
            #[unroll]
            for c in 0..k {
                acc[c] += ds * qkv[kj + c];
            }
        }
        #[unroll]
        for c in 0..k {
            dqkv[q + c] = acc[c] * scale;
        }
    }

    /// Backward pass, keys or values (`#[comptime] values`): one unit per key row `(b, h, j)`
    /// writes `dK_j` or `dV_j`, over queries `i = T-1` down to `j` (after
    /// [`attention_backward_query`], whose `delta` it reads).
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    pub(super) fn attention_backward_key_value<F: Float>(
        qkv: &Tensor<F>,
        seed: &Tensor<F>,
        grad: &Tensor<F>,
        lse: &Tensor<F>,
        delta: &Tensor<F>,
        dqkv: &mut Tensor<F>,
        scale: f32,
        threshold: u32,
        keep_scale: f32,
        #[comptime] k: usize,
        #[comptime] heads: usize,
        #[comptime] dropout: bool,
        #[comptime] values: bool,
    ) {
        let row = ABSOLUTE_POS;
        if row >= lse.len() {
            terminate!();
        }
        let t = qkv.shape(1);
        let d = heads * k;
        let at = head_of(row, t, k, heads);
        let j = at.r;
        let kj = at.k0 + j * 3 * d;
        let vj = at.v0 + j * 3 * d;
        let first = row - j; // query row 0 of this (b, h)
        let scale = F::cast_from(scale);
        let mask = Mask::<F>::new(seed, threshold, keep_scale, dropout);

        let mut acc = Array::<F>::new(k);
        #[unroll]
        for c in 0..k {
            acc[c] = F::new(0.0);
        }
        // Latest query first: the units of a warp hold consecutive keys `j`, and this way they
        // read the same query row at each step (one broadcast load, not one load per unit as
        // when each unit starts at its own `j`), until the earlier keys' units drop out.
        for step in 0..t - j {
            let i = t - 1 - step;
            let q = at.q0 + i * 3 * d;
            let o = at.o0 + i * d;
            let s = dot::<F>(qkv, q, qkv, kj, k) * scale;
            let p = F::exp(s - lse[first + i]);
            let factor = mask.factor((first + i) * t + j, dropout);
            if values {
                // dV_j = sum_i P_ij (mask) dO_i
                let w = p * factor;
                #[unroll]
                for c in 0..k {
                    acc[c] += w * grad[o + c];
                }
            } else {
                // dK_j = scale * sum_i dS_ij Q_i, dS_ij = P_ij (dP_ij (mask) - delta_i)
                let dp = dot::<F>(grad, o, qkv, vj, k);
                let ds = p * (dp * factor - delta[first + i]);
                #[unroll]
                for c in 0..k {
                    acc[c] += ds * qkv[q + c];
                }
            }
        }
        #[unroll]
        for c in 0..k {
            if values {
                dqkv[vj + c] = acc[c];
            } else {
                dqkv[kj + c] = acc[c] * scale;
            }
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use crate::ops::check::agrees_on;
    use burn::tensor::{Device, DeviceKind};

    /// Output and the projection's gradient against the op's reference (split heads, masked
    /// softmax, merge: what every other backend runs) on wgpu, plain, under autodiff and with
    /// checkpointing: head sizes 4 to 32, one position and several, lengths that are not a
    /// multiple of a cube's units, one head and several.
    #[test]
    fn equals_the_reference_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        for (b, t, heads, k) in [(2, 9, 3, 4), (1, 1, 2, 7), (3, 37, 2, 16), (2, 70, 1, 32)] {
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
        ] {
            let q = Tensor::<4>::random([b, t, heads, head], normal, &device).swap_dims(1, 2);
            let k = Tensor::<4>::random([b, heads, capacity, head], normal, &device) * 2.0;
            let v = Tensor::<4>::random([b, heads, capacity, head], normal, &device);
            let fast = cached_causal_attention(q.clone(), k.clone(), v.clone(), start)
                .expect("plain wgpu f32 tensors");
            let reference = crate::ops::cached_causal_attention_reference(q, k, v, start, None);
            let diff = (fast - reference).abs().max().into_scalar::<f32>();
            assert!(
                diff < 1e-5,
                "{b}x{heads}x{head}, start {start}, {t} rows: {diff}"
            );
        }
        // Tracked tensors go back to the caller (decoding is never differentiated).
        let tracked = device.clone().autodiff();
        let x = Tensor::<4>::random([1, 1, 1, 4], normal, &tracked);
        assert!(cached_causal_attention(x.clone(), x.clone(), x, 0).is_err());
    }

    /// `kernels::mix` on the host.
    fn mix(mut x: u32) -> u32 {
        x ^= x >> 16;
        x = x.wrapping_mul(0x7feb_352d);
        x ^= x >> 15;
        x = x.wrapping_mul(0x846c_a68b);
        x ^= x >> 16;
        x
    }

    /// The kernels' dropout factors `[B, H, T, T]` (0 or `1 / (1 - p)`), computed on the host.
    fn dropout_factors(b: usize, heads: usize, t: usize, seed: f32, p: f32) -> Vec<f32> {
        let hashed = mix((seed * 16_777_216.0) as u32);
        let threshold = dropout_threshold(p);
        (0..b * heads * t * t)
            .map(|index| {
                let keep = mix(hashed ^ index as u32) >= threshold;
                if keep { 1.0 / (1.0 - p) } else { 0.0 }
            })
            .collect()
    }

    /// With dropout: output and gradient against the reference with the same mask applied to
    /// its weights (the mask rebuilt on the host from the kernels' hash), on wgpu plain, under
    /// autodiff and with checkpointing; and the mask drops about `p` of the weights.
    #[test]
    fn dropout_equals_the_reference_with_the_same_mask() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let (seed, p) = (0.6180339_f32, 0.25_f32);
        for (b, t, heads, k) in [(2, 9, 3, 4), (1, 45, 2, 16)] {
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
