//! The attention's autodiff op: the forward pass keeps the projection, the seed, the output and
//! the log-sum-exps, and the backward pass is the kernels' own.

use super::backend::AttentionKernels;
use crate::cube::autodiff::tracked;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, unary};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, AutodiffBackend};

impl<B: AttentionKernels, C: CheckpointStrategy> AttentionKernels for Autodiff<B, C> {
    fn causal_self_attention(
        qkv: FloatTensor<Self>,
        seed: FloatTensor<Self>,
        heads: usize,
        dropout: f32,
    ) -> FloatTensor<Self> {
        // A bf16 (or f16) projection, mixed precision's: the op keeps it and its output in its
        // own type (the output rounded once), as PyTorch's autocast keeps them; the passes
        // compute in f32 (the batched products from the narrow matrices, the fused kernels from
        // widened copies).
        let seed = Self::inner(seed);
        tracked::<B, C, _, _>(FusedAttention, [qkv], |[qkv]| {
            let (out, lse) =
                B::causal_self_attention_forward(qkv.clone(), seed.clone(), heads, dropout);
            (out.clone(), (qkv, seed, out, lse, heads, dropout))
        })
    }

    // The two passes on their own are not differentiated: only the op above is.
    fn causal_self_attention_forward(
        qkv: FloatTensor<Self>,
        seed: FloatTensor<Self>,
        heads: usize,
        dropout: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (qkv, seed) = (Self::inner(qkv), Self::inner(seed));
        let (out, lse) = B::causal_self_attention_forward(qkv, seed, heads, dropout);
        (Self::from_inner(out), Self::from_inner(lse))
    }

    fn causal_self_attention_backward(
        qkv: FloatTensor<Self>,
        seed: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        heads: usize,
        dropout: f32,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::causal_self_attention_backward(
            Self::inner(qkv),
            Self::inner(seed),
            Self::inner(out),
            Self::inner(lse),
            Self::inner(grad),
            heads,
            dropout,
        ))
    }

    // Decoding is never differentiated (the entry point takes plain tensors only).
    fn cached_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        start: usize,
    ) -> FloatTensor<Self> {
        let [q, k, v] = [q, k, v].map(Self::inner);
        Self::from_inner(B::cached_causal_attention(q, k, v, start))
    }

    fn cached_causal_attention_at(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        position: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let [q, k, v] = [q, k, v].map(Self::inner);
        Self::from_inner(B::cached_causal_attention_at(q, k, v, position))
    }
}

/// The autodiff node of the fused attention.
#[derive(Debug)]
pub(super) struct FusedAttention;

impl<B: AttentionKernels> Backward<B, 1> for FusedAttention {
    /// The projection, the dropout seed, the output, the log-sum-exp, the number of heads and
    /// the dropout probability.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        usize,
        f32,
    );

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (qkv, seed, out, lse, heads, dropout) = ops.state;
        // In the projection's type (f32, or mixed precision's bf16), computed in f32.
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::causal_self_attention_backward(qkv, seed, out, lse, grad, heads, dropout)
        });
    }
}
