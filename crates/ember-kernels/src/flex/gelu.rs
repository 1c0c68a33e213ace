//! GELU on flex through [`crate::kernels::gelu`]'s vectorised loops (split over rayon's
//! threads for tensors of 64k values or more), with its own backward pass.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::Tensor;
use core::marker::PhantomData;

use super::op;
use super::tensor::{Tracked, contiguous, from_values};
use super::threads::spread;
use crate::kernels::gelu::{self as gelu_kernel, GeluKind};

/// GELU of kind `K` where ember's kernels take `x`; otherwise `x` back.
pub(crate) fn gelu<K: GeluKind, const D: usize>(x: Tensor<D>) -> Result<Tensor<D>, Tensor<D>> {
    op::unary(x, FlexGelu::<K>(PhantomData))
}

impl<K: GeluKind> op::Unary for FlexGelu<K> {
    fn plain(self, x: FlexTensor) -> FlexTensor {
        forward::<K>(x)
    }

    fn tracked<C: CheckpointStrategy>(self, x: Tracked) -> Tracked {
        tracked::<K, C>(x)
    }
}

/// The autodiff op: forward on the inner flex tensor, backward through
/// [`gelu_kernel::backward_in_place`].
fn tracked<K: GeluKind, C: CheckpointStrategy>(t: Tracked) -> Tracked {
    let prepared = FlexGelu::<K>(PhantomData)
        .prepare::<C>([t.node()])
        .memory_bound()
        .retro_forward(RetroFlexGelu::<K> {
            input: t.id(),
            kind: PhantomData,
        })
        .parents([&t])
        .stateful();
    match prepared {
        OpsKind::Tracked(mut prep) => {
            let state = prep.checkpoint(&t);
            prep.finish(state, forward::<K>(t.primitive().clone()))
        }
        OpsKind::UnTracked(prep) => prep.finish(forward::<K>(t.into_primitive())),
    }
}

#[derive(Debug)]
struct FlexGelu<K>(PhantomData<K>);

impl<K: GeluKind> Backward<Flex, 1> for FlexGelu<K> {
    /// The input's node, whose output the checkpointer keeps (or recomputes).
    type State = NodeId;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let input: FlexTensor = checkpointer.retrieve_node_output(ops.state);
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
            backward::<K>(input, grad)
        });
    }
}

/// Recomputes the output from the input when checkpointing dropped it.
#[derive(Debug)]
struct RetroFlexGelu<K> {
    input: NodeId,
    kind: PhantomData<K>,
}

impl<K: GeluKind> RetroForward for RetroFlexGelu<K> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input: FlexTensor = states.get_state(&self.input);
        states.save(out_node, forward::<K>(input))
    }
}

/// `K`'s GELU of an `f32` flex tensor: in place when no one else holds its buffer.
fn forward<K: GeluKind>(t: FlexTensor) -> FlexTensor {
    let mut t = contiguous(t);
    let (start, end) = t.layout().contiguous_offsets().expect("contiguous");
    if let Some(storage) = t.try_storage_mut::<f32>() {
        spread(&mut storage[start..end], |ys, _| {
            gelu_kernel::forward_in_place::<K>(ys)
        });
        return t;
    }
    let xs = &t.storage::<f32>()[start..end];
    let mut out = vec![0.0; xs.len()];
    spread(&mut out, |ys, at| {
        gelu_kernel::forward_into::<K>(&xs[at..at + ys.len()], ys)
    });
    from_values(out, t.shape())
}

/// `grad * K'(x)`: in place on the gradient when no one else holds it.
fn backward<K: GeluKind>(x: FlexTensor, grad: FlexTensor) -> FlexTensor {
    let x = contiguous(x);
    let mut grad = contiguous(grad);
    let (xs_start, xs_end) = x.layout().contiguous_offsets().expect("contiguous");
    let xs = &x.storage::<f32>()[xs_start..xs_end];
    let (start, end) = grad.layout().contiguous_offsets().expect("contiguous");
    assert_eq!(
        xs.len(),
        end - start,
        "GELU backward: input and gradient sizes differ"
    );
    if let Some(storage) = grad.try_storage_mut::<f32>() {
        spread(&mut storage[start..end], |gs, at| {
            gelu_kernel::backward_in_place::<K>(&xs[at..at + gs.len()], gs)
        });
        return grad;
    }
    let gs = &grad.storage::<f32>()[start..end];
    let mut out = vec![0.0; gs.len()];
    spread(&mut out, |ys, at| {
        let range = at..at + ys.len();
        gelu_kernel::backward_into::<K>(&xs[range.clone()], &gs[range], ys)
    });
    from_values(out, grad.shape())
}
