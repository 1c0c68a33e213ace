//! The gated MLP's `silu(gate) * up` on the GPU (SwiGLU): one CubeCL kernel forward, one
//! backward, with their own autodiff op, over the fused expansion's rows `[gate | up]`. Burn's
//! ops take two slices, a sigmoid, two products and, backward, a zeroed double-width gradient
//! per slice. `silu(g) = g sigmoid(g)`, `silu'(g) = s + g s (1 - s)`; the reference is
//! [`crate::gated_silu_reference`]. SiLU alone runs Burn's ops: a gated MLP never calls it.

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
use burn::tensor::{DType, Shape, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

/// `silu(gate) * up` of the halves of `x`'s last axis where `x` is an `f32` tensor on a CubeCL
/// device, tracked by autodiff or not; `x` back otherwise.
///
/// # Shapes
/// - x: `[..., 2F]`
/// - output: `[..., F]`
pub(crate) fn gated_silu<const D: usize>(x: Tensor<D>) -> Result<Tensor<D>, Tensor<D>> {
    let mut dims = x.dims();
    let f2 = dims[D - 1];
    if !super::gpu_kernel_takes(GpuKernel::Gelu, &x) || f2 == 0 || f2 % 2 == 1 {
        return Err(x);
    }
    let rows = x.shape().num_elements() / f2;
    if rows == 0 {
        return Err(x);
    }
    let y = <Dispatch as GatedKernels>::gated_silu(x.reshape([rows, f2]).into_dispatch());
    dims[D - 1] = f2 / 2;
    Ok(Tensor::<2>::from_dispatch(y).reshape(dims))
}

/// The gate on every backend that has the kernels: CubeCL's, Burn's fusion over it, and
/// autodiff over either.
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub trait GatedKernels: Backend {
    /// `silu(x[:, :F]) * x[:, F:]` of `x` `[R, 2F]`: `[R, F]`.
    #[fusion(meta = half_spec)]
    fn gated_silu(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// The gradient of `x` `[R, 2F]` from the output's `grad` `[R, F]`.
    #[fusion(dtype = x, shape = x)]
    fn gated_silu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
}

#[cfg(feature = "fusion")]
use burn::backend::fusion::custom::TensorSpec;

/// The gate's output: half as wide as its input.
#[cfg(feature = "fusion")]
fn half_spec(x: &TensorSpec) -> TensorSpec {
    let [rows, f2] = x.shape.dims::<2>();
    TensorSpec::new(Shape::new([rows, f2 / 2]), x.dtype)
}

impl GatedKernels for CubeBackend {
    fn gated_silu(x: CubeTensor) -> CubeTensor {
        let x = into_contiguous(x);
        assert_eq!(x.dtype(), DType::F32, "gated SiLU kernel: f32 only");
        let [rows, f2] = x.shape().dims::<2>();
        let f = f2 / 2;
        let y = super::empty(&x, Shape::new([rows, f]));
        let w = super::elementwise_lanes(&x, f).min(super::elementwise_lanes(&y, f));
        let (count, dim) = super::launch_size(&x, rows * f / w);
        kernels::gated_forward::launch::<f32>(
            &x.client.clone(),
            count,
            dim,
            w,
            x.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            f / w,
            rows * f / w,
            w,
        );
        y
    }

    fn gated_silu_backward(x: CubeTensor, grad: CubeTensor) -> CubeTensor {
        let [x, grad] = [x, grad].map(into_contiguous);
        let [rows, f2] = x.shape().dims::<2>();
        let f = f2 / 2;
        let dx = super::empty(&x, Shape::new([rows, f2]));
        let w = super::elementwise_lanes(&x, f).min(super::elementwise_lanes(&grad, f));
        let (count, dim) = super::launch_size(&x, rows * f / w);
        kernels::gated_backward::launch::<f32>(
            &x.client.clone(),
            count,
            dim,
            w,
            x.into_tensor_arg(),
            grad.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            f / w,
            rows * f / w,
            w,
        );
        dx
    }
}

impl<B: GatedKernels, C: CheckpointStrategy> GatedKernels for Autodiff<B, C> {
    fn gated_silu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        tracked::<B, C, _, _>(GatedSilu, [x], |[x]| (B::gated_silu(x.clone()), x))
    }

    // Not differentiated on its own: only the op above is.
    fn gated_silu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::from_inner(B::gated_silu_backward(Self::inner(x), Self::inner(grad)))
    }
}

/// The autodiff node of the gate's kernels.
#[derive(Debug)]
struct GatedSilu;

impl<B: GatedKernels> Backward<B, 1> for GatedSilu {
    /// The input.
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let x = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::gated_silu_backward(x, grad)
        });
    }
}

mod kernels {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// `silu(g) = g sigmoid(g)`.
    #[cube]
    fn silu_of<F: Float>(g: F) -> F {
        g / (F::new(1.0) + F::exp(-g))
    }

    /// `silu'(g) = s + g s (1 - s)`, `s = sigmoid(g)`.
    #[cube]
    fn silu_slope<F: Float>(g: F) -> F {
        let s = F::new(1.0) / (F::new(1.0) + F::exp(-g));
        s + g * s * (F::new(1.0) - s)
    }

    /// One vector of `w` outputs per unit, `vectors` of them, `half` to a row: output vector
    /// `i` of row `r` is `silu(gate) * up` of the row's input vectors `i` and `half + i`.
    #[cube(launch)]
    pub(super) fn gated_forward<F: Float, N: Size>(
        x: &Tensor<Vector<F, N>>,
        y: &mut Tensor<Vector<F, N>>,
        half: usize,
        vectors: usize,
        #[comptime] w: usize,
    ) {
        let i = ABSOLUTE_POS;
        if i >= vectors {
            terminate!();
        }
        let (r, j) = (i / half, i % half);
        let (gate, up) = (x[2 * r * half + j], x[2 * r * half + half + j]);
        let mut out = gate;
        #[unroll]
        for l in 0..w {
            let g = f32::cast_from(gate.extract(l));
            let u = f32::cast_from(up.extract(l));
            out.insert(l, F::cast_from(silu_of::<f32>(g) * u));
        }
        y[i] = out;
    }

    /// The input's gradient from the output's, one output vector per unit: `d_gate = grad up
    /// silu'(gate)`, `d_up = grad silu(gate)`, written where `gate` and `up` were read.
    #[cube(launch)]
    pub(super) fn gated_backward<F: Float, N: Size>(
        x: &Tensor<Vector<F, N>>,
        grad: &Tensor<Vector<F, N>>,
        dx: &mut Tensor<Vector<F, N>>,
        half: usize,
        vectors: usize,
        #[comptime] w: usize,
    ) {
        let i = ABSOLUTE_POS;
        if i >= vectors {
            terminate!();
        }
        let (r, j) = (i / half, i % half);
        let (at_gate, at_up) = (2 * r * half + j, 2 * r * half + half + j);
        let (gate, up, dy) = (x[at_gate], x[at_up], grad[i]);
        let mut d_gate = gate;
        let mut d_up = up;
        #[unroll]
        for l in 0..w {
            let g = f32::cast_from(gate.extract(l));
            let u = f32::cast_from(up.extract(l));
            let d = f32::cast_from(dy.extract(l));
            d_up.insert(l, F::cast_from(d * silu_of::<f32>(g)));
            d_gate.insert(l, F::cast_from(d * u * silu_slope::<f32>(g)));
        }
        dx[at_gate] = d_gate;
        dx[at_up] = d_up;
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::tensor::{Device, DeviceKind, Distribution, Tensor};

    use crate::{gated_silu, gated_silu_reference};

    /// Output and input gradient against the reference on wgpu, plain, under autodiff and with
    /// checkpointing: halves of 48 (vectors of 4), of 5 (one value per unit), and rows that
    /// no cube divides.
    #[test]
    fn gated_silu_equals_its_reference_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        for dims in [[3, 37, 96], [2, 41, 10]] {
            for device in [
                device.clone(),
                device.clone().autodiff(),
                device.clone().autodiff().gradient_checkpointing(),
            ] {
                let tracked = device.is_autodiff();
                let normal = Distribution::Normal(-0.5, 2.0);
                let x = Tensor::<3>::random(dims, normal, &device).into_data();
                let g_dims = [dims[0], dims[1], dims[2] / 2];
                let g = Tensor::<3>::random(g_dims, normal, &device);
                let run = |ours: bool| {
                    let input = Tensor::<3>::from_data(x.clone(), &device);
                    let input = if tracked { input.require_grad() } else { input };
                    assert!(crate::cube::gpu_kernel_takes(
                        crate::GpuKernel::Gelu,
                        &input
                    ));
                    let y = match ours {
                        true => gated_silu(input.clone()),
                        false => gated_silu_reference(input.clone()),
                    };
                    let mut out = vec![y.clone().inner().reshape([-1])];
                    if tracked {
                        let grads = (y * g.clone()).sum().backward();
                        out.push(input.grad(&grads).unwrap().reshape([-1]));
                    }
                    out
                };
                for (i, (a, b)) in run(true).into_iter().zip(run(false)).enumerate() {
                    let diff = (a - b).abs().max().into_scalar::<f32>();
                    assert!(
                        diff < 1e-5,
                        "{dims:?}, tracked {tracked}, output {i}: {diff}"
                    );
                }
            }
        }
    }
}
