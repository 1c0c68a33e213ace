//! Dropout on the GPU: one CubeCL kernel that multiplies each element by its factor of a hashed
//! mask ([`super::hashed_mask`]), with its own autodiff op whose backward pass is the same kernel
//! on the gradient (dropout is linear in its input), the mask computed again from the seed.
//!
//! Burn's `Dropout` draws a Bernoulli tensor from the device's random numbers and multiplies
//! twice (by the mask, then by `1 / (1 - p)`): three launches forward, two backward, and under
//! autodiff the `f32` mask and the input are kept for the backward pass. Here: one launch each
//! way, and nothing kept but the seed. The reference is Burn's `Dropout::forward`
//! (`crate::dropout_reference`); the masks differ (another random stream), so the tests
//! hold the kernel to the reference's arithmetic with the kernel's own mask rebuilt on the host.

use crate::GpuKernel;
use crate::cube::autodiff::tracked;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, TensorMetadata, backend_extension,
};
use burn::nn::Dropout;
use burn::tensor::{DType, Device, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

/// `dropout` applied to `x` where it drops at all (in training: its flag on, `x` tracked by
/// autodiff, a probability above 0) and `x` is an `f32` tensor on a CubeCL device; `x` back
/// otherwise.
///
/// # Shapes
/// - x: any
/// - output: same as x
pub(crate) fn dropout<const D: usize>(
    dropout: &Dropout,
    x: Tensor<D>,
) -> Result<Tensor<D>, Tensor<D>> {
    if !dropout.training.is_enabled() || !x.device().is_autodiff() {
        return Err(x);
    }
    seeded(x, dropout.prob, super::hashed_mask::draw_seed)
}

/// Whether the kernel drops `x` with probability `p`: a probability strictly between 0 and 1
/// and a non-empty `f32` tensor on a CubeCL device, with the dropout kernel on.
fn takes<const D: usize>(x: &Tensor<D>, p: f64) -> bool {
    p > 0.0
        && p < 1.0
        && x.shape().num_elements() > 0
        && super::gpu_kernel_takes(GpuKernel::Dropout, x)
}

/// [`dropout`] with probability `p` and the seed drawn by `seed` on the tensor's device (a
/// uniform number in `[0, 1)`), drawn only where the kernel takes the tensor.
fn seeded<const D: usize>(
    x: Tensor<D>,
    p: f64,
    seed: impl FnOnce(&Device) -> Tensor<1>,
) -> Result<Tensor<D>, Tensor<D>> {
    if !takes(&x, p) {
        return Err(x);
    }
    let seed = seed(&x.device()).into_dispatch();
    let y = <Dispatch as DropoutKernels>::dropout_kernel(x.into_dispatch(), seed, p as f32);
    Ok(Tensor::from_dispatch(y))
}

/// `x + dropout(y)` in one kernel (the residual sum of a sub-layer's dropped output) where
/// [`dropout`] would take `y` and `x` is an `f32` tensor of `y`'s shape on its device; `(x, y)`
/// back otherwise.
///
/// # Shapes
/// - x, y: any, the same
/// - output: same as x
#[allow(clippy::type_complexity)]
pub(crate) fn add_dropout<const D: usize>(
    x: Tensor<D>,
    dropout: &Dropout,
    y: Tensor<D>,
) -> Result<Tensor<D>, (Tensor<D>, Tensor<D>)> {
    let p = dropout.prob;
    let fits = dropout.training.is_enabled()
        && y.device().is_autodiff()
        && x.shape() == y.shape()
        && x.device() == y.device()
        && takes(&y, p)
        && takes(&x, p);
    if !fits {
        return Err((x, y));
    }
    let seed = super::hashed_mask::draw_seed(&y.device()).into_dispatch();
    let out = <Dispatch as DropoutKernels>::add_dropout_kernel(
        x.into_dispatch(),
        y.into_dispatch(),
        seed,
        p as f32,
    );
    Ok(Tensor::from_dispatch(out))
}

/// The dropout op on every backend that has the kernel: CubeCL's, Burn's fusion over it, and
/// autodiff over either.
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub trait DropoutKernels: Backend {
    /// `x` times the factors of the mask of `seed` (its first element), dropping with
    /// probability `p`.
    #[fusion(dtype = x, shape = x)]
    fn dropout_kernel(x: FloatTensor<Self>, seed: FloatTensor<Self>, p: f32) -> FloatTensor<Self>;

    /// `x + y` times the factors of the mask of `seed` (`x` and `y` of one shape).
    #[fusion(dtype = x, shape = x)]
    fn add_dropout_kernel(
        x: FloatTensor<Self>,
        y: FloatTensor<Self>,
        seed: FloatTensor<Self>,
        p: f32,
    ) -> FloatTensor<Self>;
}

impl DropoutKernels for CubeBackend {
    fn dropout_kernel(x: CubeTensor, seed: CubeTensor, p: f32) -> CubeTensor {
        launch(None, x, seed, p)
    }

    fn add_dropout_kernel(x: CubeTensor, y: CubeTensor, seed: CubeTensor, p: f32) -> CubeTensor {
        launch(Some(x), y, seed, p)
    }
}

/// The kernel on `y` (`f32`): `residual + y * factor` where there is a residual, `y * factor`
/// otherwise.
fn launch(residual: Option<CubeTensor>, y: CubeTensor, seed: CubeTensor, p: f32) -> CubeTensor {
    let y = into_contiguous(y);
    let residual = residual.map(into_contiguous);
    let f32s = y.dtype() == DType::F32 && residual.as_ref().is_none_or(|r| r.dtype() == DType::F32);
    assert!(f32s, "dropout kernel: f32 only");
    let out = super::empty(&y, y.shape());
    let n = y.shape().num_elements();
    let w = match &residual {
        Some(r) => super::elementwise_lanes(&y, n).min(super::elementwise_lanes(r, n)),
        None => super::elementwise_lanes(&y, n),
    };
    let (count, dim) = super::launch_size(&y, n / w);
    let has_residual = residual.is_some();
    // Without a residual the kernel never reads its `residual`: `y` stands in.
    let residual = residual.unwrap_or_else(|| y.clone());
    kernel::dropout::launch::<f32>(
        &y.client.clone(),
        count,
        dim,
        w,
        residual.into_tensor_arg(),
        y.into_tensor_arg(),
        seed.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        super::hashed_mask::threshold(p),
        1.0 / (1.0 - p),
        n / w,
        w,
        has_residual,
    );
    out
}

impl<B: DropoutKernels, C: CheckpointStrategy> DropoutKernels for Autodiff<B, C> {
    fn dropout_kernel(x: FloatTensor<Self>, seed: FloatTensor<Self>, p: f32) -> FloatTensor<Self> {
        let seed = Self::inner(seed);
        tracked::<B, C, _, _>(HashedDropout, [x], |[x]| {
            (B::dropout_kernel(x, seed.clone(), p), (seed, p))
        })
    }

    fn add_dropout_kernel(
        x: FloatTensor<Self>,
        y: FloatTensor<Self>,
        seed: FloatTensor<Self>,
        p: f32,
    ) -> FloatTensor<Self> {
        let seed = Self::inner(seed);
        tracked::<B, C, _, _>(AddHashedDropout, [x, y], |[x, y]| {
            (B::add_dropout_kernel(x, y, seed.clone(), p), (seed, p))
        })
    }
}

/// The autodiff node of the residual sum with dropout: the gradient goes to `x` as it is and
/// to `y` through the mask.
#[derive(Debug)]
struct AddHashedDropout;

impl<B: DropoutKernels> Backward<B, 2> for AddHashedDropout {
    /// The seed and the probability.
    type State = (FloatTensor<B>, f32);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (seed, p) = ops.state;
        let [x_node, y_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = y_node {
            grads.register::<B>(node.id, B::dropout_kernel(grad.clone(), seed, p));
        }
        if let Some(node) = x_node {
            grads.register::<B>(node.id, grad);
        }
    }
}

/// The autodiff node of the dropout kernel.
#[derive(Debug)]
struct HashedDropout;

impl<B: DropoutKernels> Backward<B, 1> for HashedDropout {
    /// The seed and the probability.
    type State = (FloatTensor<B>, f32);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (seed, p) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::dropout_kernel(grad, seed, p)
        });
    }
}

mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use crate::cube::hashed_mask::Mask;

    /// One unit per vector of `w` elements (`vectors` of them): `out[e] = y[e] * factor(e)`,
    /// plus `residual[e]` where `has_residual`.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dropout<F: Float, N: Size>(
        residual: &Tensor<Vector<F, N>>,
        y: &Tensor<Vector<F, N>>,
        seed: &Tensor<F>,
        out: &mut Tensor<Vector<F, N>>,
        threshold: u32,
        keep_scale: f32,
        vectors: usize,
        #[comptime] w: usize,
        #[comptime] has_residual: bool,
    ) {
        let i = ABSOLUTE_POS;
        if i >= vectors {
            terminate!();
        }
        let mask = Mask::<F>::new(seed, threshold, keep_scale, true);
        let v = y[i];
        let mut dropped = v;
        #[unroll]
        for l in 0..w {
            dropped.insert(l, v.extract(l) * mask.factor(i * w + l, true));
        }
        if has_residual {
            dropped += residual[i];
        }
        out[i] = dropped;
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn::nn::DropoutConfig;
    use burn::tensor::{DeviceKind, Distribution, TensorData};

    /// Output and input gradient against the reference's arithmetic (`x * mask`) with the
    /// kernel's mask rebuilt on the host, under autodiff and with checkpointing, through a graph
    /// (`exp` before); the mask drops about `p`; a plain device is not dropped.
    #[test]
    fn equals_the_reference_with_the_same_mask_on_wgpu() {
        let base = Device::wgpu(DeviceKind::DefaultDevice);
        let (seed, p) = (0.381_966_f32, 0.2_f32);
        let dims = [3, 50, 70];
        let n = dims.iter().product::<usize>();
        let factors = crate::cube::hashed_mask::host_factors(seed, p, n);
        let normal = Distribution::Normal(0.0, 1.0);
        let x = Tensor::<3>::random(dims, normal, &base).into_data();
        let g = Tensor::<3>::random(dims, normal, &base).into_data();
        for device in [
            base.clone().autodiff(),
            base.clone().autodiff().gradient_checkpointing(),
        ] {
            let run = |ours: bool| {
                let input = Tensor::<3>::from_data(x.clone(), &device).require_grad();
                let h = input.clone().exp();
                let out = if ours {
                    let seed = |on: &Device| Tensor::<1>::from_floats([seed], on);
                    seeded(h, p as f64, seed).expect("a tracked wgpu f32 tensor")
                } else {
                    let mask = TensorData::new(factors.clone(), dims);
                    h * Tensor::<3>::from_data(mask, &device)
                };
                let grads = (out.clone() * Tensor::from_data(g.clone(), &device))
                    .sum()
                    .backward();
                (out.inner(), input.grad(&grads).expect("a gradient"))
            };
            let ((y, dx), (y_ref, dx_ref)) = (run(true), run(false));
            for (what, a, b) in [("output", y, y_ref), ("gradient", dx, dx_ref)] {
                let diff = (a - b).abs().max().into_scalar::<f32>();
                assert!(diff < 1e-5, "{device:?}, {what}: {diff}");
            }
        }
        let dropped = factors.iter().filter(|&&f| f == 0.0).count() as f32 / n as f32;
        assert!((dropped - p).abs() < 0.01, "dropped {dropped}, not {p}");
        let plain = Tensor::<3>::from_data(x, &base);
        let module = DropoutConfig::new(0.5).init();
        assert!(
            dropout(&module, plain).is_err(),
            "a plain device is not dropped"
        );
    }

    /// The residual sum with dropout in one kernel against `x + dropout(y)` with the same seed
    /// (the first of a freshly seeded pool): output and both gradients equal to the bit, under
    /// autodiff and with checkpointing; a plain device (evaluation) is the sum alone.
    #[test]
    fn the_residual_sum_equals_dropout_then_add_on_wgpu() {
        let base = Device::wgpu(DeviceKind::DefaultDevice);
        let module = DropoutConfig::new(0.2).init();
        let dims = [3, 50, 70];
        let normal = Distribution::Normal(0.0, 1.0);
        let (x, y, g) = (
            Tensor::<3>::random(dims, normal, &base).into_data(),
            Tensor::<3>::random(dims, normal, &base).into_data(),
            Tensor::<3>::random(dims, normal, &base).into_data(),
        );
        for device in [
            base.clone().autodiff(),
            base.clone().autodiff().gradient_checkpointing(),
        ] {
            let run = |fused: bool| {
                let a = Tensor::<3>::from_data(x.clone(), &device).require_grad();
                let b = Tensor::<3>::from_data(y.clone(), &device).require_grad();
                let (a2, b2) = (a.clone().exp(), b.clone().sin());
                crate::seed_random(&device, 9);
                let out = match fused {
                    true => add_dropout(a2, &module, b2).expect("tracked wgpu f32 tensors"),
                    false => a2 + crate::dropout(&module, b2),
                };
                let grads = (out.clone() * Tensor::from_data(g.clone(), &device))
                    .sum()
                    .backward();
                [
                    out.inner(),
                    a.grad(&grads).unwrap(),
                    b.grad(&grads).unwrap(),
                ]
                .map(|t| t.into_data())
            };
            // Burn's CubeCL backends keep one generator for the process (see below): a test
            // drawing beside this one may change a mask; equal runs show in one of three tries.
            let equal = (0..3).any(|_| {
                let (fused, apart) = (run(true), run(false));
                fused.iter().zip(&apart).all(|(f, a)| f == a)
            });
            assert!(
                equal,
                "{device:?}: the fused sum differs from dropout then add"
            );
        }
        let plain = Tensor::<3>::from_data(x.clone(), &base);
        assert!(add_dropout(plain.clone(), &module, plain).is_err());
    }

    /// Through the op layer with a `Dropout` module on an autodiff device: repeatable under
    /// `Device::seed`, another seed another mask, about `p` of a tensor of ones zeroed and the
    /// rest scaled to `1 / (1 - p)`; at probability 0 the input comes back unchanged.
    #[test]
    fn drops_in_training_repeatably() {
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let module = DropoutConfig::new(0.3).init();
        let run = |seed: u64| {
            crate::seed_random(&device, seed);
            let ones = Tensor::<2>::ones([64, 100], &device);
            crate::dropout(&module, ones).inner().into_data()
        };
        // Burn's CubeCL backends keep one random generator for the process: a test drawing
        // beside this one between `seed` and the op's own draw changes the mask. A repeatable
        // mask shows it in one of three tries; a mask that is not repeatable, in none.
        let repeatable = (0..3).any(|_| run(1) == run(1));
        assert!(repeatable, "the same seed, another mask, three times");
        let (a, other) = (run(1), run(2));
        assert_ne!(a, other, "another seed, the same mask");
        let values = a.try_to_vec::<f32>().unwrap();
        let zeroed = values.iter().filter(|&&v| v == 0.0).count() as f32 / values.len() as f32;
        assert!((zeroed - 0.3).abs() < 0.03, "zeroed {zeroed}");
        assert!(
            values
                .iter()
                .all(|&v| v == 0.0 || (v - 1.0 / 0.7).abs() < 1e-6),
            "kept values are scaled by 1 / (1 - p)"
        );
        let none = DropoutConfig::new(0.0).init();
        let x = Tensor::<2>::ones([4, 4], &device);
        assert!(
            dropout(&none, x).is_err(),
            "probability 0 is the reference's"
        );
    }
}
