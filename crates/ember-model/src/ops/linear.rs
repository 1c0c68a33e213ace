//! The linear op: `x @ W (+ b)` over the last axis, and the matrix product under it.
//!
//! Reference: Burn's `module::linear` and `matmul`. Kernel (flex `f32` tensors, tracked by
//! autodiff or not): `gemm` straight into a new buffer, with its own backward pass
//! ([`crate::ops::flex::matmul`]); a linear layer's rows from every leading axis go through one
//! product, forward and backward. On the GPU backends, the same one product over all rows by
//! Burn's `matmul` (one weight gradient `X^T dY`, not one per sequence summed afterwards), and a
//! plain input of at most eight rows (a decoding step) takes one kernel for the product and the
//! bias (`ops/cube/linear`).

use burn::nn::Linear;
use burn::tensor::{FloatDType, Tensor};

use super::kernels_take;

/// `layer.forward(x)`: `x @ W (+ b)` over the last axis.
///
/// # Shapes
/// - x: `[..., d_input]`
/// - output: `[..., d_output]`
pub fn linear<const D: usize>(layer: &Linear, x: Tensor<D>) -> Tensor<D> {
    affine(x, layer.weight.val(), layer.bias.as_ref().map(|b| b.val()))
}

/// [`linear`], its result left in the product's type under mixed precision (a weight held in
/// another float type than `x`, [`crate::precision`]), the bias added there: the attention's
/// `[Q | K | V]` projection, which the fused attention keeps in that type as PyTorch's autocast
/// does. Otherwise [`linear`] itself.
///
/// # Shapes
/// - x: `[..., d_input]`
/// - output: `[..., d_output]`
pub fn linear_in_products<const D: usize>(layer: &Linear, x: Tensor<D>) -> Tensor<D> {
    let weight = layer.weight.val();
    let bias = layer.bias.as_ref().map(|b| b.val());
    match weight.dtype() == x.dtype() {
        true => affine(x, weight, bias),
        false => affine(x.cast(FloatDType::from(weight.dtype())), weight, bias),
    }
}

/// GELU of `layer.forward(x)` (the tanh approximation when `tanh`): an MLP's expansion and its
/// non-linearity. On the GPU backends a plain input of at most eight rows (a decoding step)
/// takes one kernel for the product, the bias and the GELU (`ops/cube/linear`); otherwise
/// [`linear`], then [`super::gelu`] or [`super::gelu_tanh`].
///
/// # Shapes
/// - x: `[..., d_input]`
/// - output: `[..., d_output]`
pub fn linear_gelu<const D: usize>(layer: &Linear, x: Tensor<D>, tanh: bool) -> Tensor<D> {
    let weight = layer.weight.val();
    if weight.dtype() != x.dtype() {
        // Mixed precision (crate::precision): the hidden layer stays in the weight's type, the
        // bias added there and the GELU computed in f32 and rounded once, as PyTorch's autocast
        // keeps it. A training step then keeps it at half the bytes (the GELU's input for its
        // backward pass, its output for the projection's).
        let narrow = FloatDType::from(weight.dtype());
        let bias = layer.bias.as_ref().map(|b| b.val());
        let y = affine(x.cast(narrow), weight, bias);
        return if tanh {
            super::gelu_tanh(y)
        } else {
            super::gelu(y)
        };
    }
    #[cfg(feature = "cube")]
    let x = {
        use super::cube::linear::{Epilogue, affine_then};
        let bias = layer.bias.as_ref().map(|b| b.val());
        match affine_then(x, layer.weight.val(), bias, Epilogue::Gelu { tanh }) {
            Ok(y) => return y,
            Err((x, _, _)) => x,
        }
    };
    let y = linear(layer, x);
    if tanh {
        super::gelu_tanh(y)
    } else {
        super::gelu(y)
    }
}

/// [`linear_gelu`] in Burn's tensor ops, on every backend.
pub fn linear_gelu_reference<const D: usize>(
    layer: &Linear,
    x: Tensor<D>,
    tanh: bool,
) -> Tensor<D> {
    let weight = layer.weight.val();
    let y = affine_reference(x, weight, layer.bias.as_ref().map(|b| b.val()));
    if tanh {
        super::gelu_tanh_reference(y)
    } else {
        super::gelu_reference(y)
    }
}

/// `x @ weight (+ bias)` over the last axis, as `burn::tensor::module::linear`.
///
/// # Shapes
/// - x: `[..., d_input]`
/// - weight: `[d_input, d_output]` (a slice or transposed view is read in place)
/// - bias: `[d_output]`
/// - output: `[..., d_output]`
///
/// A weight held in another float type than `x` (mixed precision, see [`crate::precision`])
/// sets the product's type: `x` is rounded to it, and the result and the bias are in `x`'s. A
/// bias of another type than `x` is added in `x`'s.
pub fn affine<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    let dtype = x.dtype();
    let bias = bias.map(|b| super::cast_to(b, dtype));
    if weight.dtype() != dtype {
        // Mixed precision (crate::precision): the product in the weight's type, the result
        // and the bias in the activation's.
        let y = affine(x.cast(FloatDType::from(weight.dtype())), weight, None)
            .cast(FloatDType::from(dtype));
        return match bias {
            Some(bias) => y + bias.unsqueeze::<D>(),
            None => y,
        };
    }
    #[cfg(feature = "cube")]
    let (x, weight, bias) = match super::cube::linear::affine(x, weight, bias) {
        Ok(y) => return y,
        Err(parts) => parts,
    };
    if D < 2 || !(kernels_take(&x) || rows_as_one_product_on_gpu(&x)) {
        return affine_reference(x, weight, bias);
    }
    // All leading axes as the rows of one product: under autodiff Burn's `linear` keeps the
    // batch axis, multiplies the weight per sequence and computes the weight's gradient as
    // `[B, K, N]` before summing over `B` (docs/burn-findings.md, 10).
    let dims = x.dims();
    let d_input = dims[D - 1];
    let rows = dims[..D - 1].iter().product();
    let mut y = matmul(x.reshape([rows, d_input]), weight); // [rows, d_output]
    if let Some(bias) = bias {
        y = y + bias.unsqueeze::<2>();
    }
    let mut out = dims;
    out[D - 1] = y.dims()[1];
    y.reshape(out)
}

/// Whether `x` is on a GPU backend whose linear layers take the rows-as-one-product path of
/// [`affine`] (`EMBER_GPU_KERNELS`' `linear`, on unless turned off).
fn rows_as_one_product_on_gpu<const D: usize>(x: &Tensor<D>) -> bool {
    use super::gpu_kernels::{GpuKernel, uses};
    uses(GpuKernel::Linear) && super::on_cubecl(&x.device())
}

/// `a @ b`.
///
/// # Shapes
/// - a: `[M, K]`
/// - b: `[K, N]` (a transposed view is read in place)
/// - output: `[M, N]`
///
/// When `b` (the weight) is held in another float type than `a` (mixed precision, see
/// [`crate::precision`]), the product runs in `b`'s type and the result has `a`'s.
pub fn matmul(a: Tensor<2>, b: Tensor<2>) -> Tensor<2> {
    let dtype = a.dtype();
    if b.dtype() != dtype {
        return matmul(a.cast(FloatDType::from(b.dtype())), b).cast(FloatDType::from(dtype));
    }
    #[cfg(feature = "flex")]
    let (a, b) = match super::flex::matmul::matmul(a, b) {
        Ok(y) => return y,
        Err(ab) => ab,
    };
    matmul_reference(a, b)
}

/// [`affine`] in Burn's tensor ops, on every backend.
pub fn affine_reference<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    burn::tensor::module::linear(x, weight, bias)
}

/// [`matmul`] in Burn's tensor ops, on every backend.
pub fn matmul_reference(a: Tensor<2>, b: Tensor<2>) -> Tensor<2> {
    a.matmul(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::LinearConfig;
    use burn::tensor::{Device, Distribution};

    /// Outputs and the gradients of input, weight and bias against Burn's `Linear::forward`,
    /// for a rank-3 input, a transposed (non-contiguous) one, with and without a bias.
    #[test]
    fn linear_equals_burns() {
        let device = Device::flex().autodiff();
        for bias in [true, false] {
            let layer = LinearConfig::new(24, 40).with_bias(bias).init(&device);
            let base = Tensor::<3>::random([3, 24, 7], Distribution::Normal(0.0, 1.0), &device);
            for transposed in [false, true] {
                let run = |ours: bool| {
                    let x = base.clone().require_grad();
                    let input = input_of(&x, transposed);
                    assert!(kernels_take(&input));
                    let y = if ours {
                        linear(&layer, input)
                    } else {
                        layer.forward(input)
                    };
                    assert_eq!(y.dims(), [3, 7, 40]);
                    let grads = (y.clone() * y.clone()).sum().backward();
                    let mut out = vec![y.inner(), x.grad(&grads).unwrap().reshape([3, 7, 24])];
                    out.push(layer.weight.val().grad(&grads).unwrap().unsqueeze());
                    if let Some(b) = &layer.bias {
                        out.push(b.val().grad(&grads).unwrap().unsqueeze());
                    }
                    out
                };
                let (ours, burns) = (run(true), run(false));
                assert_close(
                    ours,
                    burns,
                    &format!("bias {bias}, transposed {transposed}"),
                );
            }
        }
    }

    /// On wgpu, training-sized inputs (rows as one product, not the few-row kernel): output and
    /// the gradients of input, weight and bias against Burn's `linear` (which multiplies per
    /// sequence), for a rank-3 input, a transposed view of one, and a column slice of a larger
    /// weight, with and without a bias.
    #[cfg(feature = "wgpu")]
    #[test]
    fn many_rows_equal_burns_on_wgpu() {
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice).autodiff();
        let normal = Distribution::Normal(0.0, 1.0);
        let w = Tensor::<2>::random([24, 56], normal, &device).require_grad();
        let b = Tensor::<1>::random([56], normal, &device).require_grad();
        let base = Tensor::<3>::random([3, 24, 7], normal, &device);
        for (bias, transposed) in [(true, false), (false, true), (true, true)] {
            let run = |ours: bool| {
                let x = base.clone().require_grad();
                let input = input_of(&x, transposed);
                let (ws, bs) = (w.clone().slice([0..24, 8..48]), b.clone().narrow(0, 8, 40));
                let bs = bias.then_some(bs);
                let y = if ours {
                    affine(input, ws, bs)
                } else {
                    affine_reference(input, ws, bs)
                };
                assert_eq!(y.dims(), [3, 7, 40]);
                let grads = (y.clone() * y.clone().sin()).sum().backward();
                let mut out = vec![y.inner(), x.grad(&grads).unwrap().reshape([3, 7, 24])];
                out.push(w.grad(&grads).unwrap().unsqueeze());
                if bias {
                    out.push(b.grad(&grads).unwrap().unsqueeze());
                }
                out
            };
            let what = format!("wgpu, bias {bias}, transposed {transposed}");
            assert_close(run(true), run(false), &what);
        }
    }

    /// The `[3, 7, 24]` input of the tests from `x` `[3, 24, 7]`: a transposed view of it (not
    /// contiguous), or its values reshaped.
    fn input_of(x: &Tensor<3>, transposed: bool) -> Tensor<3> {
        if transposed {
            x.clone().swap_dims(1, 2)
        } else {
            x.clone().reshape([3, 7, 24])
        }
    }

    /// Every pair within 1e-5 of the larger magnitude.
    fn assert_close(ours: Vec<Tensor<3>>, burns: Vec<Tensor<3>>, what: &str) {
        assert_eq!(ours.len(), burns.len());
        for (i, (a, b)) in ours.into_iter().zip(burns).enumerate() {
            let scale = b.clone().abs().max().into_scalar::<f32>().max(1.0);
            let d = (a - b).abs().max().into_scalar::<f32>();
            assert!(d < 1e-5 * scale, "{what}, output {i}: differs by {d}");
        }
    }

    /// `linear_gelu` (both GELUs, with and without a bias) against Burn's linear then GELU on
    /// flex: output and the gradients of the input and the weight.
    #[test]
    fn linear_gelu_equals_burns() {
        let device = Device::flex().autodiff();
        for (bias, tanh) in [(true, false), (false, true)] {
            let layer = LinearConfig::new(24, 40).with_bias(bias).init(&device);
            let x = Tensor::<3>::random([3, 7, 24], Distribution::Normal(0.0, 1.0), &device)
                .require_grad();
            let run = |ours: bool| {
                let y = if ours {
                    linear_gelu(&layer, x.clone(), tanh)
                } else {
                    linear_gelu_reference(&layer, x.clone(), tanh)
                };
                let grads = (y.clone() * y.clone()).sum().backward();
                let w = layer.weight.val().grad(&grads).unwrap();
                vec![y.inner(), x.grad(&grads).unwrap(), w.unsqueeze()]
            };
            assert_close(run(true), run(false), &format!("bias {bias}, tanh {tanh}"));
        }
    }

    /// `affine` with a column slice of a larger weight and a narrowed bias (as cross-attention
    /// uses `c_attn`): output and the gradients of input, weight and bias against Burn's.
    #[test]
    fn affine_with_slices_equals_burns() {
        let device = Device::flex().autodiff();
        let normal = Distribution::Normal(0.0, 1.0);
        let w = Tensor::<2>::random([16, 48], normal, &device).require_grad();
        let b = Tensor::<1>::random([48], normal, &device).require_grad();
        let x = Tensor::<3>::random([2, 5, 16], normal, &device).require_grad();
        let run = |ours: bool| {
            let (ws, bs) = (
                w.clone().slice([0..16, 16..48]),
                b.clone().narrow(0, 16, 32),
            );
            let y = if ours {
                affine(x.clone(), ws, Some(bs))
            } else {
                burn::tensor::module::linear(x.clone(), ws, Some(bs))
            };
            let grads = (y.clone() * y.clone().sin()).sum().backward();
            vec![
                y.inner(),
                x.grad(&grads).unwrap(),
                w.grad(&grads).unwrap().unsqueeze(),
                b.grad(&grads).unwrap().unsqueeze(),
            ]
        };
        assert_close(run(true), run(false), "sliced weight");
    }
}
