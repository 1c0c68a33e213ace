//! Both GELUs on the GPU: one CubeCL kernel forward and one backward, with their own autodiff
//! op. Burn 0.22.1 builds the exact GELU from five tensor ops (division, erf, addition, two
//! products) and the tanh GELU from about as many, each a kernel launch and a buffer, and
//! autodiff adds as many again backward.
//!
//! Exact: `GELU(x) = x Phi(x) = x/2 (1 + erf(x / sqrt 2))`, derivative `Phi(x) + x phi(x)`.
//! Tanh: `GELU(x) = x/2 (1 + tanh(u))`, `u = sqrt(2/pi) (x + 0.044715 x^3)`, derivative
//! `(1 + tanh u)/2 + x/2 (1 - tanh^2 u) sqrt(2/pi) (1 + 3 0.044715 x^2)`. The references are
//! Burn's `gelu` and `gelu_approximate` (`crate::ops`).

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
use burn::tensor::{DType, Tensor};
use burn::tensor::{bf16, f16};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

/// GELU of `x` (the tanh approximation when `tanh`) where `x` is an `f32` tensor on a CubeCL
/// device, tracked by autodiff or not, or a bf16 or f16 one (mixed precision's MLP hidden layer:
/// computed in `f32`, stored in `x`'s type); `x` back otherwise.
pub(crate) fn gelu<const D: usize>(x: Tensor<D>, tanh: bool) -> Result<Tensor<D>, Tensor<D>> {
    let narrow = matches!(x.dtype(), DType::BF16 | DType::F16)
        && crate::gpu_kernels::uses(GpuKernel::Gelu)
        && crate::on_cubecl(&x.device());
    let takes = narrow || super::gpu_kernel_takes(GpuKernel::Gelu, &x);
    if !takes || x.shape().num_elements() == 0 {
        return Err(x);
    }
    let y = <Dispatch as GeluKernels>::gelu_kernel(x.into_dispatch(), tanh);
    Ok(Tensor::from_dispatch(y))
}

/// The GELU op on every backend that has the kernels: CubeCL's, Burn's fusion over it, and
/// autodiff over either.
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub trait GeluKernels: Backend {
    /// GELU of every element of `x` (the tanh approximation when `tanh`).
    #[fusion(dtype = x, shape = x)]
    fn gelu_kernel(x: FloatTensor<Self>, tanh: bool) -> FloatTensor<Self>;

    /// `grad` times GELU's derivative at `x`, element by element.
    #[fusion(dtype = x, shape = x)]
    fn gelu_kernel_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        tanh: bool,
    ) -> FloatTensor<Self>;
}

impl GeluKernels for CubeBackend {
    fn gelu_kernel(x: CubeTensor, tanh: bool) -> CubeTensor {
        let x = into_contiguous(x);
        let y = empty_like(&x);
        let n = x.shape().num_elements();
        let w = super::elementwise_lanes(&x, n);
        let (count, dim) = super::launch_size(&x, n / w);
        let client = x.client.clone();
        let (xa, ya) = (x.clone().into_tensor_arg(), y.clone().into_tensor_arg());
        let vectors = n / w;
        match x.dtype() {
            DType::F32 => kernels::gelu_forward::launch::<f32>(
                &client, count, dim, w, xa, ya, vectors, w, tanh,
            ),
            DType::BF16 => kernels::gelu_forward::launch::<bf16>(
                &client, count, dim, w, xa, ya, vectors, w, tanh,
            ),
            DType::F16 => kernels::gelu_forward::launch::<f16>(
                &client, count, dim, w, xa, ya, vectors, w, tanh,
            ),
            other => panic!("GELU kernel: f32, bf16 or f16, not {other:?}"),
        }
        y
    }

    fn gelu_kernel_backward(x: CubeTensor, grad: CubeTensor, tanh: bool) -> CubeTensor {
        let [x, grad] = [x, grad].map(into_contiguous);
        assert_eq!(
            x.dtype(),
            grad.dtype(),
            "GELU kernel: x and its gradient of one type"
        );
        let dx = empty_like(&x);
        let n = x.shape().num_elements();
        let w = super::elementwise_lanes(&x, n);
        let (count, dim) = super::launch_size(&x, n / w);
        let client = x.client.clone();
        let args = (
            x.clone().into_tensor_arg(),
            grad.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
        );
        let (xa, ga, da) = args;
        let vectors = n / w;
        match x.dtype() {
            DType::F32 => kernels::gelu_backward::launch::<f32>(
                &client, count, dim, w, xa, ga, da, vectors, w, tanh,
            ),
            DType::BF16 => kernels::gelu_backward::launch::<bf16>(
                &client, count, dim, w, xa, ga, da, vectors, w, tanh,
            ),
            DType::F16 => kernels::gelu_backward::launch::<f16>(
                &client, count, dim, w, xa, ga, da, vectors, w, tanh,
            ),
            other => panic!("GELU kernel: f32, bf16 or f16, not {other:?}"),
        }
        dx
    }
}

impl<B: GeluKernels, C: CheckpointStrategy> GeluKernels for Autodiff<B, C> {
    fn gelu_kernel(x: FloatTensor<Self>, tanh: bool) -> FloatTensor<Self> {
        tracked::<B, C, _, _>(Gelu(tanh), [x], |[x]| (B::gelu_kernel(x.clone(), tanh), x))
    }

    // Not differentiated on its own: only the op above is.
    fn gelu_kernel_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        tanh: bool,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::gelu_kernel_backward(
            Self::inner(x),
            Self::inner(grad),
            tanh,
        ))
    }
}

/// A new contiguous tensor of `x`'s shape and float type.
fn empty_like(x: &CubeTensor) -> CubeTensor {
    burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        x.shape(),
        x.dtype(),
    )
}

/// The autodiff node of the GELU kernels (the tanh approximation when `.0`).
#[derive(Debug)]
struct Gelu(bool);

impl<B: GeluKernels> Backward<B, 1> for Gelu {
    /// The input.
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let x = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::gelu_kernel_backward(x, grad, self.0)
        });
    }
}

pub(crate) mod kernels {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// `1 / sqrt(2)`, `1 / sqrt(2 pi)`, `sqrt(2 / pi)` and the tanh GELU's cubic coefficient.
    const FRAC_1_SQRT_2: f32 = core::f32::consts::FRAC_1_SQRT_2;
    const INV_SQRT_2PI: f32 = 0.398_942_3;
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const CUBIC: f32 = 0.044_715;

    /// `y = GELU(x)`, computed in `f32` whatever `F` stores (a bf16 hidden layer's GELU is
    /// rounded once, as PyTorch computes it); one vector of `w` elements per unit, `vectors`
    /// of them.
    #[cube(launch)]
    pub(super) fn gelu_forward<F: Float, N: Size>(
        x: &Tensor<Vector<F, N>>,
        y: &mut Tensor<Vector<F, N>>,
        vectors: usize,
        #[comptime] w: usize,
        #[comptime] tanh: bool,
    ) {
        let i = ABSOLUTE_POS;
        if i >= vectors {
            terminate!();
        }
        let v = x[i];
        let mut out = v;
        #[unroll]
        for l in 0..w {
            out.insert(
                l,
                F::cast_from(gelu_of::<f32>(f32::cast_from(v.extract(l)), tanh)),
            );
        }
        y[i] = out;
    }

    /// GELU of one value (the tanh approximation when `tanh`); also the few-row linear
    /// kernel's epilogue (`products/few_rows`).
    #[cube]
    pub(crate) fn gelu_of<F: Float>(v: F, #[comptime] tanh: bool) -> F {
        let half = F::new(0.5);
        if tanh {
            let u = F::new(SQRT_2_OVER_PI) * (v + F::new(CUBIC) * v * v * v);
            half * v * (F::new(1.0) + F::tanh(u))
        } else {
            half * v * (F::new(1.0) + F::erf(v * F::new(FRAC_1_SQRT_2)))
        }
    }

    /// `dx = grad * GELU'(x)`, computed in `f32` whatever `F` stores; one vector of `w`
    /// elements per unit, `vectors` of them.
    #[cube(launch)]
    pub(super) fn gelu_backward<F: Float, N: Size>(
        x: &Tensor<Vector<F, N>>,
        grad: &Tensor<Vector<F, N>>,
        dx: &mut Tensor<Vector<F, N>>,
        vectors: usize,
        #[comptime] w: usize,
        #[comptime] tanh: bool,
    ) {
        let i = ABSOLUTE_POS;
        if i >= vectors {
            terminate!();
        }
        let (v, g) = (x[i], grad[i]);
        let mut out = v;
        #[unroll]
        for l in 0..w {
            let slope = gelu_slope::<f32>(f32::cast_from(v.extract(l)), tanh);
            out.insert(l, F::cast_from(f32::cast_from(g.extract(l)) * slope));
        }
        dx[i] = out;
    }

    /// GELU's derivative at `v`.
    #[cube]
    fn gelu_slope<F: Float>(v: F, #[comptime] tanh: bool) -> F {
        let half = F::new(0.5);
        let one = F::new(1.0);
        if tanh {
            let u = F::new(SQRT_2_OVER_PI) * (v + F::new(CUBIC) * v * v * v);
            let t = F::tanh(u);
            let du = F::new(SQRT_2_OVER_PI) * (one + F::new(3.0 * CUBIC) * v * v);
            half * (one + t) + half * v * (one - t * t) * du
        } else {
            let cdf = half * (one + F::erf(v * F::new(FRAC_1_SQRT_2)));
            let pdf = F::new(INV_SQRT_2PI) * F::exp(-half * v * v);
            cdf + v * pdf
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::tensor::{Device, DeviceKind, Distribution, Tensor};

    use crate::check::agrees_on;
    use crate::{gelu, gelu_reference, gelu_tanh, gelu_tanh_reference};

    /// `agrees_on` feeds `exp(x)`, `x ~ N(0, 1)`; the log brings `x` back, spread to `N(-1, 9)`
    /// so both tails are reached.
    fn spread(x: Tensor<3>) -> Tensor<3> {
        x.log() * 3.0 - 1.0
    }

    /// Output and input gradient of the tanh GELU against Burn's (built from tensor ops, so
    /// autodiff differentiates that very formula) on wgpu, plain, under autodiff and with
    /// checkpointing, with a length no cube divides: odd (one value per unit) and a multiple of
    /// 8 (vectors of 4).
    #[test]
    fn tanh_gelu_equals_burns_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(0.0, 1.0);
        for dims in [[3, 37, 41], [3, 37, 40]] {
            let x = Tensor::<3>::random(dims, normal, &device).into_data();
            let g = Tensor::<3>::random(dims, normal, &device).into_data();
            let (ours, burns) = (|x| gelu_tanh(spread(x)), |x| gelu_tanh_reference(spread(x)));
            agrees_on(
                &device,
                &x,
                &g,
                ours,
                burns,
                1e-5,
                &format!("tanh GELU {dims:?}"),
            );
        }
    }

    /// The exact GELU's output against Burn's, and its gradient against `Phi(x) + x phi(x)` in
    /// f64 on the host: Burn's own gradient of its exact GELU on CubeCL backends is the tanh
    /// approximation's derivative (`gelu_backward`'s default, which burn-cubecl does not
    /// override), up to 0.008 off (docs/burn-findings.md).
    #[test]
    fn exact_gelu_equals_burns_and_its_derivative_on_wgpu() {
        for n in [4001, 4000] {
            exact_gelu_on_wgpu(n);
        }
    }

    /// A view starting 64 values into its buffer (contiguous, so read where it lies, in
    /// vectors): Burn's values, forward and backward.
    #[test]
    fn a_view_starting_mid_buffer_equals_burns_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(-1.0, 3.0);
        let x = Tensor::<1>::random([4064], normal, &device).narrow(0, 64, 4000);
        let want = gelu_tanh_reference(x.clone()).into_data();
        gelu_tanh(x.clone())
            .into_data()
            .assert_approx_eq::<f32>(&want, burn::tensor::Tolerance::absolute(1e-5));
        let tracked = device.autodiff();
        let grad = |op: fn(Tensor<1>) -> Tensor<1>| {
            let whole = Tensor::<1>::from_data(x.to_data(), &tracked).require_grad();
            let input = Tensor::cat(vec![whole.clone(), whole.clone()], 0).narrow(0, 64, 4000);
            let grads = op(input).sum().backward();
            whole.grad(&grads).unwrap().into_data()
        };
        grad(gelu_tanh).assert_approx_eq::<f32>(
            &grad(gelu_tanh_reference),
            burn::tensor::Tolerance::absolute(1e-5),
        );
    }

    /// [`exact_gelu_equals_burns_and_its_derivative_on_wgpu`] with `n` values (odd: one per
    /// unit; a multiple of 4: vectors).
    fn exact_gelu_on_wgpu(n: usize) {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(-1.0, 3.0);
        let x = Tensor::<1>::random([n], normal, &device);
        let want = gelu_reference(x.clone())
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let got = gelu(x.clone()).into_data().try_to_vec::<f32>().unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() < 1e-5 * b.abs().max(1.0),
                "value {i}: {a} vs {b}"
            );
        }
        let xs = x.to_data().try_to_vec::<f32>().unwrap();
        for device in [
            device.clone().autodiff(),
            device.autodiff().gradient_checkpointing(),
        ] {
            let input = Tensor::<1>::from_data(x.to_data(), &device).require_grad();
            let grads = gelu(input.clone()).sum().backward();
            let dx = input
                .grad(&grads)
                .unwrap()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap();
            for (&d, &v) in dx.iter().zip(&xs) {
                let v = v as f64;
                let cdf = 0.5 * (1.0 + erf(v / std::f64::consts::SQRT_2));
                let pdf = (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt();
                let want = cdf + v * pdf;
                assert!(
                    (d as f64 - want).abs() < 2e-6,
                    "derivative at {v}: {d} vs {want}"
                );
            }
        }
    }

    /// An f16 input (mixed precision's hidden layer; lavapipe has no bf16, whose path is the
    /// same) takes the kernel and comes out f16: the f32 GELU rounded once, and under autodiff
    /// the gradient `Phi(x) + x phi(x)` times the incoming one, rounded once to f16.
    #[test]
    fn a_narrow_input_is_computed_in_f32_and_rounded_once_on_wgpu() {
        // One value per unit at an odd length; vectors of the device's widest size (4 on
        // lavapipe) at a multiple of 8.
        for n in [4001, 4000] {
            narrow_gelu_on_wgpu(n);
        }
    }

    /// [`a_narrow_input_is_computed_in_f32_and_rounded_once_on_wgpu`] with `n` values.
    fn narrow_gelu_on_wgpu(n: usize) {
        use burn::tensor::{DType, FloatDType};
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(-1.0, 3.0);
        let x = Tensor::<1>::random([n], normal, &device).cast(FloatDType::F16);
        assert!(
            super::gelu(x.clone(), false).is_ok(),
            "the kernel takes f16"
        );
        let y = gelu(x.clone());
        assert_eq!(y.dtype(), DType::F16);
        let wide = |t: Tensor<1>| {
            t.cast(FloatDType::F32)
                .into_data()
                .try_to_vec::<f32>()
                .unwrap()
        };
        let xs = wide(x.clone());
        let (got, want) = (
            wide(y),
            wide(gelu(x.clone().cast(FloatDType::F32)).cast(FloatDType::F16)),
        );
        let ulp = |v: f32| (v.abs().max(6.1e-5)) / 1024.0; // one f16 step at v
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= ulp(*b),
                "value {i} at {}: {a} vs {b}",
                xs[i]
            );
        }
        // The f16 values as an f32 leaf, cast to f16 on the way in (as mixed precision's
        // product is): the gradient comes back through the f16 backward kernel and the cast.
        let tracked = device.autodiff();
        let input = Tensor::<1>::from_data(x.to_data(), &tracked).require_grad();
        let y = gelu(input.clone().cast(FloatDType::F16));
        assert_eq!(y.dtype(), DType::F16);
        let grads = y.mul_scalar(0.5).sum().backward();
        let dx = input.grad(&grads).expect("a gradient");
        for (&d, &v) in wide(dx).iter().zip(&xs) {
            let v = v as f64;
            let cdf = 0.5 * (1.0 + erf(v / std::f64::consts::SQRT_2));
            let pdf = (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let want = (0.5 * (cdf + v * pdf)) as f32;
            // One f16 step, and the f32 sum's own error where its two terms cancel (the
            // derivative's root near -0.75, where f16 steps are tiny).
            assert!(
                (d - want).abs() <= ulp(want) + 2e-7,
                "derivative at {v}: {d} vs {want}"
            );
        }
    }

    /// `erf` in f64 (Abramowitz and Stegun 7.1.26 is too coarse; this is the series and the
    /// continued fraction, accurate to ~1e-15).
    fn erf(x: f64) -> f64 {
        if x.abs() < 3.0 {
            // Maclaurin series.
            let (mut term, mut sum, mut n) = (x, x, 0.0);
            while term.abs() > 1e-17 * sum.abs().max(1e-300) {
                n += 1.0;
                term *= -x * x / n;
                sum += term / (2.0 * n + 1.0);
            }
            2.0 / std::f64::consts::PI.sqrt() * sum
        } else {
            // erfc by its continued fraction (Lentz), far from the origin.
            let z = x.abs();
            let mut f = 0.0;
            for k in (1..60).rev() {
                f = (k as f64 / 2.0) / (z + f);
            }
            let erfc = (-z * z).exp() / std::f64::consts::PI.sqrt() / (z + f);
            x.signum() * (1.0 - erfc)
        }
    }
}
