//! The SiLU op, `x * sigmoid(x)`, and the gated SiLU of LLaMA's MLP (SwiGLU), `silu(gate) * up`.
//!
//! Reference: Burn's `silu`, a sigmoid and a product (under autodiff each with its own backward
//! pass, its intermediate kept); gated, two slices of the fused expansion besides. Kernels (flex
//! `f32` tensors): [`crate::kernels::gelu`]'s vectorised loops, one pass each way, as the
//! GELUs' (`flex::gated` for the gate); on GPUs one kernel each way for the gate
//! (`cube::gated`), SiLU alone the reference.

use burn::tensor::Tensor;

/// SiLU, `x * sigmoid(x)`, element-wise.
///
/// # Shapes
/// - x: any
/// - output: same as x
///
/// A bf16 or f16 `x` is computed in `f32` and rounded once to its type.
pub fn silu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "flex")]
    let x = match super::flex::gelu::gelu::<super::kernels::gelu::Silu, D>(x) {
        Ok(y) => return y,
        Err(x) => x,
    };
    super::gelu::in_f32(x, silu, silu_reference)
}

/// `silu(gate) * up` of the halves `[gate | up]` of `x`'s last axis.
///
/// # Shapes
/// - x: `[..., 2F]`
/// - output: `[..., F]`
///
/// A bf16 or f16 `x` is computed in `f32` and rounded once to its type.
pub fn gated_silu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "flex")]
    let x = match super::flex::gated::gated::<super::kernels::gelu::Silu, D>(x) {
        Ok(y) => return y,
        Err(x) => x,
    };
    #[cfg(feature = "cube")]
    let x = match super::cube::gated::gated_silu(x) {
        Ok(y) => return y,
        Err(x) => x,
    };
    super::gelu::in_f32(x, gated_silu, gated_silu_reference)
}

/// [`gated_silu`] in Burn's tensor ops, on every backend.
pub fn gated_silu_reference<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let f2 = x.dims()[D - 1];
    let gate = x.clone().narrow(D - 1, 0, f2 / 2);
    let up = x.narrow(D - 1, f2 / 2, f2 / 2);
    silu_reference(gate) * up
}

/// [`silu`] in Burn's tensor ops, on every backend.
pub fn silu_reference<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    burn::tensor::activation::silu(x)
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use crate::check::agrees_on;
    use burn::tensor::{Device, Distribution};

    /// The op (ember's kernel on flex) against its reference, output and gradient, over
    /// negative and positive inputs (`agrees_on` feeds `e^x`; 3 less spans both signs).
    #[test]
    fn equals_its_reference() {
        let draw = |dims: [usize; 3]| {
            Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.5), &Device::flex()).into_data()
        };
        let (x, g) = (draw([3, 70, 129]), draw([3, 70, 129]));
        assert!(crate::kernels_take(&Tensor::<3>::from_data(
            x.clone(),
            &Device::flex()
        )));
        agrees_on(
            &Device::flex(),
            &x,
            &g,
            |x| silu(x.sub_scalar(3.0)),
            |x| silu_reference(x.sub_scalar(3.0)),
            2e-6,
            "SiLU",
        );
        // Gated: rows that split over threads, and a width whose halves no vector fills.
        for dims in [[3, 700, 2 * 48], [2, 3, 2 * 5]] {
            let draw = |dims: [usize; 3]| {
                let normal = Distribution::Normal(0.0, 1.5);
                Tensor::<3>::random(dims, normal, &Device::flex()).into_data()
            };
            let g_dims = [dims[0], dims[1], dims[2] / 2];
            let (x, g) = (draw(dims), draw(g_dims));
            agrees_on_halves(&x, &g, dims);
        }
    }

    /// [`gated_silu`] against its reference on `x`, output and gradient (`agrees_on`'s check
    /// for an op whose output is half its input).
    fn agrees_on_halves(
        x: &burn::tensor::TensorData,
        g: &burn::tensor::TensorData,
        dims: [usize; 3],
    ) {
        for device in [
            Device::flex(),
            Device::flex().autodiff(),
            Device::flex().autodiff().gradient_checkpointing(),
        ] {
            let tracked = device.is_autodiff();
            let run = |ours: bool| {
                let input = Tensor::<3>::from_data(x.clone(), &device);
                let input = if tracked { input.require_grad() } else { input };
                // Through a graph, both signs.
                let z = input.clone().exp().sub_scalar(3.0);
                let y = match ours {
                    true => gated_silu(z),
                    false => gated_silu_reference(z),
                };
                assert_eq!(y.dims(), [dims[0], dims[1], dims[2] / 2]);
                let mut out = vec![y.clone().inner().reshape([-1])];
                if tracked {
                    let w = Tensor::<3>::from_data(g.clone(), &device);
                    let grads = (y * w).sum().backward();
                    out.push(input.grad(&grads).unwrap().reshape([-1]));
                }
                out
            };
            for (i, (a, b)) in run(true).into_iter().zip(run(false)).enumerate() {
                let scale = b.clone().abs().max().into_scalar::<f32>().max(1.0);
                let diff = (a - b).abs().max().into_scalar::<f32>();
                assert!(
                    diff < 2e-6 * scale,
                    "{dims:?}, tracked {tracked}, output {i}: {diff}"
                );
            }
        }
    }
}
