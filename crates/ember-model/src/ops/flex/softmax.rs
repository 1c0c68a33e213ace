//! The causal attention softmax on flex through [`crate::softmax_kernel`], with its own
//! autodiff op, in place of scaling, masking and Burn's softmax (three tensor ops, each with a
//! backward, and a scalar `expf` per score, masked ones included).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, GradientCheckpointingStrategy, TensorMetadata};
use burn::tensor::Tensor;

use crate::flex_tensor::{Route, Tracked, contiguous, from_values, map_plain, map_tracked, route};
use crate::softmax_kernel::{causal_softmax_backward_in_place, causal_softmax_in_place};

/// `softmax(scale * scores)` over the last axis with the causal mask (query `i` sees keys
/// `..= S - T + i`); `fallback` computes it where this path does not apply.
///
/// # Shapes
/// - scores: `[B, H, T, S]`, `T <= S`
/// - output: `[B, H, T, S]`, zero at hidden keys
pub(crate) fn causal_softmax(
    scores: Tensor<4>,
    scale: f32,
    fallback: impl FnOnce(Tensor<4>) -> Tensor<4>,
) -> Tensor<4> {
    let tensor = scores.into_dispatch();
    let output = match route(&tensor) {
        Route::Flex => map_plain(tensor, |t| forward(t, scale)),
        Route::Autodiff(GradientCheckpointingStrategy::Disabled) => {
            map_tracked::<NoCheckpointing>(tensor, |t| tracked::<NoCheckpointing>(t, scale))
        }
        Route::Autodiff(GradientCheckpointingStrategy::Balanced) => {
            map_tracked::<BalancedCheckpointing>(tensor, |t| {
                tracked::<BalancedCheckpointing>(t, scale)
            })
        }
        Route::Other => return fallback(Tensor::from_dispatch(tensor)),
    };
    Tensor::from_dispatch(output)
}

/// The autodiff op; its backward needs only the output.
fn tracked<C: CheckpointStrategy>(t: Tracked, scale: f32) -> Tracked {
    match CausalSoftmax
        .prepare::<C>([t.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = forward(t.primitive().clone(), scale);
            prep.finish((y.clone(), scale), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(t.into_primitive(), scale)),
    }
}

#[derive(Debug)]
struct CausalSoftmax;

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
