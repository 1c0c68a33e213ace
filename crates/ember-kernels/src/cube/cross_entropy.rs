//! [`crate::cross_entropy`] on the GPU: three launches a training step instead of about
//! twenty-seven, with its own autodiff op.
//!
//! Burn's tensor ops build the loss from `log_softmax` (maximum, subtraction, `exp`, sum, `log`,
//! subtraction), `gather`, negation, the padding mask and the mean, each a launch and a buffer
//! (`[N, V]` ones among them, the log-probabilities kept for the backward pass), and autodiff
//! differentiates each again. Here, forward: one cube per row computes the row's log-sum-exp
//! `lse = max + ln(sum(exp(x - max)))` and its loss `(1 - e)(lse - x_t) + e(lse - mean(x))`
//! (0 for a padding target), then one cube adds the rows' losses and divides by the count of
//! rows that are not padding (at least 1). Kept: each row's `lse` and `1 / count`. Backward,
//! one unit per logit: `dx = g / count * (exp(x - lse) - (1 - e)[j = t] - e / V)` on rows that
//! are not padding, 0 on the others.

use crate::GpuKernel;
use crate::cube::autodiff::tracked;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, unary};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, Dispatch, TensorMetadata, backend_extension,
};
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::{CubeCount, CubeDim};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

/// The padding id the kernels compare targets with when there is no padding: no target is
/// negative.
const NO_PAD: i32 = -1;

/// The mean cross-entropy where `logits` is an `f32` tensor on a CubeCL device (tracked by
/// autodiff or not) and the padding id, if any, fits an `i32`; the inputs back otherwise.
///
/// # Shapes
/// - logits: `[N, V]`
/// - targets: `[N]`
/// - output: `[1]`
#[allow(clippy::type_complexity)]
pub(crate) fn cross_entropy(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    pad: Option<u32>,
    smoothing: f64,
) -> Result<Tensor<1>, (Tensor<2>, Tensor<1, Int>)> {
    let [n, v] = logits.dims();
    let pad = pad.map_or(Ok(NO_PAD), i32::try_from);
    let take = super::gpu_kernel_takes(GpuKernel::CrossEntropy, &logits) && n > 0 && v > 0;
    let (true, Ok(pad)) = (take, pad) else {
        return Err((logits, targets));
    };
    let loss = <Dispatch as CrossEntropyKernels>::cross_entropy(
        logits.into_dispatch(),
        targets.into_dispatch(),
        pad,
        smoothing as f32,
    );
    Ok(Tensor::from_dispatch(loss))
}

/// The cross-entropy op on every backend that has the kernels: CubeCL's, Burn's fusion over it,
/// and autodiff over either.
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub trait CrossEntropyKernels: Backend {
    /// The mean loss `[1]` of `logits` `[N, V]` against `targets` `[N]`, rows whose target is
    /// `pad` left out, with label smoothing `smoothing`.
    #[fusion(default)]
    fn cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        pad: i32,
        smoothing: f32,
    ) -> FloatTensor<Self> {
        Self::cross_entropy_forward(logits, targets, pad, smoothing).0
    }

    /// The mean loss `[1]` and what the backward pass needs, `[N + 1]`: each row's log-sum-exp,
    /// then `1 / count`.
    #[fusion(meta = forward_specs)]
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        pad: i32,
        smoothing: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The logits' gradient `[N, V]` from the loss's `grad` `[1]`.
    #[fusion(dtype = logits, shape = logits)]
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        pad: i32,
        smoothing: f32,
    ) -> FloatTensor<Self>;
}

#[cfg(feature = "fusion")]
use burn::backend::fusion::custom::TensorSpec;

/// The shapes of the forward pass's outputs, for fusion (which defers the kernels).
#[cfg(feature = "fusion")]
fn forward_specs(
    logits: &TensorSpec,
    _targets: &TensorSpec,
    _pad: &i32,
    _smoothing: &f32,
) -> (TensorSpec, TensorSpec) {
    use burn::tensor::Shape;
    let [n, _] = logits.shape.dims::<2>();
    (
        TensorSpec::new(Shape::new([1]), logits.dtype),
        TensorSpec::new(Shape::new([n + 1]), logits.dtype),
    )
}

impl CrossEntropyKernels for CubeBackend {
    fn cross_entropy_forward(
        logits: CubeTensor,
        targets: CubeTensor,
        pad: i32,
        smoothing: f32,
    ) -> (CubeTensor, CubeTensor) {
        let logits = into_contiguous(logits);
        let targets = super::ids_i32(targets);
        assert_eq!(logits.dtype(), DType::F32, "cross-entropy kernel: f32 only");
        let [n, _] = logits.shape().dims::<2>();
        let (rows, stats, loss) = (
            super::empty(&logits, [n]),
            super::empty(&logits, [n + 1]),
            super::empty(&logits, [1]),
        );
        let client = logits.client.clone();
        let (count, dim) = super::row_cubes(n);
        kernels::cross_entropy_rows::launch::<f32>(
            &client,
            count,
            dim,
            logits.into_tensor_arg(),
            targets.clone().into_tensor_arg(),
            rows.clone().into_tensor_arg(),
            stats.clone().into_tensor_arg(),
            pad,
            smoothing,
        );
        kernels::cross_entropy_mean::launch::<f32>(
            &client,
            CubeCount::new_1d(1),
            CubeDim::new_1d(MEAN_UNITS as u32),
            rows.into_tensor_arg(),
            targets.into_tensor_arg(),
            loss.clone().into_tensor_arg(),
            stats.clone().into_tensor_arg(),
            pad,
            MEAN_UNITS,
        );
        (loss, stats)
    }

    fn cross_entropy_backward(
        logits: CubeTensor,
        targets: CubeTensor,
        stats: CubeTensor,
        grad: CubeTensor,
        pad: i32,
        smoothing: f32,
    ) -> CubeTensor {
        let [logits, stats, grad] = [logits, stats, grad].map(into_contiguous);
        let targets = super::ids_i32(targets);
        let dx = super::empty(&logits, logits.shape());
        let (count, dim) = super::launch_size(&logits, logits.shape().num_elements());
        kernels::cross_entropy_backward::launch::<f32>(
            &logits.client.clone(),
            count,
            dim,
            logits.into_tensor_arg(),
            targets.into_tensor_arg(),
            stats.into_tensor_arg(),
            grad.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            pad,
            smoothing,
        );
        dx
    }
}

/// Units of the one cube that adds the rows' losses (a power of two).
const MEAN_UNITS: usize = 256;

impl<B: CrossEntropyKernels, C: CheckpointStrategy> CrossEntropyKernels for Autodiff<B, C> {
    fn cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        pad: i32,
        smoothing: f32,
    ) -> FloatTensor<Self> {
        tracked::<B, C, _, _>(CrossEntropy { pad, smoothing }, [logits], |[logits]| {
            let (loss, stats) =
                B::cross_entropy_forward(logits.clone(), targets.clone(), pad, smoothing);
            (loss, (logits, targets, stats))
        })
    }

    // The two passes on their own are not differentiated: only the op above is.
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        pad: i32,
        smoothing: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (loss, stats) = B::cross_entropy_forward(Self::inner(logits), targets, pad, smoothing);
        (Self::from_inner(loss), Self::from_inner(stats))
    }

    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        pad: i32,
        smoothing: f32,
    ) -> FloatTensor<Self> {
        let [logits, stats, grad] = [logits, stats, grad].map(Self::inner);
        Self::from_inner(B::cross_entropy_backward(
            logits, targets, stats, grad, pad, smoothing,
        ))
    }
}

/// The autodiff node of the cross-entropy kernels.
#[derive(Debug)]
struct CrossEntropy {
    pad: i32,
    smoothing: f32,
}

impl<B: CrossEntropyKernels> Backward<B, 1> for CrossEntropy {
    /// The logits, the targets and the forward pass's `[lse..., 1 / count]`.
    type State = (FloatTensor<B>, IntTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (logits, targets, stats) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::cross_entropy_backward(logits, targets, stats, grad, self.pad, self.smoothing)
        });
    }
}

mod kernels {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use crate::cube::{ROW_UNITS, cube_row, reduce_cube};

    /// One cube per row `r` of `logits` `[N, V]`: `stats[r]` the row's log-sum-exp and `rows[r]`
    /// its loss, 0 where `targets[r]` is `pad`.
    #[cube(launch)]
    pub(super) fn cross_entropy_rows<F: Float>(
        logits: &Tensor<F>,
        targets: &Tensor<i32>,
        rows: &mut Tensor<F>,
        stats: &mut Tensor<F>,
        pad: i32,
        smoothing: f32,
    ) {
        let r = cube_row();
        if r >= targets.len() {
            terminate!();
        }
        let (u, units) = (UNIT_POS_X as usize, CUBE_DIM_X as usize);
        let v = logits.shape(1);
        let at = r * v;
        let mut scratch = Shared::<[F]>::new_slice(ROW_UNITS);
        let mut max = F::min_value();
        for j in range_stepped(u, v, units) {
            max = F::max(max, logits[at + j]);
        }
        let max = reduce_cube::<F>(&mut scratch, max, true);
        let mut exps = F::new(0.0);
        let mut sum = F::new(0.0);
        for j in range_stepped(u, v, units) {
            let x = logits[at + j];
            exps += F::exp(x - max);
            sum += x;
        }
        let exps = reduce_cube::<F>(&mut scratch, exps, false);
        let sum = reduce_cube::<F>(&mut scratch, sum, false);
        if u == 0 {
            let lse = max + F::ln(exps);
            let t = targets[r];
            let mut loss = F::new(0.0);
            if t != pad {
                let e = F::cast_from(smoothing);
                let picked = logits[at + usize::cast_from(t)];
                let mean = sum / F::cast_from(v);
                loss = (F::new(1.0) - e) * (lse - picked) + e * (lse - mean);
            }
            rows[r] = loss;
            stats[r] = lse;
        }
    }

    /// One cube of `units` units: `loss[0]` the sum of `rows` over the count of targets that
    /// are not `pad` (at least 1), and that count's inverse in `stats[N]`.
    #[cube(launch)]
    pub(super) fn cross_entropy_mean<F: Float>(
        rows: &Tensor<F>,
        targets: &Tensor<i32>,
        loss: &mut Tensor<F>,
        stats: &mut Tensor<F>,
        pad: i32,
        #[comptime] units: usize,
    ) {
        let u = UNIT_POS_X as usize;
        let n = rows.len();
        let mut sum = F::new(0.0);
        let mut count = F::new(0.0);
        for i in range_stepped(u, n, units) {
            sum += rows[i];
            if targets[i] != pad {
                count += F::new(1.0);
            }
        }
        let mut scratch = Shared::<[F]>::new_slice(units);
        let sum = reduce_cube::<F>(&mut scratch, sum, false);
        let count = F::max(reduce_cube::<F>(&mut scratch, count, false), F::new(1.0));
        if u == 0 {
            loss[0] = sum / count;
            stats[n] = F::new(1.0) / count;
        }
    }

    /// One unit per logit `(r, j)`: `grad[0] / count * (exp(x - lse) - (1 - e)[j = t] - e / V)`,
    /// 0 on rows whose target is `pad`.
    #[cube(launch)]
    pub(super) fn cross_entropy_backward<F: Float>(
        logits: &Tensor<F>,
        targets: &Tensor<i32>,
        stats: &Tensor<F>,
        grad: &Tensor<F>,
        dx: &mut Tensor<F>,
        pad: i32,
        smoothing: f32,
    ) {
        let i = ABSOLUTE_POS;
        if i >= dx.len() {
            terminate!();
        }
        let v = logits.shape(1);
        let r = i / v;
        let t = targets[r];
        if t == pad {
            dx[i] = F::new(0.0);
        } else {
            let n = targets.len();
            let e = F::cast_from(smoothing);
            let mut target = e / F::cast_from(v);
            if i - r * v == usize::cast_from(t) {
                target += F::new(1.0) - e;
            }
            let p = F::exp(logits[i] - stats[r]);
            dx[i] = grad[0] * stats[n] * (p - target);
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::tensor::{Device, DeviceKind, Distribution, Int, Tensor, TensorData};

    use crate::{cross_entropy, cross_entropy_reference};

    /// The loss and the logits' gradient of `3 * cross_entropy(1.5 x)` in f64 on the host.
    fn truth(x: &[f32], v: usize, t: &[i64], pad: Option<u32>, e: f64) -> (f64, Vec<f64>) {
        let kept: Vec<bool> = t.iter().map(|&id| Some(id as u32) != pad).collect();
        let count = kept.iter().filter(|&&k| k).count().max(1) as f64;
        let (mut loss, mut grad) = (0.0, vec![0.0; x.len()]);
        for (r, row) in x.chunks(v).enumerate().filter(|(r, _)| kept[*r]) {
            let row: Vec<f64> = row.iter().map(|&a| 1.5 * a as f64).collect();
            let max = row.iter().cloned().fold(f64::MIN, f64::max);
            let lse = max + row.iter().map(|a| (a - max).exp()).sum::<f64>().ln();
            let mean = row.iter().sum::<f64>() / v as f64;
            loss += 3.0 * ((1.0 - e) * (lse - row[t[r] as usize]) + e * (lse - mean)) / count;
            for (j, a) in row.iter().enumerate() {
                let target = e / v as f64 + if j as i64 == t[r] { 1.0 - e } else { 0.0 };
                grad[r * v + j] = 3.0 * 1.5 * ((a - lse).exp() - target) / count;
            }
        }
        (loss, grad)
    }

    /// Loss and logits' gradient (of `3 * loss(1.5 x)`: a graph before the op, and an upstream
    /// gradient that is not 1) against f64 on the host, tightly, and against the reference,
    /// within the reference's own rounding (its `log_softmax` backward is ~5e-6 off where
    /// logits spread widely); on `device` plain, under autodiff and with checkpointing.
    fn agrees(device: &Device, x: &TensorData, t: &[i64], pad: Option<u32>, e: f64) {
        let [_, v] = x.shape().dims::<2>();
        let case = format!("{:?}, pad {pad:?}, smoothing {e}", x.shape());
        let (want_loss, want_grad) = truth(&x.try_to_vec::<f32>().unwrap(), v, t, pad, e);
        for device in [
            device.clone(),
            device.clone().autodiff(),
            device.clone().autodiff().gradient_checkpointing(),
        ] {
            let tracked = device.is_autodiff();
            let run = |op: &dyn Fn(Tensor<2>, Tensor<1, Int>) -> Tensor<1>| {
                let logits = Tensor::<2>::from_data(x.clone(), &device);
                let logits = if tracked {
                    logits.require_grad()
                } else {
                    logits
                };
                let targets = Tensor::<1, Int>::from_ints(t, &device);
                let loss = op(logits.clone() * 1.5, targets) * 3.0;
                let value = loss.clone().into_scalar::<f32>() as f64;
                let grad = tracked.then(|| {
                    let grads = loss.backward();
                    let grad = logits.grad(&grads).expect("a gradient").into_data();
                    grad.try_to_vec::<f32>().unwrap()
                });
                (value, grad)
            };
            let (ours, ours_grad) = run(&|x, t| cross_entropy(x, t, pad, e));
            let (reference, reference_grad) = run(&|x, t| cross_entropy_reference(x, t, pad, e));
            for (what, got, tolerance) in [("ours", ours, 2e-6), ("reference", reference, 2e-5)] {
                assert!(
                    (got - want_loss).abs() <= tolerance * want_loss.abs().max(1.0),
                    "{case}, autodiff {tracked}: {what} loss {got} vs {want_loss}"
                );
            }
            if let (Some(ours), Some(reference)) = (ours_grad, reference_grad) {
                let off = |got: &[f32]| {
                    got.iter()
                        .zip(&want_grad)
                        .map(|(&a, b)| (a as f64 - b).abs())
                        .fold(0.0, f64::max)
                };
                let scale = want_grad.iter().fold(1.0f64, |m, g| m.max(g.abs()));
                let (ours, reference) = (off(&ours), off(&reference));
                // f32's floor: a log-sum-exp near 20 (the widest case) is rounded by 2e-6.
                assert!(ours <= 4e-6 * scale, "{case}: gradient off by {ours}");
                assert!(
                    reference <= 5e-5 * scale,
                    "{case}: reference gradient off by {reference}"
                );
            }
        }
    }

    /// Rows and vocabularies no cube divides (fewer columns than a cube's units, many times
    /// them), with and without padding and smoothing, large logits (the log-sum-exp must
    /// subtract the maximum), against Burn's ops on wgpu.
    #[test]
    fn equals_the_reference_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let mut seed = 7u64;
        let mut next = |below: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % below
        };
        for (n, v, sd) in [
            (1, 2, 1.0),
            (5, 3, 1.0),
            (37, 65, 2.0),
            (70, 300, 30.0),
            (3, 1031, 4.0),
        ] {
            let x = Tensor::<2>::random([n, v], Distribution::Normal(0.0, sd), &device).into_data();
            let t: Vec<i64> = (0..n).map(|_| next(v as u64) as i64).collect();
            agrees(&device, &x, &t, None, 0.0);
            agrees(&device, &x, &t, None, 0.1);
            // Padding id 0, with some targets set to it (none for a single row: a batch of
            // padding alone is the case below).
            let padded: Vec<i64> = t
                .iter()
                .enumerate()
                .map(|(i, &id)| if n > 1 && i % 3 == 1 { 0 } else { id })
                .collect();
            agrees(&device, &x, &padded, Some(0), 0.1);
            agrees(&device, &x, &padded, Some(0), 0.0);
        }
    }

    /// Every target padding: the loss and its gradient are 0, as the reference's (its count is
    /// clamped to 1).
    #[test]
    fn a_batch_of_padding_alone_gives_zero_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let logits =
            Tensor::<2>::random([4, 9], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let targets = Tensor::<1, Int>::from_ints([2, 2, 2, 2], &device);
        let loss = cross_entropy(logits.clone(), targets, Some(2), 0.1);
        assert_eq!(loss.clone().into_scalar::<f32>(), 0.0);
        let grad = logits.grad(&loss.backward()).unwrap();
        assert_eq!(grad.abs().max().into_scalar::<f32>(), 0.0);
    }

    /// Hand values: logits `[0, ln 3]` put probability 1/4 and 3/4 on the two tokens, so the
    /// loss of target 1 is `ln(4/3)` and of target 0 is `ln 4`; their mean, and the gradient
    /// `(p - onehot) / 2`.
    #[test]
    fn hand_values_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let l3 = 3f32.ln();
        let logits = Tensor::<2>::from_floats([[0.0, l3], [0.0, l3]], &device).require_grad();
        let targets = Tensor::<1, Int>::from_ints([1, 0], &device);
        let loss = cross_entropy(logits.clone(), targets, None, 0.0);
        let want = ((4f32 / 3.0).ln() + 4f32.ln()) / 2.0;
        let got = loss.clone().into_scalar::<f32>();
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        let grad = logits.grad(&loss.backward()).unwrap().into_data();
        let grad = grad.try_to_vec::<f32>().unwrap();
        let want = [0.125, -0.125, -0.375, 0.375];
        for (g, w) in grad.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{grad:?} vs {want:?}");
        }
    }
}
