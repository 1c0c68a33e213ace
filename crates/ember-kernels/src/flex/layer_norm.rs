//! LayerNorm's normalisation and scale (or RMSNorm's) on flex through
//! [`crate::kernels::layer_norm`], with its own autodiff op. Under autodiff Burn 0.22.1 builds LayerNorm from nine tensor ops (mean,
//! subtraction, square, mean, `+ eps`, square root, division, scale, shift), each with its own
//! buffer and backward; here it is one pass forward and one backward.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{Shape, Tensor};
use rayon::prelude::*;

use super::op;
use super::tensor::{Tracked, contiguous, from_values, values, values_mut};
use super::threads::rows_per_task;
use crate::kernels::layer_norm as layer_norm_kernel;

/// `(x - mean) * rstd * gamma` over the last axis with epsilon `eps`, where `x` and `gamma`
/// are flex `f32` and both tracked by autodiff or both not; otherwise both back.
///
/// # Shapes
/// - x: `[..., D]`
/// - gamma: `[D]`
/// - output: `[..., D]`
pub(crate) fn normalize_and_scale<const N: usize>(
    x: Tensor<N>,
    gamma: Tensor<1>,
    eps: f64,
) -> Result<Tensor<N>, (Tensor<N>, Tensor<1>)> {
    let centred = true;
    op::binary(
        x,
        gamma,
        ScaledNorm {
            eps: eps as f32,
            centred,
        },
    )
}

/// RMSNorm, `x * rstd * gamma` with `rstd = 1 / sqrt(mean(x^2) + eps)` over the last axis,
/// where `x` and `gamma` are flex `f32` and both tracked by autodiff or both not; otherwise both
/// back.
///
/// # Shapes
/// - x: `[..., D]`
/// - gamma: `[D]`
/// - output: `[..., D]`
pub(crate) fn rms_scale<const N: usize>(
    x: Tensor<N>,
    gamma: Tensor<1>,
    eps: f64,
) -> Result<Tensor<N>, (Tensor<N>, Tensor<1>)> {
    let centred = false;
    op::binary(
        x,
        gamma,
        ScaledNorm {
            eps: eps as f32,
            centred,
        },
    )
}

impl op::Binary for ScaledNorm {
    fn plain(self, x: FlexTensor, gamma: FlexTensor) -> FlexTensor {
        forward(x, &gamma, self).0
    }

    fn tracked<C: CheckpointStrategy>(self, x: Tracked, gamma: Tracked) -> Tracked {
        tracked::<C>(x, gamma, self)
    }
}

/// The autodiff op; its backward needs the input, gamma and each row's mean and `rstd`.
fn tracked<C: CheckpointStrategy>(x: Tracked, gamma: Tracked, op: ScaledNorm) -> Tracked {
    match op
        .prepare::<C>([x.node(), gamma.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (x, gamma) = (contiguous(x.primitive().clone()), gamma.primitive().clone());
            let (y, stats) = forward(x.clone(), &gamma, op);
            prep.finish((x, gamma, stats), y)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(forward(x.into_primitive(), gamma.primitive(), op).0)
        }
    }
}

/// The norm: epsilon, and LayerNorm's centring (RMSNorm without).
#[derive(Debug, Clone, Copy)]
struct ScaledNorm {
    eps: f32,
    centred: bool,
}

impl Backward<Flex, 2> for ScaledNorm {
    /// The input (contiguous), gamma and `[mean, rstd]` per row.
    type State = (FlexTensor, FlexTensor, Vec<f32>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (x, gamma, stats) = ops.state;
        let grad = grads.consume::<Flex>(&ops.node);
        let (dx, dgamma) = backward(&x, &gamma, &stats, self.centred, grad);
        let [x_node, gamma_node] = ops.parents;
        if let Some(node) = x_node {
            grads.register::<Flex>(node.id, dx);
        }
        if let Some(node) = gamma_node {
            grads.register::<Flex>(node.id, dgamma);
        }
    }
}

/// The output and `[mean, rstd]` per row.
fn forward(x: FlexTensor, gamma: &FlexTensor, op: ScaledNorm) -> (FlexTensor, Vec<f32>) {
    let (eps, centred) = (op.eps, op.centred);
    let x = contiguous(x);
    let gamma = contiguous(gamma.clone());
    let (xs, gs) = (values(&x), values(&gamma));
    let d = gs.len();
    assert_eq!(
        xs.len() % d.max(1),
        0,
        "LayerNorm: input width is not gamma's"
    );
    let rows = xs.len() / d.max(1);
    let mut y = vec![0.0; xs.len()];
    let mut stats = vec![0.0; 2 * rows];
    let task = rows_per_task(d);
    if rows < 2 * task {
        layer_norm_kernel::forward(xs, gs, eps, centred, &mut y, &mut stats);
    } else {
        y.par_chunks_mut(task * d)
            .zip(stats.par_chunks_mut(task * 2))
            .enumerate()
            .for_each(|(i, (ys, st))| {
                let at = i * task * d;
                layer_norm_kernel::forward(&xs[at..at + ys.len()], gs, eps, centred, ys, st)
            });
    }
    (from_values(y, x.shape()), stats)
}

/// The input's and gamma's gradients from the output's.
fn backward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    stats: &[f32],
    centred: bool,
    grad: FlexTensor,
) -> (FlexTensor, FlexTensor) {
    let gamma = contiguous(gamma.clone());
    let (xs, gs) = (values(x), values(&gamma));
    let d = gs.len();
    // The output's gradient becomes the input's, in place when no one else holds its buffer.
    let mut dx = contiguous(grad);
    let g = values_mut(&mut dx);
    assert_eq!(g.len(), xs.len(), "LayerNorm backward: sizes differ");
    let rows = xs.len() / d.max(1);
    let task = rows_per_task(d);
    let run = |at: usize, g: &mut [f32], st: &[f32]| {
        let (mut dgamma, mut scratch) = (vec![0.0; d], vec![0.0; 2 * d]);
        let xs = &xs[at..at + g.len()];
        layer_norm_kernel::backward(xs, gs, st, centred, g, &mut dgamma, &mut scratch);
        dgamma
    };
    let dgamma = if rows < 2 * task {
        run(0, g, stats)
    } else {
        let parts: Vec<Vec<f32>> = g
            .par_chunks_mut(task * d)
            .zip(stats.par_chunks(task * 2))
            .enumerate()
            .map(|(i, (g, st))| run(i * task * d, g, st))
            .collect();
        let mut sum = vec![0.0; d];
        for part in parts {
            sum.iter_mut().zip(part).for_each(|(s, p)| *s += p);
        }
        sum
    };
    (dx, from_values(dgamma, Shape::new([d])))
}
