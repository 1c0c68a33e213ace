//! The attention op as a backend extension: the trait every backend with the kernels
//! implements (CubeCL's, Burn's fusion over it, autodiff over either), and its CubeCL
//! implementation, which picks the pass's path: cuDNN's flash attention (opt-in), the batched
//! products, or the fused kernels (on tensor cores where the device has matrix fragments of the
//! projection's type, [`super::mma`]).

use super::dims::{Dims, float_cast_to, wide};
use super::launch::{CachedStart, cached_attention, fused_backward, fused_forward};
use super::mma::{mma_backward, mma_forward};
use super::route::on_device_thread;
use super::tune::{Call, Pass, Path, choose, paths};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, TensorMetadata, backend_extension};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

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
pub(super) fn forward_specs(
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
        if let Some(shape) = crate::cube::cudnn_attention::takes(&qkv, heads, dropout) {
            use crate::cube::cudnn_attention::{forward, without_waiting};
            if let Some(done) = without_waiting::forward(&qkv, &seed, &shape) {
                return done;
            }
            if let Some(done) = on_device_thread(&qkv.client, || forward(&qkv, &seed, &shape)) {
                return done;
            }
        }
        let dims = Dims::of(&qkv, heads);
        let paths = paths(&qkv, &dims);
        let call = Call::of(&qkv, &dims, dropout, Pass::Forward);
        let path = choose(call, paths, |path| {
            forward_on(path, &qkv, &seed, heads, dropout);
        });
        forward_on(path, &qkv, &seed, heads, dropout)
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
        // cuDNN's backward pass exactly where its forward pass ran (its dropout mask is not the
        // fused kernels'): the same shape, type and dropout take the same path.
        #[cfg(feature = "cudnn")]
        if let Some(shape) = crate::cube::cudnn_attention::takes(&qkv, heads, dropout) {
            let (out, grad) = (
                into_contiguous(out.clone()),
                float_cast_to::<Self>(grad.clone(), qkv.dtype()),
            );
            use crate::cube::cudnn_attention::{backward, without_waiting};
            if let Some(dqkv) = without_waiting::backward(&qkv, &seed, &out, &lse, &grad, &shape) {
                return dqkv;
            }
            if let Some(dqkv) = on_device_thread(&qkv.client, || {
                backward(&qkv, &seed, &out, &lse, &grad, &shape)
            }) {
                return dqkv;
            }
        }
        let dims = Dims::of(&qkv, heads);
        let out = into_contiguous(out);
        let paths = paths(&qkv, &dims);
        let call = Call::of(&qkv, &dims, dropout, Pass::Backward);
        let path = choose(call, paths, |path| {
            backward_on(path, &qkv, &seed, &out, &lse, &grad, heads, dropout);
        });
        backward_on(path, &qkv, &seed, &out, &lse, &grad, heads, dropout)
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
        cached_attention(q, k, v, CachedStart::Device(crate::cube::ids_i32(position)))
    }
}

/// The forward pass of [`AttentionKernels::causal_self_attention_forward`] on `path`, for a
/// contiguous projection: the output in the projection's type, the log-sum-exps in `f32`.
/// Mixed precision's bf16 (or f16) projection: the batched products and the tensor-core kernels
/// read it as it is; the fused kernels read it widened (a copy that lives for the call), and
/// their output is rounded once to its type.
pub(super) fn forward_on(
    path: Path,
    qkv: &CubeTensor,
    seed: &CubeTensor,
    heads: usize,
    dropout: f32,
) -> (CubeTensor, CubeTensor) {
    match path {
        Path::Products => on_device_thread(&qkv.client, || {
            crate::cube::attention_products::forward(qkv, seed, heads, dropout)
        }),
        Path::Mma(plan) => mma_forward(qkv.clone(), seed.clone(), heads, dropout, plan),
        Path::Fused => {
            let wide_qkv = wide::<CubeBackend>(qkv.clone());
            let (out, lse) = fused_forward(wide_qkv, seed.clone(), heads, dropout);
            (float_cast_to::<CubeBackend>(out, qkv.dtype()), lse)
        }
    }
}

/// The backward pass of [`AttentionKernels::causal_self_attention_backward`] on `path`, for
/// contiguous tensors (the log-sum-exps of any path's forward pass): the projection's gradient
/// in its type, computed from the projection's type by the products and the tensor-core
/// kernels (the output and its gradient taken in that type too), from widened copies by the
/// fused kernels.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_on(
    path: Path,
    qkv: &CubeTensor,
    seed: &CubeTensor,
    out: &CubeTensor,
    lse: &CubeTensor,
    grad: &CubeTensor,
    heads: usize,
    dropout: f32,
) -> CubeTensor {
    let dtype = qkv.dtype();
    let (seed, lse) = (seed.clone(), lse.clone());
    let narrow = |x: &CubeTensor| float_cast_to::<CubeBackend>(x.clone(), dtype);
    match path {
        Path::Products => {
            let grad = narrow(grad);
            on_device_thread(&qkv.client, || {
                crate::cube::attention_products::backward(qkv, &seed, &lse, &grad, heads, dropout)
            })
        }
        Path::Mma(plan) => {
            let [qkv, out, grad] = [qkv, out, grad].map(narrow);
            mma_backward(qkv, seed, out, lse, grad, heads, dropout, plan)
        }
        Path::Fused => {
            let [qkv, out, grad] = [qkv, out, grad].map(|x| wide::<CubeBackend>(x.clone()));
            let dqkv = fused_backward(qkv, seed, out, lse, grad, heads, dropout);
            float_cast_to::<CubeBackend>(dqkv, dtype)
        }
    }
}
