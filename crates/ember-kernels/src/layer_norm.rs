//! The LayerNorm and RMSNorm ops.
//!
//! Reference: Burn's `LayerNorm::forward`. Kernels (flex `f32` tensors, and on the GPU
//! backends `f32` tensors on a CubeCL device, tracked by autodiff or not): the normalisation and
//! scale in one pass with its own backward pass ([`crate::flex::layer_norm`], then the
//! bias as a tensor op; `cube/layer_norm`, the bias in the same pass). Burn 0.22.1 builds
//! LayerNorm under autodiff from nine tensor ops, each with a buffer and a backward: a tenth of
//! a baby-GPT training step on flex. Burn's `LayerNorm` keeps its epsilon private, so the
//! caller passes the one the module was built with.
//!
//! RMSNorm (LLaMA's, `x / sqrt(mean(x^2) + eps) * gamma`): reference in Burn's tensor ops (six
//! under autodiff); kernels LayerNorm's without the centring, on flex and on GPUs.

use burn::nn::LayerNorm;
use burn::tensor::Tensor;

/// `norm`'s LayerNorm of `x` over the last axis; `eps` must be the epsilon `norm` was built
/// with.
///
/// # Shapes
/// - x: `[..., D]`
/// - output: `[..., D]`
pub fn layer_norm<const N: usize>(norm: &LayerNorm, x: Tensor<N>, eps: f64) -> Tensor<N> {
    #[cfg(feature = "flex")]
    let x = match super::flex::layer_norm::normalize_and_scale(x, norm.gamma.val(), eps) {
        Ok(y) => {
            return match &norm.beta {
                Some(beta) => y + beta.val().unsqueeze::<N>(),
                None => y,
            };
        }
        Err((x, _)) => x,
    };
    #[cfg(feature = "cube")]
    let x = match super::cube::layer_norm::layer_norm(
        x,
        norm.gamma.val(),
        norm.beta.as_ref().map(|b| b.val()),
        eps,
    ) {
        Ok(y) => return y,
        Err((x, ..)) => x,
    };
    #[cfg(not(any(feature = "flex", feature = "cube")))]
    let _ = eps;
    layer_norm_reference(norm, x)
}

/// RMSNorm of `x` over the last axis: `x / sqrt(mean(x^2) + eps) * gamma`.
///
/// # Shapes
/// - x: `[..., D]`
/// - gamma: `[D]`
/// - output: `[..., D]`
pub fn rms_norm<const N: usize>(x: Tensor<N>, gamma: Tensor<1>, eps: f64) -> Tensor<N> {
    #[cfg(feature = "flex")]
    let (x, gamma) = match super::flex::layer_norm::rms_scale(x, gamma, eps) {
        Ok(y) => return y,
        Err(back) => back,
    };
    #[cfg(feature = "cube")]
    let (x, gamma) = match super::cube::layer_norm::rms_norm(x, gamma, eps) {
        Ok(y) => return y,
        Err(back) => back,
    };
    rms_norm_reference(x, gamma, eps)
}

/// [`rms_norm`] in Burn's tensor ops, on every backend.
pub fn rms_norm_reference<const N: usize>(x: Tensor<N>, gamma: Tensor<1>, eps: f64) -> Tensor<N> {
    let mean_square = x.clone().powi_scalar(2).mean_dim(N - 1); // [..., 1]
    x * mean_square.add_scalar(eps).sqrt().recip() * gamma.unsqueeze::<N>()
}

/// [`layer_norm`] in Burn's tensor ops, on every backend.
pub fn layer_norm_reference<const N: usize>(norm: &LayerNorm, x: Tensor<N>) -> Tensor<N> {
    norm.forward(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::nn::LayerNormConfig;
    use burn::tensor::{Device, Distribution};

    /// Output and the gradients of input, gamma and beta against Burn's `LayerNorm` given the
    /// same weights, on flex with and without autodiff (and with checkpointing), with and without
    /// a bias, for a row count that splits over threads and one that does not.
    #[test]
    fn layer_norm_equals_burns() {
        equals_burns_on(Device::flex(), 2e-5, false);
    }

    /// RMSNorm's kernel against its reference, the same cases (gamma alone).
    #[test]
    fn rms_norm_equals_its_reference() {
        equals_burns_on(Device::flex(), 2e-5, true);
    }

    /// The same on wgpu (the GPU kernels; lavapipe in CI): one cube per row.
    #[cfg(feature = "wgpu")]
    #[test]
    fn layer_norm_equals_burns_on_wgpu() {
        equals_burns_on(
            Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
            2e-5,
            false,
        );
    }

    /// RMSNorm's GPU kernels (LayerNorm's, not centred) against its reference on wgpu.
    #[cfg(feature = "wgpu")]
    #[test]
    fn rms_norm_equals_its_reference_on_wgpu() {
        equals_burns_on(
            Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
            2e-5,
            true,
        );
    }

    /// Whether flex's or (GPU builds) the CubeCL kernels take `x`.
    fn kernel_takes(x: &Tensor<3>) -> bool {
        #[cfg(feature = "cube")]
        if crate::cube::gpu_kernel_takes(crate::GpuKernel::LayerNorm, x) {
            return true;
        }
        crate::kernels_take(x)
    }

    /// LayerNorm, or with `rms` RMSNorm (whose cases with a bias run without one).
    fn equals_burns_on(base: Device, tolerance: f32, rms: bool) {
        let devices = [
            (base.clone(), false),
            (base.clone().autodiff(), true),
            (base.autodiff().gradient_checkpointing(), true),
        ];
        for (device, tracked) in devices {
            // Widths below a GPU row cube's 32 units, a multiple of them, and neither; one
            // that no vector width divides (the GPU kernels then read one value at a time).
            for (bias, rows, d) in [
                (true, 5, 96),
                (false, 5, 20),
                (true, 700, 96),
                (false, 700, 200),
                (true, 300, 7),
            ] {
                let bias = bias && !rms;
                let normal = Distribution::Normal(0.5, 2.0);
                let mut norm = LayerNormConfig::new(d)
                    .with_epsilon(1e-3)
                    .with_bias(bias)
                    .init(&device);
                norm.gamma = Param::from_tensor(Tensor::random([d], normal, &device));
                if bias {
                    norm.beta = Some(Param::from_tensor(Tensor::random([d], normal, &device)));
                }
                let base = Tensor::<3>::random([rows, d, 2], normal, &device);
                let run = |ours: bool| {
                    let x = if tracked {
                        base.clone().require_grad()
                    } else {
                        base.clone()
                    };
                    let input = x.clone().swap_dims(1, 2); // not contiguous
                    assert!(kernel_takes(&input), "a kernel takes the input");
                    let gamma = norm.gamma.val();
                    let y = match (rms, ours) {
                        (false, true) => layer_norm(&norm, input, 1e-3),
                        (false, false) => layer_norm_reference(&norm, input),
                        (true, true) => rms_norm(input, gamma, 1e-3),
                        (true, false) => rms_norm_reference(input, gamma, 1e-3),
                    };
                    let mut out = vec![y.clone().reshape([-1])];
                    if tracked {
                        let grads = (y.clone() * y.sin()).sum().backward();
                        out.push(x.grad(&grads).unwrap().reshape([-1]));
                        out.push(norm.gamma.val().grad(&grads).unwrap());
                        if let Some(beta) = &norm.beta {
                            out.push(beta.val().grad(&grads).unwrap());
                        }
                    }
                    out
                };
                let (ours, burns) = (run(true), run(false));
                assert_eq!(ours.len(), burns.len());
                for (i, (a, b)) in ours.into_iter().zip(burns).enumerate() {
                    let scale = b.clone().abs().max().into_scalar::<f32>().max(1.0);
                    let diff = (a - b).abs().max().into_scalar::<f32>();
                    assert!(
                        diff < tolerance * scale,
                        "{device:?}, bias {bias}, {rows} rows of {d}, output {i}: differs by {diff}"
                    );
                }
            }
        }
    }
}
