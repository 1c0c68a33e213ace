//! The causal attention softmax on flex through [`crate::kernels::softmax`], with its own
//! autodiff op, in place of scaling, masking and Burn's softmax (three tensor ops, each with a
//! backward, and a scalar `expf` per score, masked ones included); and the log-softmax of plain
//! rows of logits ([`crate::log_softmax`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::Tensor;

use super::op;
use super::tensor::{Tracked, as_flex, contiguous, from_flex, from_values, values_mut};
use super::threads::rows_per_task;
use crate::kernels::cross_entropy::log_sum_exp;
use crate::kernels::softmax::{causal_softmax_backward_in_place, causal_softmax_in_place};

/// `log(softmax(x))` over the last axis where `x` is a plain flex `f32` tensor (not tracked by
/// autodiff) with rows; otherwise `x` back. Rows are spread over rayon's threads
/// ([`rows_per_task`]).
///
/// # Shapes
/// - x: `[N, V]`
/// - output: `[N, V]`
pub(crate) fn log_softmax(x: Tensor<2>) -> Result<Tensor<2>, Tensor<2>> {
    use rayon::prelude::*;
    let [n, v] = x.dims();
    let Some(t) = as_flex(&x).filter(|_| n > 0 && v > 0) else {
        return Err(x);
    };
    drop(x); // the buffer is `t`'s alone unless someone else holds `x`'s
    let mut t = contiguous(t);
    let values = values_mut(&mut t);
    let task = rows_per_task(v);
    let block = |rows: &mut [f32]| {
        for row in rows.chunks_exact_mut(v) {
            let lse = log_sum_exp(row);
            row.iter_mut().for_each(|x| *x -= lse);
        }
    };
    match n < 2 * task {
        true => block(values),
        false => values.par_chunks_mut(task * v).for_each(block),
    }
    Ok(from_flex(t))
}

/// `softmax(scale * scores)` over the last axis with the causal mask (query `i` sees keys
/// `..= S - T + i`) where ember's kernels take `scores`; otherwise `scores` back.
///
/// # Shapes
/// - scores: `[B, H, T, S]`, `T <= S`
/// - output: `[B, H, T, S]`, zero at hidden keys
pub(crate) fn causal_softmax(scores: Tensor<4>, scale: f32) -> Result<Tensor<4>, Tensor<4>> {
    op::unary(scores, CausalSoftmax { scale })
}

impl op::Unary for CausalSoftmax {
    fn plain(self, x: FlexTensor) -> FlexTensor {
        forward(x, self.scale)
    }

    fn tracked<C: CheckpointStrategy>(self, x: Tracked) -> Tracked {
        tracked::<C>(x, self.scale)
    }
}

/// The autodiff op; its backward needs only the output.
fn tracked<C: CheckpointStrategy>(t: Tracked, scale: f32) -> Tracked {
    let op = CausalSoftmax { scale };
    match op.prepare::<C>([t.node()]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let y = forward(t.primitive().clone(), scale);
            prep.finish((y.clone(), scale), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(t.into_primitive(), scale)),
    }
}

#[derive(Debug)]
struct CausalSoftmax {
    scale: f32,
}

impl Backward<Flex, 1> for CausalSoftmax {
    /// The output (the weights) and the scale.
    type State = (FlexTensor, f32);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (y, scale) = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |g| backward(y, g, scale));
    }
}

/// `[.., T, S]` of a flex tensor.
fn last_two(t: &FlexTensor) -> (usize, usize) {
    let shape = t.shape();
    let n = shape.num_dims();
    (shape[n - 2], shape[n - 1])
}

fn forward(t: FlexTensor, scale: f32) -> FlexTensor {
    let (rows, cols) = last_two(&t);
    let mut t = contiguous(t);
    let (start, end) = t.layout().contiguous_offsets().expect("contiguous");
    if let Some(storage) = t.try_storage_mut::<f32>() {
        causal_softmax_in_place(&mut storage[start..end], rows, cols, scale);
        return t;
    }
    let mut out = t.storage::<f32>()[start..end].to_vec();
    causal_softmax_in_place(&mut out, rows, cols, scale);
    from_values(out, t.shape())
}

fn backward(y: FlexTensor, g: FlexTensor, scale: f32) -> FlexTensor {
    let (_, cols) = last_two(&y);
    let y = contiguous(y);
    let (y_start, y_end) = y.layout().contiguous_offsets().expect("contiguous");
    let ys = &y.storage::<f32>()[y_start..y_end];
    let mut g = contiguous(g);
    let (start, end) = g.layout().contiguous_offsets().expect("contiguous");
    assert_eq!(ys.len(), end - start, "softmax backward: sizes differ");
    if let Some(storage) = g.try_storage_mut::<f32>() {
        causal_softmax_backward_in_place(ys, &mut storage[start..end], cols, scale);
        return g;
    }
    let mut out = g.storage::<f32>()[start..end].to_vec();
    causal_softmax_backward_in_place(ys, &mut out, cols, scale);
    from_values(out, g.shape())
}
