//! A gated activation on flex, `act(gate) * up` of a `[..., 2F]` tensor whose halves are
//! `[gate | up]` (a gated MLP's fused expansion), through [`crate::kernels::gelu`]'s vectorised
//! loops: one pass forward, one back. Burn's ops take two slices, the activation and a product,
//! and under autodiff each slice's backward fills a zeroed `[..., 2F]` gradient.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::Tensor;
use core::marker::PhantomData;
use rayon::prelude::*;

use super::op;
use super::tensor::{Tracked, contiguous, from_values, values};
use super::threads::rows_per_task;
use crate::kernels::gelu::{self as kernel, GeluKind};

/// `K(gate) * up` where ember's kernels take `x`; otherwise `x` back.
///
/// # Shapes
/// - x: `[..., 2F]`
/// - output: `[..., F]`
pub(crate) fn gated<K: GeluKind, const D: usize>(x: Tensor<D>) -> Result<Tensor<D>, Tensor<D>> {
    op::unary(x, FlexGated::<K>(PhantomData))
}

#[derive(Debug)]
struct FlexGated<K>(PhantomData<K>);

impl<K: GeluKind> op::Unary for FlexGated<K> {
    fn plain(self, x: FlexTensor) -> FlexTensor {
        forward::<K>(&contiguous(x))
    }

    fn tracked<C: CheckpointStrategy>(self, x: Tracked) -> Tracked {
        match self.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let input = contiguous(x.primitive().clone());
                let y = forward::<K>(&input);
                prep.finish(input, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward::<K>(&contiguous(x.into_primitive()))),
        }
    }
}

impl<K: GeluKind> Backward<Flex, 1> for FlexGated<K> {
    /// The input, contiguous.
    type State = FlexTensor;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let input = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
            backward::<K>(&input, contiguous(grad))
        });
    }
}

/// `[..., 2F]` -> `[..., F]`, rows split over rayon's threads.
fn forward<K: GeluKind>(x: &FlexTensor) -> FlexTensor {
    let xs = values(x);
    let mut shape = x.shape();
    let last = shape.num_dims() - 1;
    let f = shape[last] / 2;
    shape[last] = f;
    let mut out = vec![0.0; xs.len() / 2];
    let task = rows_per_task(2 * f);
    out.par_chunks_mut((task * f).max(1))
        .zip(xs.par_chunks((2 * task * f).max(1)))
        .for_each(|(ys, xs)| {
            for (y, x) in ys.chunks_exact_mut(f).zip(xs.chunks_exact(2 * f)) {
                let (gate, up) = x.split_at(f);
                kernel::gated_forward::<K>(gate, up, y);
            }
        });
    from_values(out, shape)
}

/// The input's gradient `[..., 2F]` from the output's `[..., F]`.
fn backward<K: GeluKind>(x: &FlexTensor, grad: FlexTensor) -> FlexTensor {
    let (xs, gs) = (values(x), values(&grad));
    let shape = x.shape();
    let f = shape[shape.num_dims() - 1] / 2;
    assert_eq!(xs.len(), 2 * gs.len(), "gated backward: sizes differ");
    let mut dx = vec![0.0; xs.len()];
    let task = rows_per_task(2 * f);
    dx.par_chunks_mut((2 * task * f).max(1))
        .zip(xs.par_chunks((2 * task * f).max(1)))
        .zip(gs.par_chunks((task * f).max(1)))
        .for_each(|((dxs, xs), gs)| {
            let rows = dxs.chunks_exact_mut(2 * f).zip(xs.chunks_exact(2 * f));
            for ((d, x), g) in rows.zip(gs.chunks_exact(f)) {
                let ((gate, up), (d_gate, d_up)) = (x.split_at(f), d.split_at_mut(f));
                kernel::gated_backward::<K>(gate, up, g, d_gate, d_up);
            }
        });
    from_values(dx, x.shape())
}
