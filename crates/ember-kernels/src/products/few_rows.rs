//! [`crate::affine`] of a few rows on the GPU: the product and the bias in one kernel (and
//! for [`crate::linear_gelu`], the GELU of each output value before it is written).
//!
//! A decoding step multiplies one row per sequence by each weight matrix. Through Burn's ops
//! that is a matrix product (cubek's kernels, built for tiles of many rows) and then the bias
//! added in a second launch: two launches per linear layer, eight per block of a decoder-only
//! model and token. Here one launch does both: a cube covers [`COLUMNS`] output columns, its
//! units split the input's columns [`SLICES`] ways (unit `(c, s)` reads weight rows `s`,
//! `s + SLICES`, ... of column `c`, four at a time: neighbouring units, neighbouring weights,
//! one memory transaction per warp), keep one sum per input row in registers, and the slices'
//! partial sums meet in shared memory, where the bias is added.
//!
//! Plain tensors only (decoding is never differentiated) and at most [`MAX_ROWS`] rows: more rows
//! (a prompt, a training batch) are what the general product is for.

use crate::GpuKernel;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, TensorMetadata, backend_extension,
};
use burn::tensor::{DType, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

/// Most rows the kernel takes: each unit keeps one sum per row in registers, and the kernel is
/// compiled once per row count.
pub(crate) const MAX_ROWS: usize = 8;

/// Output columns of a cube: a warp's worth.
const COLUMNS: usize = 32;

/// Ways a cube's units split the input's columns: with [`COLUMNS`], 512 units, and at most
/// 16 KiB of shared memory for the partial sums of [`MAX_ROWS`] rows (Vulkan's guaranteed
/// minimum).
const SLICES: usize = 16;

/// `x @ weight (+ bias)` over the last axis, for plain `f32` tensors on a CubeCL device with at
/// most [`MAX_ROWS`] rows in all; otherwise everything back.
///
/// # Shapes
/// - x: `[..., K]`
/// - weight: `[K, N]` (any strides: a slice or transposed view is read in place)
/// - bias: `[N]`
/// - output: `[..., N]`
#[allow(clippy::type_complexity)]
pub(crate) fn affine<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Result<Tensor<D>, (Tensor<D>, Tensor<2>, Option<Tensor<1>>)> {
    affine_then(x, weight, bias, Epilogue::None)
}

/// What the kernel applies to each output value after the bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Epilogue {
    /// Nothing: `x @ weight (+ bias)`.
    None,
    /// GELU (the tanh approximation when `tanh`): an MLP's expansion and its non-linearity in
    /// one launch.
    Gelu { tanh: bool },
}

/// [`affine`] followed by `epilogue`, under the same conditions (and for a GELU, the GELU
/// kernel not turned off); the inputs back otherwise.
#[allow(clippy::type_complexity)]
pub(crate) fn affine_then<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    epilogue: Epilogue,
) -> Result<Tensor<D>, (Tensor<D>, Tensor<2>, Option<Tensor<1>>)> {
    let (gelu, tanh) = match epilogue {
        Epilogue::None => (false, false),
        Epilogue::Gelu { tanh } => (true, tanh),
    };
    if gelu && !crate::gpu_kernels::uses(GpuKernel::Gelu) {
        return Err((x, weight, bias));
    }
    let dims = x.dims();
    let [k, n] = weight.dims();
    let rows: usize = dims[..D.saturating_sub(1)].iter().product();
    let take = D >= 2
        && (1..=MAX_ROWS).contains(&rows)
        && n > 0
        && dims[D - 1] == k
        && crate::cube::gpu_kernel_takes_plain(GpuKernel::Linear, &x)
        && crate::cube::gpu_kernel_takes_plain(GpuKernel::Linear, &weight)
        && bias.as_ref().is_none_or(|b| {
            crate::cube::gpu_kernel_takes_plain(GpuKernel::Linear, b) && b.dims()[0] == n
        });
    if !take {
        return Err((x, weight, bias));
    }
    let has_bias = bias.is_some();
    // Without a bias the kernel never reads its `bias`: the weight stands in as it is (a reshape
    // of a sliced or transposed weight would copy it).
    let bias = match bias {
        Some(bias) => bias.into_dispatch(),
        None => weight.clone().into_dispatch(),
    };
    let y = <Dispatch as LinearKernels>::affine_rows(
        x.reshape([rows, k]).into_dispatch(),
        weight.into_dispatch(),
        bias,
        has_bias,
        gelu,
        tanh,
    );
    let mut out = dims;
    out[D - 1] = n;
    Ok(Tensor::<2>::from_dispatch(y).reshape(out))
}

/// The few-row linear op on every backend that has the kernel: CubeCL's, Burn's fusion over it,
/// and autodiff over either (which hands it the inner tensors: it is never differentiated).
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub trait LinearKernels: Backend {
    /// `x @ weight`, plus `bias` when `has_bias`, then GELU when `gelu` (the tanh approximation
    /// when `tanh`), for `x` `[M, K]` (`M <= MAX_ROWS`), `weight` `[K, N]`, `bias` `[N]`:
    /// `[M, N]`.
    #[fusion(meta = output_spec)]
    fn affine_rows(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        has_bias: bool,
        gelu: bool,
        tanh: bool,
    ) -> FloatTensor<Self>;
}

/// The output's shape `[M, N]`, for fusion (which defers the kernel).
#[cfg(feature = "fusion")]
fn output_spec(
    x: &burn::backend::fusion::custom::TensorSpec,
    weight: &burn::backend::fusion::custom::TensorSpec,
    _bias: &burn::backend::fusion::custom::TensorSpec,
    _has_bias: &bool,
    _gelu: &bool,
    _tanh: &bool,
) -> burn::backend::fusion::custom::TensorSpec {
    let [m, _] = x.shape.dims::<2>();
    let [_, n] = weight.shape.dims::<2>();
    burn::backend::fusion::custom::TensorSpec::new(burn::tensor::Shape::new([m, n]), x.dtype)
}

impl LinearKernels for CubeBackend {
    fn affine_rows(
        x: CubeTensor,
        weight: CubeTensor,
        bias: CubeTensor,
        has_bias: bool,
        gelu: bool,
        tanh: bool,
    ) -> CubeTensor {
        let [m, _] = x.shape().dims::<2>();
        let [_, n] = weight.shape().dims::<2>();
        assert_eq!(x.dtype(), DType::F32, "few-row linear kernel: f32 only");
        assert!(m <= MAX_ROWS, "few-row linear kernel: {m} rows");
        let out = crate::cube::empty(&x, [m, n]);
        kernels::affine_rows::launch::<f32>(
            &x.client.clone(),
            CubeCount::new_1d(n.div_ceil(COLUMNS) as u32),
            CubeDim::new_2d(COLUMNS as u32, SLICES as u32),
            x.into_tensor_arg(),
            weight.into_tensor_arg(),
            bias.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            m,
            has_bias,
            gelu,
            tanh,
        );
        out
    }
}

impl<B: LinearKernels, C: CheckpointStrategy> LinearKernels for Autodiff<B, C> {
    // Never differentiated: the entry point takes plain tensors only.
    fn affine_rows(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        has_bias: bool,
        gelu: bool,
        tanh: bool,
    ) -> FloatTensor<Self> {
        let [x, weight, bias] = [x, weight, bias].map(Self::inner);
        Self::from_inner(B::affine_rows(x, weight, bias, has_bias, gelu, tanh))
    }
}

mod kernels {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::{COLUMNS, MAX_ROWS, SLICES};
    use crate::cube::gelu::kernels::gelu_of;

    /// Column `c = CUBE_POS_X * COLUMNS + UNIT_POS_X` of `out` `[rows, N]`: unit `(c, s)` sums
    /// `x[r, i] * weight[i, c]` over `i = s, s + SLICES, ...` for every row `r`, then the units
    /// of slice 0 add the other slices' sums (and `bias[c]`), take the GELU when `gelu`, and
    /// write the column.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    pub(super) fn affine_rows<F: Float>(
        x: &Tensor<F>,
        weight: &Tensor<F>,
        bias: &Tensor<F>,
        out: &mut Tensor<F>,
        #[comptime] rows: usize,
        #[comptime] has_bias: bool,
        #[comptime] gelu: bool,
        #[comptime] tanh: bool,
    ) {
        let (u, s) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
        let c = CUBE_POS_X as usize * COLUMNS + u;
        let (k, n) = (weight.shape(0), weight.shape(1));
        let live = c < n;
        let mut sums = Array::<F>::new(MAX_ROWS);
        #[unroll]
        for r in 0..rows {
            sums[r] = F::new(0.0);
        }
        if live {
            let (column, step) = (c * weight.stride(1), weight.stride(0));
            let (xr, xi) = (x.stride(0), x.stride(1));
            // Four weights in flight per unit (a GPU hides one load's latency behind the
            // others), then the rest one at a time.
            let mut i = s;
            while i + 3 * SLICES < k {
                let w0 = weight[i * step + column];
                let w1 = weight[(i + SLICES) * step + column];
                let w2 = weight[(i + 2 * SLICES) * step + column];
                let w3 = weight[(i + 3 * SLICES) * step + column];
                #[unroll]
                for r in 0..rows {
                    let at = r * xr + i * xi;
                    sums[r] += x[at] * w0
                        + x[at + SLICES * xi] * w1
                        + x[at + 2 * SLICES * xi] * w2
                        + x[at + 3 * SLICES * xi] * w3;
                }
                i += 4 * SLICES;
            }
            while i < k {
                let w = weight[i * step + column];
                #[unroll]
                for r in 0..rows {
                    sums[r] += x[r * xr + i * xi] * w;
                }
                i += SLICES;
            }
        }
        // Slice s's sum of row r for column u at partial[(r * SLICES + s) * COLUMNS + u].
        let mut partial = Shared::<[F]>::new_slice(rows * SLICES * COLUMNS);
        #[unroll]
        for r in 0..rows {
            partial[(r * SLICES + s) * COLUMNS + u] = sums[r];
        }
        sync_cube();
        if live && s == 0 {
            #[unroll]
            for r in 0..rows {
                let mut total = F::new(0.0);
                #[unroll]
                for t in 0..SLICES {
                    total += partial[(r * SLICES + t) * COLUMNS + u];
                }
                if has_bias {
                    total += bias[c * bias.stride(0)];
                }
                if gelu {
                    total = gelu_of::<F>(total, tanh);
                }
                out[r * n + c] = total;
            }
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn::tensor::{DeviceKind, Distribution};

    /// Against Burn's `linear` (product, then bias) given the same tensors: one row (a decoding
    /// step), a batch of sequences, the most rows, with and without a bias, widths that are not
    /// multiples of a cube's columns or slices, a weight that is a column slice of a larger one
    /// (as cross-attention reads `c_attn`) and a transposed view.
    #[test]
    fn few_row_linear_equals_burns_on_wgpu() {
        let device = burn::tensor::Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(0.0, 1.0);
        for (leading, k, n) in [
            (vec![1, 1], 32, 96),
            (vec![3, 1], 37, 50),
            (vec![2, 4], 64, 33),
            (vec![1, 5], 7, 1),
            (vec![8, 1], 200, 600),
        ] {
            let rows: usize = leading.iter().product();
            let x = Tensor::<2>::random([rows, k], normal, &device)
                .reshape([leading[0], leading[1], k]);
            let whole = Tensor::<2>::random([k, 3 * n], normal, &device);
            let bias = Tensor::<1>::random([3 * n], normal, &device);
            let weights = [
                whole.clone().slice([0..k, 0..n]),
                whole.clone().slice([0..k, n..2 * n]),
                Tensor::<2>::random([n, k], normal, &device).transpose(),
            ];
            for weight in weights {
                for b in [None, Some(bias.clone().narrow(0, n, n))] {
                    let what = format!("{leading:?} x [{k}, {n}], bias {}", b.is_some());
                    let want = burn::tensor::module::linear(x.clone(), weight.clone(), b.clone());
                    let got = affine(x.clone(), weight.clone(), b)
                        .unwrap_or_else(|_| panic!("{what}: plain wgpu f32 tensors"));
                    assert_eq!(got.dims(), want.dims(), "{what}");
                    let scale = want.clone().abs().max().into_scalar::<f32>().max(1.0);
                    let diff = (got - want).abs().max().into_scalar::<f32>();
                    assert!(diff < 2e-6 * scale * (k as f32).sqrt(), "{what}: {diff}");
                }
            }
        }
    }

    /// The product, the bias and either GELU in one kernel against Burn's linear and GELU: one
    /// row and the most rows, with and without a bias; more rows than the kernel takes give
    /// the same values through the general path.
    #[test]
    fn few_row_linear_gelu_equals_burns_on_wgpu() {
        use crate::{linear_gelu, linear_gelu_reference};
        use burn::nn::LinearConfig;
        let device = burn::tensor::Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(0.0, 1.0);
        for (rows, bias, tanh) in [
            (1, true, false),
            (8, false, true),
            (8, true, false),
            (9, true, true),
        ] {
            let layer = LinearConfig::new(70, 100).with_bias(bias).init(&device);
            let x = Tensor::<3>::random([1, rows, 70], normal, &device);
            let what = format!("{rows} rows, bias {bias}, tanh {tanh}");
            if rows <= MAX_ROWS {
                let epilogue = Epilogue::Gelu { tanh };
                let b = layer.bias.as_ref().map(|b| b.val());
                assert!(
                    affine_then(x.clone(), layer.weight.val(), b, epilogue).is_ok(),
                    "{what}"
                );
            }
            let got = linear_gelu(&layer, x.clone(), tanh);
            let want = linear_gelu_reference(&layer, x, tanh);
            assert_eq!(got.dims(), [1, rows, 100], "{what}");
            let diff = (got - want).abs().max().into_scalar::<f32>();
            assert!(diff < 1e-5, "{what}: {diff}");
        }
    }

    /// More rows than [`MAX_ROWS`], tracked tensors and a mismatched width go back to the
    /// caller for the general product.
    #[test]
    fn many_rows_and_tracked_tensors_are_handed_back() {
        let device = burn::tensor::Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(0.0, 1.0);
        let w = Tensor::<2>::random([16, 8], normal, &device);
        let many = Tensor::<3>::random([3, 3, 16], normal, &device);
        assert!(affine(many, w.clone(), None).is_err());
        let narrow = Tensor::<3>::random([1, 1, 15], normal, &device);
        assert!(affine(narrow, w.clone(), None).is_err());
        let tracked = device.clone().autodiff();
        let x = Tensor::<3>::random([1, 1, 16], normal, &tracked);
        let w = Tensor::<2>::random([16, 8], normal, &tracked);
        assert!(affine(x, w, None).is_err());
    }
}
