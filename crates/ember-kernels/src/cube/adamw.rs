//! [`crate::adamw_step`] on the GPU: one CubeCL kernel per parameter, one unit per
//! element, reading the parameter, its gradient and both moments once and writing the three new
//! tensors (Burn's `AdamW` launches about fifteen kernels for the same step without fusion). A
//! gradient scale (global-norm clipping's factor, a `[1]` tensor on the device) multiplies each
//! gradient value as it is read: clipping then launches nothing per gradient beyond its norm.
//! Inside an optimizer step that groups them ([`crate::AdamWGroups`]) three parameters share a
//! launch (`cube/adamw_groups`), with the same element update ([`kernel::update`]).

use crate::GpuKernel;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, TensorMetadata, backend_extension};
use burn::tensor::{DType, Tensor, bf16, f16};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

use crate::adamw::{AdamWInputs, AdamWStep};

/// The step on plain `f32` tensors on a CubeCL device (not tracked by autodiff: optimizers
/// update the inner tensors); the inputs back otherwise.
pub(crate) fn step<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    moments: Option<(Tensor<D>, Tensor<D>)>,
    k: &AdamWStep,
    grad_scale: Option<&Tensor<1>>,
) -> Result<(Tensor<D>, Tensor<D>, Tensor<D>), AdamWInputs<D>> {
    let plain = |t: &Tensor<D>| super::gpu_kernel_takes_plain(GpuKernel::AdamW, t);
    let moments_fit = moments
        .as_ref()
        .is_none_or(|(m1, m2)| plain(m1) && plain(m2));
    let scale_fits = grad_scale.is_none_or(|s| {
        super::gpu_kernel_takes_plain(GpuKernel::AdamW, s) && s.device() == grad.device()
    });
    if param.shape().num_elements() == 0
        || !(plain(&param) && plain(&grad) && moments_fit && scale_fits)
    {
        return Err((param, grad, moments));
    }
    // Before the first step the moments are zero (Burn's first step gives the same values).
    let (m1, m2) = moments.unwrap_or_else(|| (grad.zeros_like(), grad.zeros_like()));
    let has_scale = grad_scale.is_some();
    // Without a scale the kernel never reads its `scale`: the gradient stands in.
    let scale = match grad_scale {
        Some(scale) => scale.clone().into_dispatch(),
        None => grad.clone().into_dispatch(),
    };
    let (p, m1, m2) = <Dispatch as AdamWKernels>::adamw_step(
        param.into_dispatch(),
        grad.into_dispatch(),
        m1.into_dispatch(),
        m2.into_dispatch(),
        scale,
        Scalars::of(k),
        has_scale,
    );
    Ok((
        Tensor::from_dispatch(p),
        Tensor::from_dispatch(m1),
        Tensor::from_dispatch(m2),
    ))
}

/// [`AdamWStep`]'s scalars as kernel arguments (no decay: `keep` 1, which leaves `p` as it is).
#[derive(Debug, Clone, Copy)]
pub struct Scalars([f32; 9]);

impl Scalars {
    /// The scalars as the kernels take them.
    pub(crate) fn values(&self) -> [f32; 9] {
        self.0
    }

    /// Their bits, to compare two steps' scalars exactly.
    pub(crate) fn bits(&self) -> [u32; 9] {
        self.0.map(f32::to_bits)
    }

    fn of(k: &AdamWStep) -> Self {
        Self([
            k.beta_1,
            k.beta_2,
            k.factor_1,
            k.factor_2,
            k.correction_1,
            k.correction_2,
            k.epsilon,
            k.lr,
            k.keep.unwrap_or(1.0),
        ])
    }
}

/// The AdamW op on every backend that has the kernel: CubeCL's and Burn's fusion over it.
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"))]
pub trait AdamWKernels: Backend {
    /// The new parameter, first and second moments from the parameter, its gradient (times
    /// `scale[0]` when `has_scale`) and the moments (all of one shape) after one step with `k`'s
    /// scalars.
    #[fusion(meta = step_specs)]
    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m1: FloatTensor<Self>,
        m2: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        k: Scalars,
        has_scale: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// The outputs' shapes (the parameter's, three times), for fusion (which defers the kernel).
#[cfg(feature = "fusion")]
fn step_specs(
    param: &burn::backend::fusion::custom::TensorSpec,
    _grad: &burn::backend::fusion::custom::TensorSpec,
    _m1: &burn::backend::fusion::custom::TensorSpec,
    _m2: &burn::backend::fusion::custom::TensorSpec,
    _scale: &burn::backend::fusion::custom::TensorSpec,
    _k: &Scalars,
    _has_scale: &bool,
) -> (
    burn::backend::fusion::custom::TensorSpec,
    burn::backend::fusion::custom::TensorSpec,
    burn::backend::fusion::custom::TensorSpec,
) {
    (param.clone(), param.clone(), param.clone())
}

impl AdamWKernels for CubeBackend {
    /// Where `param` has a copy in the products' type ([`super::weight_copies`]), the kernel
    /// writes the new parameter's copy too, kept in its place.
    fn adamw_step(
        param: CubeTensor,
        grad: CubeTensor,
        m1: CubeTensor,
        m2: CubeTensor,
        scale: CubeTensor,
        k: Scalars,
        has_scale: bool,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let copy_type = super::weight_copies::take(&param);
        let [param, grad, m1, m2] = [param, grad, m1, m2].map(into_contiguous);
        let new = || super::empty(&param, param.shape());
        let (p_out, m1_out, m2_out) = (new(), new(), new());
        // Without a copy the kernel writes none: one value stands in.
        let copy = match copy_type {
            Some(dtype) => super::empty_of(&param, param.shape(), dtype),
            None => super::empty(&param, [1]),
        };
        if copy_type.is_some() {
            super::weight_copies::keep(p_out.clone(), copy.clone());
        }
        // Where the optimizer opened a group, the launch waits for the group's other steps.
        let step = super::adamw_groups::Step {
            inputs: [param, grad, m1, m2],
            outputs: [p_out.clone(), m1_out.clone(), m2_out.clone()],
            copy,
        };
        let step = match super::adamw_groups::defer(step, k, has_scale.then_some(&scale), copy_type)
        {
            Ok(()) => return (p_out, m1_out, m2_out),
            Err(step) => step,
        };
        let [param, grad, m1, m2] = step.inputs;
        let copy = step.copy;
        let n = param.shape().num_elements();
        let (count, dim) = super::launch_size(&param, n);
        let [b1, b2, f1, f2, c1, c2, eps, lr, keep] = k.0;
        macro_rules! launch {
            ($copy:ty) => {
                kernel::adamw_step::launch::<f32, $copy>(
                    &param.client.clone(),
                    count,
                    dim,
                    param.into_tensor_arg(),
                    grad.into_tensor_arg(),
                    m1.into_tensor_arg(),
                    m2.into_tensor_arg(),
                    scale.into_tensor_arg(),
                    p_out.clone().into_tensor_arg(),
                    m1_out.clone().into_tensor_arg(),
                    m2_out.clone().into_tensor_arg(),
                    copy.clone().into_tensor_arg(),
                    b1,
                    b2,
                    f1,
                    f2,
                    c1,
                    c2,
                    eps,
                    lr,
                    keep,
                    has_scale,
                    copy_type.is_some(),
                )
            };
        }
        match copy_type {
            None => launch!(f32),
            Some(DType::BF16) => launch!(bf16),
            Some(DType::F16) => launch!(f16),
            Some(other) => unreachable!("a weight's copy in {other:?} (bf16 or f16 only)"),
        }
        (p_out, m1_out, m2_out)
    }
}

pub(super) mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// One element per unit: Burn's AdamW expressions in their order (the scalars are launch
    /// arguments, so a new learning rate or step compiles nothing), and the new parameter in
    /// the float type `N` where `has_copy`.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    pub(super) fn adamw_step<F: Float, N: Float>(
        param: &Tensor<F>,
        grad: &Tensor<F>,
        m1: &Tensor<F>,
        m2: &Tensor<F>,
        scale: &Tensor<F>,
        param_out: &mut Tensor<F>,
        m1_out: &mut Tensor<F>,
        m2_out: &mut Tensor<F>,
        copy_out: &mut Tensor<N>,
        beta_1: f32,
        beta_2: f32,
        factor_1: f32,
        factor_2: f32,
        correction_1: f32,
        correction_2: f32,
        epsilon: f32,
        lr: f32,
        keep: f32,
        #[comptime] has_scale: bool,
        #[comptime] has_copy: bool,
    ) {
        let i = ABSOLUTE_POS;
        if i >= param.len() {
            terminate!();
        }
        let mut factor = F::new(1.0);
        if has_scale {
            factor = scale[0];
        }
        let k = scalars::<F>(
            beta_1,
            beta_2,
            factor_1,
            factor_2,
            correction_1,
            correction_2,
            epsilon,
            lr,
            keep,
        );
        update::<F, N>(
            param, grad, m1, m2, param_out, m1_out, m2_out, copy_out, i, factor, &k, has_scale,
            has_copy,
        );
    }

    /// A step's scalars in the kernel's float type.
    #[derive(CubeType)]
    pub(crate) struct Scalars<F: Float> {
        beta_1: F,
        beta_2: F,
        factor_1: F,
        factor_2: F,
        correction_1: F,
        correction_2: F,
        epsilon: F,
        lr: F,
        keep: F,
    }

    /// The launch arguments as [`Scalars`].
    #[allow(clippy::too_many_arguments)]
    #[cube]
    pub(crate) fn scalars<F: Float>(
        beta_1: f32,
        beta_2: f32,
        factor_1: f32,
        factor_2: f32,
        correction_1: f32,
        correction_2: f32,
        epsilon: f32,
        lr: f32,
        keep: f32,
    ) -> Scalars<F> {
        Scalars::<F> {
            beta_1: F::cast_from(beta_1),
            beta_2: F::cast_from(beta_2),
            factor_1: F::cast_from(factor_1),
            factor_2: F::cast_from(factor_2),
            correction_1: F::cast_from(correction_1),
            correction_2: F::cast_from(correction_2),
            epsilon: F::cast_from(epsilon),
            lr: F::cast_from(lr),
            keep: F::cast_from(keep),
        }
    }

    /// Element `i` of one parameter's step (its gradient times `factor` where `has_scale`):
    /// Burn's AdamW expressions in their order.
    #[allow(clippy::too_many_arguments)]
    #[cube]
    pub(crate) fn update<F: Float, N: Float>(
        param: &Tensor<F>,
        grad: &Tensor<F>,
        m1: &Tensor<F>,
        m2: &Tensor<F>,
        param_out: &mut Tensor<F>,
        m1_out: &mut Tensor<F>,
        m2_out: &mut Tensor<F>,
        copy_out: &mut Tensor<N>,
        i: usize,
        factor: F,
        k: &Scalars<F>,
        #[comptime] has_scale: bool,
        #[comptime] has_copy: bool,
    ) {
        let mut g = grad[i];
        if has_scale {
            g *= factor;
        }
        let a = m1[i] * k.beta_1 + g * k.factor_1;
        let b = m2[i] * k.beta_2 + (g * g) * k.factor_2;
        let delta = (a / k.correction_1) / (F::sqrt(b / k.correction_2) + k.epsilon);
        let p = param[i] * k.keep - delta * k.lr;
        param_out[i] = p;
        if has_copy {
            // The same rounding as a cast of `p`.
            copy_out[i] = N::cast_from(p);
        }
        m1_out[i] = a;
        m2_out[i] = b;
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::optim::{AdamWConfig, AdamWState, Optimizer};
    use burn::tensor::{Device, DeviceKind, Distribution, Tensor};

    use crate::{AdamWStep, adamw_step, adamw_step_reference};

    fn values(t: &Tensor<2>) -> Vec<f32> {
        t.to_data().try_to_vec::<f32>().unwrap()
    }

    /// The largest difference relative to the larger magnitude (at least 1).
    fn worst(a: &Tensor<2>, b: &Tensor<2>) -> f32 {
        values(a)
            .iter()
            .zip(values(b))
            .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1.0))
            .fold(0.0, f32::max)
    }

    /// Five steps from one start, with and without weight decay, on a contiguous and a
    /// transposed parameter (a length no cube divides), with a gradient scale on steps 2 and 4
    /// (Burn's `AdamW` given the scaled gradient): the kernel's parameters and moments
    /// against the reference's and Burn's `AdamW`'s, on wgpu. The GPU's division and square
    /// root round within a few units in the last place, so the three agree to ~1e-6, not to
    /// the bit (flex's loop does: ember-train's tests).
    #[test]
    fn equals_the_reference_and_burns_adamw_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(0.0, 1.0);
        for weight_decay in [0.0, 0.1] {
            for transposed in [false, true] {
                let burn = AdamWConfig::new()
                    .with_beta_1(0.9)
                    .with_beta_2(0.99)
                    .with_epsilon(1e-8)
                    .with_weight_decay(weight_decay)
                    .build();
                let start = Tensor::<2>::random([37, 19], normal, &device);
                let start = if transposed { start.transpose() } else { start };
                let (mut ours, mut reference, mut theirs) = (start.clone(), start.clone(), start);
                let (mut our_moments, mut reference_moments) = (None, None);
                let mut their_state: Option<AdamWState<2>> = None;
                for step in 1..=5 {
                    let grad = Tensor::<2>::random([37, 19], normal, &device);
                    let grad = if transposed { grad.transpose() } else { grad };
                    let lr = 1e-2 * step as f64;
                    let k = AdamWStep::new(0.9, 0.99, 1e-8, weight_decay, lr, step);
                    // Every other step a clipping factor (on the device) scales the gradient.
                    let scale = (step % 2 == 0).then(|| Tensor::<1>::from_floats([0.37], &device));
                    let scale = scale.as_ref();
                    let before = ours.clone();
                    let (p, m1, m2) = adamw_step(ours, grad.clone(), our_moments, &k, scale)
                        .unwrap_or_else(|_| panic!("the kernel takes wgpu f32 tensors"));
                    let (rp, r1, r2) =
                        adamw_step_reference(reference, grad.clone(), reference_moments, &k, scale);
                    let grad = crate::adamw::scaled(grad, scale);
                    (theirs, their_state) = burn.step(lr, theirs, grad, their_state);
                    let what =
                        format!("decay {weight_decay}, transposed {transposed}, step {step}");
                    let b = &their_state.as_ref().unwrap().momentum;
                    for t in [&p, &m1, &m2] {
                        assert_eq!(t.dims(), rp.dims(), "{what}: the parameter's shape");
                    }
                    for (name, x, y, z) in [
                        ("parameter", &p, &rp, &theirs),
                        ("first moment", &m1, &r1, &b.moment_1),
                        ("second moment", &m2, &r2, &b.moment_2),
                    ] {
                        assert!(
                            worst(x, y) < 2e-6,
                            "{what}: {name} vs reference {}",
                            worst(x, y)
                        );
                        assert!(worst(x, z) < 2e-6, "{what}: {name} vs Burn {}", worst(x, z));
                    }
                    // The step moved the parameter (by about lr).
                    assert!(worst(&p, &before) > 0.1 * lr as f32, "{what}");
                    (ours, our_moments) = (p, Some((m1, m2)));
                    (reference, reference_moments) = (rp, Some((r1, r2)));
                }
            }
        }
    }

    /// Autodiff-tracked tensors are not the optimizer's: the op hands them back.
    #[test]
    fn tracked_tensors_are_handed_back() {
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let p = Tensor::<2>::ones([3, 4], &device);
        let k = AdamWStep::new(0.9, 0.99, 1e-8, 0.0, 1e-3, 1);
        assert!(adamw_step(p.clone(), p, None, &k, None).is_err());
    }
}
