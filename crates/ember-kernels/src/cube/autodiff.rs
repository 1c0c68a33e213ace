//! The one shape of every differentiated kernel's autodiff op: the node prepared on its float
//! inputs, the forward pass on the inner backend, and the state its backward pass reads kept
//! where autodiff tracks the inputs. Each kernel writes its forward pass (output and state
//! together: the state is the inputs' handles or statistics the pass computes anyway) and its
//! [`Backward`] node; this function does the rest, as `flex::op` does for the CPU kernels.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::ops::{Backward, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend};

/// `node`'s op on its float inputs `parents`: `forward` gives the output and the state from
/// the inner backend's tensors; the state is kept for the backward pass where the inputs are
/// tracked, dropped otherwise.
pub(crate) fn tracked<B, C, N, const P: usize>(
    node: N,
    parents: [FloatTensor<Autodiff<B, C>>; P],
    forward: impl FnOnce([FloatTensor<B>; P]) -> (FloatTensor<B>, N::State),
) -> FloatTensor<Autodiff<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    N: Backward<B, P>,
{
    let prep = node
        .prepare::<C>(parents.each_ref().map(|p| p.node()))
        .compute_bound()
        .stateful();
    let inner = parents.map(|p| p.into_primitive());
    match prep {
        OpsKind::Tracked(prep) => {
            let (y, state) = forward(inner);
            prep.finish(state, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(inner).0),
    }
}
