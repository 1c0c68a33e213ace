//! GELUs that are fast on Burn's flex CPU backend.
//!
//! Burn 0.22.1's flex backend computes GELU one element at a time through `libm::erff`, which
//! made it a quarter of a training step and 40% of a forward pass of the baby GPT; its tanh
//! GELU is five separate tensor ops. On flex tensors (with or without autodiff) [`gelu`] and
//! [`gelu_tanh`] run [`crate::gelu_kernel`]'s vectorised loops instead (split over rayon's
//! threads for tensors of 64k values or more), with their own backward pass; on every other
//! backend they are Burn's `gelu` and `gelu_approximate`.

use burn::tensor::Tensor;

#[cfg(feature = "flex")]
use crate::gelu_kernel::{Exact, Tanh};

/// Exact GELU, `x * Phi(x)`, element-wise.
///
/// # Shapes
/// - x: any
/// - output: same as x
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "flex")]
    {
        flex::gelu::<Exact, D>(x, burn::tensor::activation::gelu)
    }
    #[cfg(not(feature = "flex"))]
    {
        burn::tensor::activation::gelu(x)
    }
}

/// GELU with the tanh approximation (GPT-2's `gelu_new`),
/// `x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, element-wise.
///
/// # Shapes
/// - x: any
/// - output: same as x
pub fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "flex")]
    {
        flex::gelu::<Tanh, D>(x, burn::tensor::activation::gelu_approximate)
    }
    #[cfg(not(feature = "flex"))]
    {
        burn::tensor::activation::gelu_approximate(x)
    }
}

/// Whether [`gelu`] and [`gelu_tanh`] run ember's own kernels on `x` (flex `f32`, tracked or not) rather than
/// Burn's GELUs. For tests and benchmarks.
pub fn gelu_is_fast<const D: usize>(x: &Tensor<D>) -> bool {
    crate::kernels_take(x)
}

#[cfg(feature = "flex")]
mod flex {
    use burn::backend::autodiff::NodeId;
    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
    use burn::backend::autodiff::checkpoint::state::BackwardStates;
    use burn::backend::autodiff::checkpoint::strategy::{
        BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
    };
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
    use burn::backend::flex::FlexTensor;
    use burn::backend::{Flex, GradientCheckpointingStrategy, TensorMetadata};
    use burn::tensor::Tensor;
    use core::marker::PhantomData;

    use crate::flex_tensor::{
        Route, Tracked, contiguous, from_values, map_plain, map_tracked, route,
    };
    use crate::gelu_kernel::{self, GeluKind};
    use rayon::prelude::*;

    /// GELU of kind `K` through ember's kernels where they apply, else `fallback`.
    pub(super) fn gelu<K: GeluKind, const D: usize>(
        x: Tensor<D>,
        fallback: fn(Tensor<D>) -> Tensor<D>,
    ) -> Tensor<D> {
        let tensor = x.into_dispatch();
        let output = match route(&tensor) {
            Route::Flex => map_plain(tensor, forward::<K>),
            Route::Autodiff(GradientCheckpointingStrategy::Disabled) => {
                map_tracked::<NoCheckpointing>(tensor, tracked::<K, NoCheckpointing>)
            }
            Route::Autodiff(GradientCheckpointingStrategy::Balanced) => {
                map_tracked::<BalancedCheckpointing>(tensor, tracked::<K, BalancedCheckpointing>)
            }
            Route::Other => return fallback(Tensor::from_dispatch(tensor)),
        };
        Tensor::from_dispatch(output)
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

    /// Elements per task when a GELU is spread over rayon's threads. Shorter tensors (a
    /// decoding step's) stay on the calling thread: handing work to the pool costs more than
    /// it saves there.
    const TASK: usize = 1 << 15;

    /// `f(chunk, offset of its first element)` over `out` in chunks of [`TASK`] elements, on
    /// rayon's threads when there are at least two chunks.
    fn spread(out: &mut [f32], f: impl Fn(&mut [f32], usize) + Send + Sync) {
        if out.len() < 2 * TASK {
            return f(out, 0);
        }
        out.par_chunks_mut(TASK)
            .enumerate()
            .for_each(|(i, chunk)| f(chunk, i * TASK));
    }
}
