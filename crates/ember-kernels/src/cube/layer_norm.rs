//! LayerNorm's normalisation and scale on the GPU: one CubeCL kernel forward, one backward (and
//! one reduction for the gain's and bias's gradients together), with its own autodiff op. Under autodiff Burn 0.22.1
//! builds LayerNorm from nine tensor ops (mean, subtraction, square, mean, `+ eps`, square
//! root, division, scale, shift) and their backward passes: about 25 kernel launches per layer
//! norm and step on a GPU without fusion, each a buffer written and read back.
//!
//! Forward, one cube per row: `mean`, `rstd = 1 / sqrt(mean((x - mean)^2) + eps)`,
//! `y = (x - mean) rstd gamma + beta` (the bias in the same pass: a separate addition is one
//! more launch per norm, in training and at every decoding step), and the row's `[mean, rstd]`
//! kept for the backward pass. Backward, one cube per [`CHUNK`] rows: for each row the cube
//! reduces `mean(h)` and `mean(h xhat)` (`h = dy gamma`, `xhat = (x - mean) rstd`), then each
//! unit walks its columns down the chunk, writing `dx = rstd (h - mean(h) - xhat mean(h xhat))`
//! and adding up `dy xhat` (gamma's gradient) and `dy` (beta's) over the chunk's rows; one
//! reduction over the chunks' sums gives both gradients. Before, the kernel wrote `dy xhat` for
//! every element (a buffer as large as the input) and two column sums over all rows followed, a
//! launch each. The expressions of flex's kernel ([`crate::kernels::layer_norm`]); the
//! reference is Burn's `LayerNorm`.
//!
//! RMSNorm is the same kernels with `centred` off: the mean taken as 0 (no first reduction
//! forward), `mean(h)` left out of `dx`.
//!
//! The units of a row's cube split its columns (unit `u` takes `u`, `u + units`, ...:
//! neighbouring units read neighbouring columns, one memory transaction per warp) and reduce
//! their sums through shared memory ([`super::reduce_cube`]).

use crate::GpuKernel;
use crate::cube::autodiff::tracked;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, TensorMetadata, backend_extension,
};
use burn::tensor::{DType, Shape, Slice, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

/// `(x - mean) * rstd * gamma + beta` over the last axis with epsilon `eps` (no `+ beta` without
/// one), where `x`, `gamma` and `beta` are `f32` tensors on a CubeCL device, all tracked by
/// autodiff or none; otherwise all back.
///
/// # Shapes
/// - x: `[..., D]`
/// - gamma, beta: `[D]`
/// - output: `[..., D]`
#[allow(clippy::type_complexity)]
pub(crate) fn layer_norm<const N: usize>(
    x: Tensor<N>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    eps: f64,
) -> Result<Tensor<N>, (Tensor<N>, Tensor<1>, Option<Tensor<1>>)> {
    normalized(x, gamma, beta, eps, true)
}

/// RMSNorm, `x * rstd * gamma` with `rstd = 1 / sqrt(mean(x^2) + eps)` over the last axis, where
/// `x` and `gamma` are `f32` tensors on a CubeCL device, both tracked by autodiff or neither;
/// otherwise both back.
///
/// # Shapes
/// - x: `[..., D]`
/// - gamma: `[D]`
/// - output: `[..., D]`
pub(crate) fn rms_norm<const N: usize>(
    x: Tensor<N>,
    gamma: Tensor<1>,
    eps: f64,
) -> Result<Tensor<N>, (Tensor<N>, Tensor<1>)> {
    normalized(x, gamma, None, eps, false).map_err(|(x, gamma, _)| (x, gamma))
}

/// [`layer_norm`], or with `centred` off [`rms_norm`] (the mean taken as 0).
#[allow(clippy::type_complexity)]
fn normalized<const N: usize>(
    x: Tensor<N>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    eps: f64,
    centred: bool,
) -> Result<Tensor<N>, (Tensor<N>, Tensor<1>, Option<Tensor<1>>)> {
    let dims = x.dims();
    let d = dims[N - 1];
    let tracked = x.device().is_autodiff();
    let fits = |p: &Tensor<1>| {
        super::gpu_kernel_takes(GpuKernel::LayerNorm, p)
            && p.device().is_autodiff() == tracked
            && p.dims()[0] == d
    };
    let take = super::gpu_kernel_takes(GpuKernel::LayerNorm, &x)
        && fits(&gamma)
        && beta.as_ref().is_none_or(fits);
    if !take || d == 0 || x.shape().num_elements() == 0 {
        return Err((x, gamma, beta));
    }
    let rows = x.shape().num_elements() / d;
    let bias = beta.is_some();
    // Without a bias the kernel never reads its `beta`: gamma stands in.
    let beta = beta.unwrap_or_else(|| gamma.clone());
    let y = <Dispatch as LayerNormKernels>::layer_norm(
        x.reshape([rows, d]).into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        eps as f32,
        bias,
        centred,
    );
    Ok(Tensor::<2>::from_dispatch(y).reshape(dims))
}

/// The LayerNorm op on every backend that has the kernels: CubeCL's, Burn's fusion over it, and
/// autodiff over either.
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub trait LayerNormKernels: Backend {
    /// `(x - mean) rstd gamma (+ beta with bias)` of the rows of `x` `[R, D]` (mean 0 unless
    /// `centred`: RMSNorm).
    #[fusion(default)]
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f32,
        bias: bool,
        centred: bool,
    ) -> FloatTensor<Self> {
        Self::layer_norm_forward(x, gamma, beta, eps, bias, centred).0
    }

    /// The output `[R, D]` and each row's `[mean, rstd]` (`[R, 2]`).
    #[fusion(meta = forward_specs)]
    fn layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f32,
        bias: bool,
        centred: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradient of `x` `[R, D]`, and those of `gamma` and `beta` as the rows of `[2, D]`,
    /// from the output's `grad` `[R, D]`.
    #[fusion(meta = backward_specs)]
    fn layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        centred: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

#[cfg(feature = "fusion")]
use burn::backend::fusion::custom::TensorSpec;

/// The shapes of the forward pass's outputs, for fusion (which defers the kernels).
#[cfg(feature = "fusion")]
fn forward_specs(
    x: &TensorSpec,
    _gamma: &TensorSpec,
    _beta: &TensorSpec,
    _eps: &f32,
    _bias: &bool,
    _centred: &bool,
) -> (TensorSpec, TensorSpec) {
    let [rows, _] = x.shape.dims::<2>();
    (x.clone(), TensorSpec::new(Shape::new([rows, 2]), x.dtype))
}

/// The shapes of the backward pass's outputs: `x`'s, and `gamma`'s and `beta`'s as two rows.
#[cfg(feature = "fusion")]
fn backward_specs(
    x: &TensorSpec,
    gamma: &TensorSpec,
    _stats: &TensorSpec,
    _grad: &TensorSpec,
    _centred: &bool,
) -> (TensorSpec, TensorSpec) {
    let [d] = gamma.shape.dims::<1>();
    (x.clone(), TensorSpec::new(Shape::new([2, d]), gamma.dtype))
}

/// Rows of one cube of the backward kernel: each cube writes one row of gain and bias sums, so
/// the reduction after it reads `R / CHUNK` rows instead of two passes over `R`, while the launch
/// keeps `R / CHUNK` cubes (2048 for nanoGPT's GPU config) to fill a GPU.
const CHUNK: usize = 8;

impl LayerNormKernels for CubeBackend {
    fn layer_norm_forward(
        x: CubeTensor,
        gamma: CubeTensor,
        beta: CubeTensor,
        eps: f32,
        bias: bool,
        centred: bool,
    ) -> (CubeTensor, CubeTensor) {
        let [x, gamma, beta] = [x, gamma, beta].map(into_contiguous);
        let [rows, d] = x.shape().dims::<2>();
        assert_eq!(x.dtype(), DType::F32, "LayerNorm kernel: f32 only");
        let w = row_lanes(&[&x, &gamma, &beta], d);
        let (y, stats) = (super::empty(&x, [rows, d]), super::empty(&x, [rows, 2]));
        let (count, dim) = super::row_cubes(rows);
        kernels::layer_norm_forward::launch::<f32>(
            &x.client.clone(),
            count,
            dim,
            w,
            x.into_tensor_arg(),
            gamma.into_tensor_arg(),
            beta.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            stats.clone().into_tensor_arg(),
            eps,
            d / w,
            w,
            bias,
            centred,
        );
        (y, stats)
    }

    fn layer_norm_backward(
        x: CubeTensor,
        gamma: CubeTensor,
        stats: CubeTensor,
        grad: CubeTensor,
        centred: bool,
    ) -> (CubeTensor, CubeTensor) {
        let [x, gamma, stats, grad] = [x, gamma, stats, grad].map(into_contiguous);
        let [rows, d] = x.shape().dims::<2>();
        let w = row_lanes(&[&x, &gamma, &grad], d);
        let chunks = rows.div_ceil(CHUNK);
        let (dx, sums) = (
            super::empty(&x, [rows, d]),
            super::empty(&x, [chunks, 2 * d]),
        );
        let (count, dim) = super::row_cubes(chunks);
        kernels::layer_norm_backward::launch::<f32>(
            &x.client.clone(),
            count,
            dim,
            w,
            x.into_tensor_arg(),
            gamma.into_tensor_arg(),
            stats.into_tensor_arg(),
            grad.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            sums.clone().into_tensor_arg(),
            d / w,
            CHUNK,
            w,
            centred,
        );
        // The chunks' sums added by the backend's reduction: `[gamma's | beta's]`.
        let sums = match chunks {
            1 => sums,
            _ => CubeBackend::float_sum_dim(sums, 0),
        };
        (dx, CubeBackend::float_reshape(sums, Shape::new([2, d])))
    }
}

/// Values per vector the kernels read and write: the widest that divides the row's `d` values
/// and where each of `tensors` starts ([`super::elementwise_lanes`]); 1 where none does.
fn row_lanes(tensors: &[&CubeTensor], d: usize) -> usize {
    tensors
        .iter()
        .map(|t| super::elementwise_lanes(t, d))
        .min()
        .unwrap_or(1)
}

impl<B: LayerNormKernels, C: CheckpointStrategy> LayerNormKernels for Autodiff<B, C> {
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f32,
        bias: bool,
        centred: bool,
    ) -> FloatTensor<Self> {
        if !bias {
            // No shift: `beta` is not an input (the kernel reads `gamma` in its place).
            let node = ScaledNorm { centred };
            return tracked::<B, C, _, _>(node, [x, gamma], |[x, gamma]| {
                let (g, b) = (gamma.clone(), gamma.clone());
                let (y, stats) = B::layer_norm_forward(x.clone(), g, b, eps, false, centred);
                (y, (x, gamma, stats))
            });
        }
        let node = ShiftedNorm { centred };
        tracked::<B, C, _, _>(node, [x, gamma, beta], |[x, gamma, beta]| {
            let g = gamma.clone();
            let (y, stats) = B::layer_norm_forward(x.clone(), g, beta, eps, true, centred);
            (y, (x, gamma, stats))
        })
    }

    // The two passes on their own are not differentiated: only the op above is.
    fn layer_norm_forward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f32,
        bias: bool,
        centred: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [x, gamma, beta] = [x, gamma, beta].map(Self::inner);
        let (y, stats) = B::layer_norm_forward(x, gamma, beta, eps, bias, centred);
        (Self::from_inner(y), Self::from_inner(stats))
    }

    fn layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        centred: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [x, gamma, stats, grad] = [x, gamma, stats, grad].map(Self::inner);
        let (dx, dgamma) = B::layer_norm_backward(x, gamma, stats, grad, centred);
        (Self::from_inner(dx), Self::from_inner(dgamma))
    }
}

/// The autodiff node of the LayerNorm kernels without a bias (RMSNorm's when not `centred`).
#[derive(Debug)]
struct ScaledNorm {
    centred: bool,
}

/// The autodiff node of the LayerNorm kernels with a bias.
#[derive(Debug)]
struct ShiftedNorm {
    centred: bool,
}

/// The input, gamma and each row's `[mean, rstd]`.
type NormState<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

impl<B: LayerNormKernels> Backward<B, 2> for ScaledNorm {
    type State = NormState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (x, gamma, stats) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let (dx, params) = B::layer_norm_backward(x, gamma, stats, grad, self.centred);
        let [x_node, gamma_node] = ops.parents;
        for (node, grad) in [(x_node, dx), (gamma_node, param_row::<B>(&params, 0))] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Row `row` of the backward pass's `[2, D]` parameter gradients (0: gamma's, 1: beta's), as
/// `[D]`.
fn param_row<B: Backend>(params: &FloatTensor<B>, row: usize) -> FloatTensor<B> {
    let [_, d] = params.shape().dims::<2>();
    let slice = B::float_slice(params.clone(), &[Slice::from(row..row + 1)]);
    B::float_reshape(slice, Shape::new([d]))
}

impl<B: LayerNormKernels> Backward<B, 3> for ShiftedNorm {
    type State = NormState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (x, gamma, stats) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [x_node, gamma_node, beta_node] = ops.parents;
        let (dx, params) = B::layer_norm_backward(x, gamma, stats, grad, self.centred);
        let (dgamma, dbeta) = (param_row::<B>(&params, 0), param_row::<B>(&params, 1));
        for (node, grad) in [(x_node, dx), (gamma_node, dgamma), (beta_node, dbeta)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

mod kernels {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use crate::cube::{ROW_UNITS, cube_row, reduce_cube};

    /// One cube per row `r` of `x` `[R, D]` (`vectors` vectors of `w` values a row): `y` (with
    /// `beta` added when `bias`) and `stats[r] = [mean, rstd]` (mean 0 unless `centred`).
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_norm_forward<F: Float, N: Size>(
        x: &Tensor<Vector<F, N>>,
        gamma: &Tensor<Vector<F, N>>,
        beta: &Tensor<Vector<F, N>>,
        y: &mut Tensor<Vector<F, N>>,
        stats: &mut Tensor<F>,
        eps: f32,
        vectors: usize,
        #[comptime] w: usize,
        #[comptime] bias: bool,
        #[comptime] centred: bool,
    ) {
        let r = cube_row();
        if r >= stats.shape(0) {
            terminate!();
        }
        let (u, units) = (UNIT_POS_X as usize, CUBE_DIM_X as usize);
        let at = r * vectors;
        let n = F::cast_from(vectors * w);
        let mut scratch = Shared::<[F]>::new_slice(ROW_UNITS);
        let mut mean = F::new(0.0);
        if centred {
            let mut sum = F::new(0.0);
            for j in range_stepped(u, vectors, units) {
                let v = x[at + j];
                #[unroll]
                for l in 0..w {
                    sum += v.extract(l);
                }
            }
            mean = reduce_cube::<F>(&mut scratch, sum, false) / n;
        }
        let mut squares = F::new(0.0);
        for j in range_stepped(u, vectors, units) {
            let v = x[at + j];
            #[unroll]
            for l in 0..w {
                let c = v.extract(l) - mean;
                squares += c * c;
            }
        }
        let squares = reduce_cube::<F>(&mut scratch, squares, false);
        let rstd = F::new(1.0) / F::sqrt(squares / n + F::cast_from(eps));
        for j in range_stepped(u, vectors, units) {
            let v = x[at + j];
            let g = gamma[j];
            let mut out = v;
            #[unroll]
            for l in 0..w {
                out.insert(l, (v.extract(l) - mean) * rstd * g.extract(l));
            }
            if bias {
                out += beta[j];
            }
            y[at + j] = out;
        }
        if u == 0 {
            stats[2 * r] = mean;
            stats[2 * r + 1] = rstd;
        }
    }

    /// One cube per `chunk` rows (fewer in the last; `vectors` vectors of `w` values a row):
    /// `dx` of each row (without its `mean(h)` term unless `centred`), and in row `c` of `sums`
    /// `[chunks, 2 D]` the chunk's column sums of `dy xhat` (`0..D`) and `dy` (`D..2 D`).
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_norm_backward<F: Float, N: Size>(
        x: &Tensor<Vector<F, N>>,
        gamma: &Tensor<Vector<F, N>>,
        stats: &Tensor<F>,
        grad: &Tensor<Vector<F, N>>,
        dx: &mut Tensor<Vector<F, N>>,
        sums: &mut Tensor<Vector<F, N>>,
        vectors: usize,
        #[comptime] chunk: usize,
        #[comptime] w: usize,
        #[comptime] centred: bool,
    ) {
        let c = cube_row();
        if c >= sums.shape(0) {
            terminate!();
        }
        let (u, units) = (UNIT_POS_X as usize, CUBE_DIM_X as usize);
        let n = F::cast_from(vectors * w);
        let first = c * chunk;
        let mut last = first + chunk;
        if last > stats.shape(0) {
            last = stats.shape(0);
        }
        // Each row's a = mean(h) and b = mean(h xhat), h = dy gamma, for the column walk below.
        let mut scratch = Shared::<[F]>::new_slice(ROW_UNITS);
        let mut means = Shared::<[F]>::new_slice(2 * chunk);
        for r in first..last {
            let at = r * vectors;
            let mean = stats[2 * r];
            let rstd = stats[2 * r + 1];
            let mut a = F::new(0.0);
            let mut b = F::new(0.0);
            for j in range_stepped(u, vectors, units) {
                let (xv, dy, g) = (x[at + j], grad[at + j], gamma[j]);
                #[unroll]
                for l in 0..w {
                    let xhat = (xv.extract(l) - mean) * rstd;
                    let h = dy.extract(l) * g.extract(l);
                    a += h;
                    b += h * xhat;
                }
            }
            let mut a = reduce_cube::<F>(&mut scratch, a, false) / n;
            if !centred {
                a = F::new(0.0);
            }
            let b = reduce_cube::<F>(&mut scratch, b, false) / n;
            if u == 0 {
                means[2 * (r - first)] = a;
                means[2 * (r - first) + 1] = b;
            }
        }
        sync_cube();
        // Each unit down its columns: dx, and the chunk's sums for gamma and beta.
        for j in range_stepped(u, vectors, units) {
            let g = gamma[j];
            let mut gain = Vector::<F, N>::new(F::new(0.0));
            let mut shift = Vector::<F, N>::new(F::new(0.0));
            for r in first..last {
                let at = r * vectors;
                let mean = stats[2 * r];
                let rstd = stats[2 * r + 1];
                let (xv, dy) = (x[at + j], grad[at + j]);
                let a = means[2 * (r - first)];
                let b = means[2 * (r - first) + 1];
                let mut d = xv;
                let mut xhat = xv;
                #[unroll]
                for l in 0..w {
                    let xh = (xv.extract(l) - mean) * rstd;
                    xhat.insert(l, xh);
                    d.insert(l, rstd * (dy.extract(l) * g.extract(l) - a - xh * b));
                }
                dx[at + j] = d;
                gain += dy * xhat;
                shift += dy;
            }
            sums[c * 2 * vectors + j] = gain;
            sums[c * 2 * vectors + vectors + j] = shift;
        }
    }
}
