//! The linear op: `x @ W (+ b)` over the last axis, and the matrix product under it.
//!
//! Reference: Burn's `module::linear` and `matmul`. Kernel (flex `f32` tensors, tracked by
//! autodiff or not): `gemm` straight into a new buffer, with its own backward pass
//! ([`crate::products::flex`]); a linear layer's rows from every leading axis go through one
//! product, forward and backward. On the GPU backends, the same one product over all rows by
//! Burn's `matmul` (one weight gradient `X^T dY`, not one per sequence summed afterwards), and a
//! plain input of at most eight rows (a decoding step) takes one kernel for the product and the
//! bias (`products/few_rows`).
//!
//! Every matrix product lives in this folder: this file the ops (`linear`, `affine`, `matmul`,
//! `linear_gelu`) and their references, [`blas`] the row-major to column-major mapping,
//! `flex` the CPU product and its autodiff op, `cube` the GPU product op (cuBLAS on CUDA,
//! Burn's `matmul` elsewhere), `cublas` the calls themselves, `few_rows` the one-kernel
//! product and bias of a decoding step.

use burn::nn::Linear;
use burn::tensor::{DType, FloatDType, Tensor};

use super::kernels_take;

pub mod blas;
#[cfg(feature = "cube")]
pub(crate) mod cube;
#[cfg(feature = "cublas")]
pub(crate) mod cublas;
#[cfg(feature = "cube")]
pub(crate) mod few_rows;
#[cfg(feature = "flex")]
pub(crate) mod flex;

/// `layer.forward(x)`: `x @ W (+ b)` over the last axis.
///
/// # Shapes
/// - x: `[..., d_input]`
/// - output: `[..., d_output]`
pub fn linear<const D: usize>(layer: &Linear, x: Tensor<D>) -> Tensor<D> {
    affine(x, layer.weight.val(), layer.bias.as_ref().map(|b| b.val()))
}

/// [`linear`], its result left in the product's type under mixed precision (a weight held in
/// another float type than `x`, `ember_model::precision`), the bias added there: the attention's
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
        false => affine_in_products(x, weight, bias),
    }
}

/// GELU of `layer.forward(x)` (the tanh approximation when `tanh`): an MLP's expansion and its
/// non-linearity. On the GPU backends a plain input of at most eight rows (a decoding step)
/// takes one kernel for the product, the bias and the GELU (`products/few_rows`); otherwise
/// [`linear`], then [`super::gelu`] or [`super::gelu_tanh`].
///
/// # Shapes
/// - x: `[..., d_input]`
/// - output: `[..., d_output]`
pub fn linear_gelu<const D: usize>(layer: &Linear, x: Tensor<D>, tanh: bool) -> Tensor<D> {
    let weight = layer.weight.val();
    if weight.dtype() != x.dtype() {
        // Mixed precision (`ember_model::precision`): the hidden layer stays in the weight's type, the
        // bias added there and the GELU computed in f32 and rounded once, as PyTorch's autocast
        // keeps it. A training step then keeps it at half the bytes (the GELU's input for its
        // backward pass, its output for the projection's).
        let bias = layer.bias.as_ref().map(|b| b.val());
        let y = affine_in_products(x, weight, bias);
        return if tanh {
            super::gelu_tanh(y)
        } else {
            super::gelu(y)
        };
    }
    #[cfg(feature = "cube")]
    let x = {
        use few_rows::{Epilogue, affine_then};
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
/// A weight held in another float type than `x` (mixed precision, see `ember_model::precision`)
/// sets the product's type: `x` is rounded to it, and the result and the bias are in `x`'s. A
/// bias of another type than `x` is added in `x`'s.
pub fn affine<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    let dtype = x.dtype();
    if weight.dtype() != dtype {
        // Mixed precision (`ember_model::precision`): the product in the weight's type, the result
        // and the bias in the activation's.
        let (x, weight, bias) = match affine_one_op(x, weight, bias, dtype) {
            Ok(y) => return y,
            Err(inputs) => inputs,
        };
        let bias = bias.map(|b| super::cast_to(b, dtype));
        let y = affine(x.cast(FloatDType::from(weight.dtype())), weight, None)
            .cast(FloatDType::from(dtype));
        return match bias {
            Some(bias) => y + bias.unsqueeze::<D>(),
            None => y,
        };
    }
    let bias = bias.map(|b| super::cast_to(b, dtype));
    #[cfg(feature = "cube")]
    let (x, weight, bias) = match few_rows::affine(x, weight, bias) {
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

/// `x @ weight (+ bias)` over the last axis for a `weight` held in a narrow float type and an
/// `x` in `f32` or that type (mixed precision, `ember_model::precision`), as one op on CUDA:
/// `x` rounded to the weight's type, the product in that type (accumulated in `f32`) over all
/// rows, the result and the bias in `out` (`f32` or the weight's type), and under autodiff
/// `x`'s gradient written in `x`'s type by the product that computes it ([`cube::matmul_into`]).
/// Where the op does not take it (no CUDA, no cuBLAS), the inputs back: the callers' tracked
/// casts around [`affine`] of one type compute the same values, rounded once more.
///
/// # Shapes
/// - x: `[..., d_input]`
/// - weight: `[d_input, d_output]` (a transposed view is read in place)
/// - bias: `[d_output]`
/// - output: `[..., d_output]`
#[allow(clippy::type_complexity)]
fn affine_one_op<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    out: DType,
) -> Result<Tensor<D>, (Tensor<D>, Tensor<2>, Option<Tensor<1>>)> {
    // All rows as one product, as `affine` multiplies them where `linear` is on.
    #[cfg(feature = "cube")]
    if D >= 2
        && rows_as_one_product_on_gpu(&x)
        && cube::takes(x.dtype(), weight.dtype(), out, &x.device())
    {
        let dims = x.dims();
        let d_input = dims[D - 1];
        let rows = dims[..D - 1].iter().product();
        let mut y = match cube::matmul_into(x.reshape([rows, d_input]), weight, out) {
            Ok(y) => y,
            // `takes` said it would: only a changed switch gets here.
            Err((x, weight)) => super::cast_to(matmul(x, weight), out),
        };
        if let Some(bias) = bias {
            y = y + super::cast_to(bias, out).unsqueeze::<2>();
        }
        let mut shape = dims;
        shape[D - 1] = y.dims()[1];
        return Ok(y.reshape(shape));
    }
    #[cfg(not(feature = "cube"))]
    let _ = out;
    Err((x, weight, bias))
}

/// `x @ weight (+ bias)` with `x` rounded to the weight's narrower type and the result and the
/// bias in that type (mixed precision's layers kept narrow): one op on CUDA
/// ([`affine_one_op`]), else a tracked cast of `x` and [`affine`] of one type.
fn affine_in_products<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    let narrow = weight.dtype();
    match affine_one_op(x, weight, bias, narrow) {
        Ok(y) => y,
        Err((x, weight, bias)) => affine(x.cast(FloatDType::from(narrow)), weight, bias),
    }
}

/// [`linear`] with its result in `out`: under mixed precision (`ember_model::precision`) the
/// projections back to the residual stream, whose input is in the products' type (the
/// attention's output, the MLP's hidden layer) and whose result is widened to `f32`. On CUDA
/// the product writes `f32` as it accumulates and the bias is added there; elsewhere [`linear`]
/// in the weight's type, then a cast.
///
/// # Shapes
/// - x: `[..., d_input]`
/// - output: `[..., d_output]`
pub fn linear_into<const D: usize>(layer: &Linear, x: Tensor<D>, out: DType) -> Tensor<D> {
    let weight = layer.weight.val();
    if weight.dtype() == out && x.dtype() == out {
        return linear(layer, x);
    }
    let bias = layer.bias.as_ref().map(|b| b.val());
    match affine_one_op(x, weight, bias, out) {
        Ok(y) => y,
        Err((x, weight, bias)) => super::cast_to(affine(x, weight, bias), out),
    }
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
/// `ember_model::precision`), the product runs in `b`'s type and the result has `a`'s.
pub fn matmul(a: Tensor<2>, b: Tensor<2>) -> Tensor<2> {
    let dtype = a.dtype();
    if b.dtype() != dtype {
        // On CUDA one op rounds `a`, multiplies and widens (`affine_one_op`).
        #[cfg(feature = "cube")]
        let (a, b) = match cube::matmul_into(a, b, dtype) {
            Ok(y) => return y,
            Err(ab) => ab,
        };
        return matmul(a.cast(FloatDType::from(b.dtype())), b).cast(FloatDType::from(dtype));
    }
    #[cfg(feature = "flex")]
    let (a, b) = match flex::matmul(a, b) {
        Ok(y) => return y,
        Err(ab) => ab,
    };
    // On CUDA, cuBLAS's products where it can be loaded (and no split: it chooses its own).
    #[cfg(feature = "cube")]
    let (a, b) = match cube::matmul(a, b) {
        Ok(y) => return y,
        Err(ab) => ab,
    };
    let device = a.device();
    let splits = match splits_on_gpu(&device) {
        true => {
            let [rows, k] = a.dims();
            weight_gradient_splits(rows, k, b.dims()[1], multiprocessors(&device))
        }
        false => 1,
    };
    match splits {
        1 => matmul_reference(a, b),
        _ => matmul_split_rows(a, b, splits),
    }
}

/// The multiprocessors of `device`'s GPU where its runtime reports them (CUDA).
fn multiprocessors(device: &burn::tensor::Device) -> Option<u32> {
    #[cfg(feature = "cube")]
    return super::cube::streaming_multiprocessors(device);
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        None
    }
}

/// `a @ b` with `a`'s rows in `splits` equal chunks: one batched product over `b` broadcast.
/// The result is [`matmul_reference`]'s; what changes is `b`'s gradient under autodiff,
/// `a^T dY`, which becomes `splits` partial products over the chunks of rows, summed (Burn
/// sums a broadcast operand's gradient over the batch). This is split-K: a training step's
/// weight gradient has a small output (`[384, 1152]` for nanoGPT's GPU config) and a long
/// reduction (16384 rows), and cubek's products give each block of the output one cube that
/// walks the whole reduction (blocks of 64 x 64 in its tensor-core routines for `f32`, by its
/// selector's source: 108 cubes for an H100's 132 multiprocessors). In chunks it has `splits`
/// times the cubes, for one `[splits, K, N]` sum more. (Burn keeps the forward product
/// batched, or folds it back into one: the same blocks.)
///
/// # Shapes
/// - a: `[M, K]`, `M` a multiple of `splits`
/// - b: `[K, N]`
/// - output: `[M, N]`
pub fn matmul_split_rows(a: Tensor<2>, b: Tensor<2>, splits: usize) -> Tensor<2> {
    let [rows, k] = a.dims();
    let n = b.dims()[1];
    assert!(
        splits > 0 && rows.is_multiple_of(splits),
        "split product: {rows} rows do not split into {splits} chunks"
    );
    a.reshape([splits, rows / splits, k])
        .matmul(b.unsqueeze::<3>())
        .reshape([rows, n])
}

/// Whether [`matmul`] on `device` may split its rows for the weight's gradient: a GPU
/// backend under autodiff (the split changes only gradients), with the policy's
/// `split-k` on ([`weight_gradient_splits`] says into how many chunks).
fn splits_on_gpu(device: &burn::tensor::Device) -> bool {
    use super::gpu_kernels::{GpuStrategy, applies};
    applies(GpuStrategy::SplitK) && device.is_autodiff() && super::on_cubecl(device)
}

/// The number of chunks of `rows` for the weight gradient of an `[rows, k] @ [k, n]` product
/// on a GPU of `multiprocessors`: `EMBER_SPLIT_K` where it is set (the most up to it that
/// divide `rows`); else, where the GPU's multiprocessors are known (CUDA), the fewest (a power
/// of two) that give the `[k, n]` gradient 8 blocks of 64 x 64 per multiprocessor in all,
/// each chunk keeping at least 512 rows, 32 chunks at most; else 1 (wgpu reports no
/// multiprocessors: a one-product gradient as before).
/// nanoGPT's GPU config on a GPU of 132 (16384 rows, width 384): 16 chunks for `[Q | K | V]`,
/// 32 for the attention's output and the tied head, 8 for the MLP's two layers.
pub fn weight_gradient_splits(
    rows: usize,
    k: usize,
    n: usize,
    multiprocessors: Option<u32>,
) -> usize {
    let halves = |s: usize| rows.is_multiple_of(2 * s);
    if let Some(fixed) = super::gpu_kernels::fixed_split() {
        let mut s = 1;
        while s < fixed && halves(s) {
            s *= 2;
        }
        return s;
    }
    let Some(multiprocessors) = multiprocessors else {
        return 1;
    };
    let target = SPLIT_BLOCKS_PER_MULTIPROCESSOR * multiprocessors as usize;
    let blocks = k.div_ceil(64) * n.div_ceil(64);
    let mut s = 1;
    while s * blocks < target && s < 32 && halves(s) && rows / (2 * s) >= SPLIT_MIN_ROWS {
        s *= 2;
    }
    s
}

/// Blocks of the weight gradient's output per multiprocessor, over all chunks, that
/// [`weight_gradient_splits`] aims for: several each, so that a multiprocessor has more than
/// one to hide its memory's latency and the last wave is short.
const SPLIT_BLOCKS_PER_MULTIPROCESSOR: usize = 8;

/// The fewest rows a chunk of [`weight_gradient_splits`] keeps: each chunk's product stays
/// long enough along its reduction to run at a product's speed.
const SPLIT_MIN_ROWS: usize = 512;

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

    /// Mixed precision's linear ops as one op each (`affine_one_op`, forced onto wgpu: Burn's
    /// product standing in for cuBLAS's) against the tracked casts around one-type products
    /// they replace, in f16 (lavapipe has no bf16): `linear` into `f32`, `linear_in_products`
    /// and `linear_gelu` into f16, `linear_into` from an f16 input into `f32`, and `matmul`.
    /// Output and the gradients of the input, the `f32` weight behind its f16 cast and the
    /// bias, each in its own type. (On CUDA the one op leaves the results and the input's
    /// gradient unrounded where the casts round them to f16; Burn's f16 product on wgpu rounds
    /// them too.)
    #[cfg(feature = "wgpu")]
    #[test]
    fn mixed_ops_as_one_op_equal_their_casts_on_wgpu() {
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice).autodiff();
        let half = FloatDType::F16;
        let layer = LinearConfig::new(24, 40).init(&device);
        let normal = Distribution::Normal(0.0, 1.0);
        let base = Tensor::<3>::random([3, 7, 24], normal, &device);
        for case in 0..5 {
            let run = |one_op: bool| {
                // The weights cast as `ember_model::precision` casts them: a tracked cast, one
                // per forward pass.
                let narrow = Linear {
                    weight: layer.weight.clone().map(|w| w.cast(half)),
                    bias: layer.bias.clone(),
                };
                cube::tests::EVERYWHERE.set(one_op);
                let taken = cube::tests::TAKEN.get();
                let x = base.clone().require_grad();
                let y = match case {
                    0 => linear(&narrow, x.clone()),
                    1 => linear_in_products(&narrow, x.clone()),
                    2 => linear_gelu(&narrow, x.clone(), false),
                    3 => linear_into(&narrow, x.clone().cast(half), DType::F32),
                    _ => {
                        matmul(x.clone().reshape([21, 24]), narrow.weight.val()).reshape([3, 7, 40])
                    }
                };
                cube::tests::EVERYWHERE.set(false);
                let took = cube::tests::TAKEN.get() - taken;
                assert_eq!(
                    took,
                    usize::from(one_op),
                    "case {case}: products by the one op"
                );
                let want = [DType::F32, DType::F16, DType::F16, DType::F32, DType::F32][case];
                assert_eq!(y.dtype(), want, "case {case}, one op {one_op}");
                let y = y.cast(FloatDType::F32);
                let grads = (y.clone() * y.clone().sin()).sum().backward();
                let gx = x.grad(&grads).unwrap();
                let gw = layer.weight.val().grad(&grads).unwrap();
                assert_eq!((gx.dtype(), gw.dtype()), (DType::F32, DType::F32));
                let mut out = vec![y.inner(), gx.reshape([3, 7, 24]), gw.unsqueeze()];
                if case < 4 {
                    out.push(
                        layer
                            .bias
                            .as_ref()
                            .unwrap()
                            .val()
                            .grad(&grads)
                            .unwrap()
                            .unsqueeze(),
                    );
                }
                out
            };
            let (ours, casts) = (run(true), run(false));
            assert_eq!(ours.len(), casts.len());
            for (i, (a, b)) in ours.into_iter().zip(casts).enumerate() {
                let scale = b.clone().abs().max().into_scalar::<f32>().max(1.0);
                let d = (a - b).abs().max().into_scalar::<f32>();
                assert!(
                    d < 1e-2 * scale,
                    "case {case}, output {i}: differs by {d} of {scale}"
                );
            }
        }
        // Turned off, the one op is taken by none of them.
        let off = crate::GpuPolicy {
            kernels: crate::GpuKernels::all(true)
                .with_strategy(crate::GpuStrategy::MixedProducts, false),
            ..crate::GpuPolicy::default()
        };
        let narrow = Linear {
            weight: layer.weight.clone().map(|w| w.cast(half)),
            bias: layer.bias.clone(),
        };
        let taken = cube::tests::TAKEN.get();
        cube::tests::EVERYWHERE.set(true);
        let _ = crate::gpu_kernels::with_policy(off, || {
            (
                linear(&narrow, base.clone()),
                linear_into(&narrow, base.clone().cast(half), DType::F32),
                matmul(base.clone().reshape([21, 24]), narrow.weight.val()),
            )
        });
        cube::tests::EVERYWHERE.set(false);
        assert_eq!(cube::tests::TAKEN.get(), taken, "taken while turned off");
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

    /// The split product against Burn's `matmul`: output and the gradients of both operands,
    /// for a weight read in place as a transposed view too, on flex and (feature `wgpu`) on
    /// lavapipe.
    #[test]
    fn split_rows_product_equals_burns() {
        #[allow(unused_mut)] // one device without the wgpu feature
        let mut devices = vec![Device::flex().autodiff()];
        #[cfg(feature = "wgpu")]
        devices.push(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice).autodiff());
        let normal = Distribution::Normal(0.0, 1.0);
        for device in devices {
            let a = Tensor::<2>::random([96, 24], normal, &device).require_grad();
            let w = Tensor::<2>::random([40, 24], normal, &device).require_grad();
            for (splits, transposed) in [(4, false), (8, true), (1, false)] {
                let run = |split: bool| {
                    let b = match transposed {
                        true => w.clone().transpose(),
                        false => w.clone().reshape([24, 40]),
                    };
                    let y = match split {
                        true => matmul_split_rows(a.clone(), b, splits),
                        false => matmul_reference(a.clone(), b),
                    };
                    assert_eq!(y.dims(), [96, 40]);
                    let grads = (y.clone() * y.clone().sin()).sum().backward();
                    let (ga, gw) = (a.grad(&grads).unwrap(), w.grad(&grads).unwrap());
                    [y.inner(), ga, gw.reshape([24, 40])]
                        .map(|t| t.unsqueeze::<3>())
                        .to_vec()
                };
                let what = format!("{device:?}, {splits} chunks, transposed {transposed}");
                assert_close(run(true), run(false), &what);
            }
        }
    }

    /// The rule's chunks for nanoGPT's GPU config's products (16384 rows) on a GPU of 132
    /// multiprocessors (an H100's), for a small model's (no split), where the rows do not
    /// halve, and on a GPU that does not report its multiprocessors (wgpu: none).
    #[test]
    fn weight_gradient_splits_fill_the_gpu() {
        if crate::gpu_kernels::fixed_split().is_some() {
            return; // EMBER_SPLIT_K fixes the answer
        }
        let h100 = Some(132);
        assert_eq!(weight_gradient_splits(16384, 384, 1152, h100), 16);
        assert_eq!(weight_gradient_splits(16384, 384, 384, h100), 32);
        assert_eq!(weight_gradient_splits(16384, 384, 1536, h100), 8);
        assert_eq!(weight_gradient_splits(16384, 1536, 384, h100), 8);
        assert_eq!(weight_gradient_splits(16384, 384, 65, h100), 32);
        assert_eq!(weight_gradient_splits(512, 64, 192, h100), 1);
        assert_eq!(weight_gradient_splits(3 * 4096, 384, 384, h100), 16);
        assert_eq!(weight_gradient_splits(16383, 384, 384, h100), 1);
        assert_eq!(weight_gradient_splits(4096 * 4096, 8192, 8192, h100), 1);
        assert_eq!(weight_gradient_splits(16384, 384, 1152, Some(20)), 2);
        assert_eq!(weight_gradient_splits(16384, 384, 1152, None), 1);
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
