//! Causal self-attention from the fused `[Q | K | V]` projection to the merged heads in one op on
//! Burn's flex backend, with its own backward pass.
//!
//! The general path splits the heads (a reshape that copies each of Q, K and V, forward and
//! backward), multiplies per head twice through flex's batched matmul (zero-filled, re-copied
//! outputs), and merges the heads with another copy: a dozen autodiff nodes per layer. Here one
//! task per (sequence, head), spread over rayon's threads, reads its query, key and value
//! columns where the projection wrote them and writes its context columns straight into the
//! `[B, T, D]` output; the backward pass writes the gradient of the projection's output the same
//! way. Short sequences keep their weights `P` (`[T, T]` per task) for the backward pass; from
//! [`RECOMPUTED_FROM`] positions on, and wherever no backward pass follows, the tasks work in
//! blocks of query rows and the backward pass recomputes the weights
//! ([`super::attention_blocks`]), which keeps no `T x T` buffer. With dropout the weights are
//! multiplied by a hashed mask ([`crate::kernels::dropout`], the GPU kernels' mask: weight `(i,
//! j)` of sequence `b` and head `h` is element `((b H + h) T + i) T + j` of it) before they
//! weigh the values, and the backward pass computes the same factors again.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{Shape, Tensor};
use rayon::prelude::*;

use super::attention_blocks;
use super::op;
use super::tensor::{Tracked, contiguous, from_values, values};
use crate::kernels::dropout::Mask;
use crate::kernels::softmax::{causal_softmax_backward_in_place, causal_softmax_in_place};
use crate::products::flex::mm;

/// `dropout(softmax(Q K^T / sqrt(K) + causal mask)) V` per head, heads merged, from the fused
/// projection `qkv`, the weights multiplied by `mask`'s factors where there is one; `qkv` back
/// where this path does not apply (not a flex `f32` tensor, no rows).
///
/// # Shapes
/// - qkv: `[B, T, 3D]`, columns `[Q | K | V]`, head `h` at columns `h*K..(h+1)*K` of each
/// - output: `[B, T, D]`
pub(crate) fn causal_self_attention(
    qkv: Tensor<3>,
    heads: usize,
    mask: Option<Mask>,
) -> Result<Tensor<3>, Tensor<3>> {
    let [_, t, d3] = qkv.dims();
    if t == 0 || d3 == 0 {
        return Err(qkv);
    }
    assert!(
        d3 % 3 == 0 && (d3 / 3) % heads == 0,
        "fused attention: {d3} columns do not split into Q, K, V of {heads} heads"
    );
    op::unary(qkv, Heads { heads, mask })
}

/// The op on a fused projection of this many heads, with dropout's mask or none.
struct Heads {
    heads: usize,
    mask: Option<Mask>,
}

impl op::Unary for Heads {
    fn plain(self, x: FlexTensor) -> FlexTensor {
        routed(contiguous(x), self.heads, self.mask, false).0
    }

    fn tracked<C: CheckpointStrategy>(self, x: Tracked) -> Tracked {
        tracked::<C>(x, self.heads, self.mask)
    }
}

/// The autodiff op; its backward needs the input, the weights and the mask.
fn tracked<C: CheckpointStrategy>(t: Tracked, heads: usize, mask: Option<Mask>) -> Tracked {
    match FusedAttention
        .prepare::<C>([t.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let qkv = contiguous(t.primitive().clone());
            let (out, weights) = routed(qkv.clone(), heads, mask, true);
            prep.finish((qkv, weights, heads, mask), out)
        }
        OpsKind::UnTracked(prep) => {
            let qkv = contiguous(t.into_primitive());
            prep.finish(routed(qkv, heads, mask, false).0)
        }
    }
}

/// The output `[B, T, D]` of the contiguous projection `qkv`, and the weights where its route
/// keeps them (`tracked`: a backward pass follows).
fn routed(
    qkv: FlexTensor,
    heads: usize,
    mask: Option<Mask>,
    tracked: bool,
) -> (FlexTensor, Option<Vec<f32>>) {
    let dims = Dims::of(&qkv, heads);
    match route(dims, tracked) {
        Route::Kept => {
            let (out, weights) = forward(qkv, heads, mask);
            (out, Some(weights))
        }
        Route::Blocks => {
            let block = attention_blocks::BLOCK;
            let out = attention_blocks::forward(values(&qkv), dims, mask, block);
            (from_values(out, Shape::new([dims.b, dims.t, dims.d])), None)
        }
    }
}

#[derive(Debug)]
struct FusedAttention;

impl Backward<Flex, 1> for FusedAttention {
    /// The projection (contiguous), the weights `[B * H * T * T]` (before dropout) where they
    /// were kept, the number of heads and dropout's mask.
    type State = (FlexTensor, Option<Vec<f32>>, usize, Option<Mask>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (qkv, weights, heads, mask) = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |g| {
            let g = contiguous(g);
            match weights {
                Some(weights) => backward(&qkv, &weights, g, heads, mask),
                None => {
                    let dims = Dims::of(&qkv, heads);
                    let block = attention_blocks::BLOCK;
                    let dx =
                        attention_blocks::backward(values(&qkv), values(&g), dims, mask, block);
                    from_values(dx, Shape::new([dims.b, dims.t, 3 * dims.d]))
                }
            }
        });
    }
}

/// Where the backward pass gets the attention weights from.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Route {
    /// Kept from the forward pass, `B * H * T * T` floats.
    Kept,
    /// Recomputed in blocks of query rows ([`attention_blocks`]).
    Blocks,
}

/// The route for a call of these sizes, `tracked` where a backward pass follows. Without one
/// nothing is kept, so the blocks; with one, the weights are kept below [`RECOMPUTED_FROM`]
/// positions, where the backward pass's second product of the scores costs more than keeping
/// them (on 2 Xeon cores: nanoGPT's baby GPT at context 64 steps 4-6% slower with the blocks,
/// GPT-2's body at context 256 at par, at 1024 at par to 15% faster in 40% less memory;
/// docs/benchmarks.md).
fn route(dims: Dims, tracked: bool) -> Route {
    match !tracked || dims.t >= RECOMPUTED_FROM {
        true => Route::Blocks,
        false => Route::Kept,
    }
}

/// The sequence length from which a training step recomputes the weights.
const RECOMPUTED_FROM: usize = 256;

/// The sizes of one call.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    pub b: usize,
    pub t: usize,
    pub d: usize,
    pub heads: usize,
}

impl Dims {
    fn of(qkv: &FlexTensor, heads: usize) -> Self {
        let shape = qkv.shape();
        Dims {
            b: shape[0],
            t: shape[1],
            d: shape[2] / 3,
            heads,
        }
    }

    pub fn k(&self) -> usize {
        self.d / self.heads
    }

    pub fn scale(&self) -> f32 {
        1.0 / (self.k() as f32).sqrt()
    }

    /// Offset in `[B, T, 3D]` of the first element of head `h`'s part `part` (0 = Q, 1 = K,
    /// 2 = V) of sequence `b`.
    pub fn qkv_at(&self, b: usize, h: usize, part: usize) -> usize {
        b * self.t * 3 * self.d + part * self.d + h * self.k()
    }

    /// Offset in `[B, T, D]` of head `h`'s first context element of sequence `b`.
    pub fn out_at(&self, b: usize, h: usize) -> usize {
        b * self.t * self.d + h * self.k()
    }
}

/// The output `[B, T, D]` and the weights `[B * H * T * T]` (before dropout).
fn forward(qkv: FlexTensor, heads: usize, mask: Option<Mask>) -> (FlexTensor, Vec<f32>) {
    let qkv = contiguous(qkv);
    let dims = Dims::of(&qkv, heads);
    let Dims { b, t, d, .. } = dims;
    let x = values(&qkv);
    assert_eq!(x.len(), b * t * 3 * d);
    let mut weights = vec![0.0; b * heads * t * t];
    let mut out: Vec<f32> = Vec::with_capacity(b * t * d);
    let dst = SendPtr(out.as_mut_ptr());
    let (k, row, ti, di) = (dims.k(), 3 * d as isize, t as isize, d as isize);
    weights
        .par_chunks_mut((t * t).max(1))
        .enumerate()
        .for_each_init(
            || vec![0.0f32; if mask.is_some() { t * t } else { 0 }],
            |dropped, (pair, p)| {
                let (bi, h) = (pair / heads, pair % heads);
                let (q, kk, v) = (
                    dims.qkv_at(bi, h, 0),
                    dims.qkv_at(bi, h, 1),
                    dims.qkv_at(bi, h, 2),
                );
                // SAFETY: every view lies inside `x`, `p` or `out` (offsets from `Dims`, rows of
                // `row` or `t` elements); each task writes only its own `p` and its own columns of
                // `out`, whose capacity is b * t * d.
                unsafe {
                    // P = Q K^T, then the causal softmax of P / sqrt(K).
                    mm(
                        (t, t, k),
                        (p.as_mut_ptr(), ti),
                        (at(x, q), row, 1),
                        (at(x, kk), 1, row),
                        ONE,
                    );
                    causal_softmax_in_place(p, t, t, dims.scale());
                    // context = P V, or (P M) V with dropout's factors M.
                    let weighs = match mask {
                        Some(mask) => {
                            mask.apply_into(p, dropped, pair * t * t);
                            dropped.as_ptr()
                        }
                        None => p.as_ptr(),
                    };
                    let o = dst.add(dims.out_at(bi, h));
                    mm((t, k, t), (o, di), (weighs, ti, 1), (at(x, v), row, 1), ONE);
                }
            },
        );
    // SAFETY: the tasks together wrote all b * t * d elements (every head's columns of
    // every row).
    unsafe { out.set_len(b * t * d) };
    (from_values(out, Shape::new([b, t, d])), weights)
}

/// The gradient of the projection `[B, T, 3D]` from the output's gradient `g` `[B, T, D]`.
fn backward(
    qkv: &FlexTensor,
    weights: &[f32],
    g: FlexTensor,
    heads: usize,
    mask: Option<Mask>,
) -> FlexTensor {
    let dims = Dims::of(qkv, heads);
    let Dims { b, t, d, .. } = dims;
    let (x, gs) = (values(qkv), values(&g));
    assert_eq!(
        gs.len(),
        b * t * d,
        "fused attention backward: gradient size"
    );
    let mut dx: Vec<f32> = Vec::with_capacity(b * t * 3 * d);
    let dst = SendPtr(dx.as_mut_ptr());
    let (k, row) = (dims.k(), 3 * d as isize);
    let (ti, di) = (t as isize, d as isize);
    weights
        .par_chunks((t * t).max(1))
        .enumerate()
        .for_each_init(
            || {
                let dropped = vec![0.0f32; if mask.is_some() { t * t } else { 0 }];
                (vec![0.0f32; t * t], dropped)
            },
            |(dp, dropped), (pair, p)| {
                let (bi, h) = (pair / heads, pair % heads);
                let (q, kk, v) = (
                    dims.qkv_at(bi, h, 0),
                    dims.qkv_at(bi, h, 1),
                    dims.qkv_at(bi, h, 2),
                );
                let go = at(gs, dims.out_at(bi, h));
                // SAFETY: as in `forward`; each task writes only its own head's Q, K and V
                // columns of `dx`, whose capacity is b * t * 3d.
                unsafe {
                    // dP = dO V^T (times dropout's factors: the gradient of P, not of P M),
                    // then the scores' gradient dS = softmax'(P) dP (scaled).
                    mm(
                        (t, t, k),
                        (dp.as_mut_ptr(), ti),
                        (go, di, 1),
                        (at(x, v), 1, row),
                        ONE,
                    );
                    if let Some(mask) = mask {
                        mask.apply_in_place(dp, pair * t * t);
                    }
                    causal_softmax_backward_in_place(p, dp, t, dims.scale());
                    // dQ = dS K, dK = dS^T Q
                    let (dq, dk, dv) = (dst.add(q), dst.add(kk), dst.add(v));
                    mm(
                        (t, k, t),
                        (dq, row),
                        (dp.as_ptr(), ti, 1),
                        (at(x, kk), row, 1),
                        ONE,
                    );
                    mm(
                        (t, k, t),
                        (dk, row),
                        (dp.as_ptr(), 1, ti),
                        (at(x, q), row, 1),
                        ONE,
                    );
                    // dV = (P M)^T dO: the weights that weighed the values.
                    let weighed = match mask {
                        Some(mask) => {
                            mask.apply_into(p, dropped, pair * t * t);
                            dropped.as_ptr()
                        }
                        None => p.as_ptr(),
                    };
                    mm((t, k, t), (dv, row), (weighed, 1, ti), (go, di, 1), ONE);
                }
            },
        );
    // SAFETY: the tasks together wrote every element: each (sequence, head) its Q, K and V
    // columns of every row.
    unsafe { dx.set_len(b * t * 3 * d) };
    from_values(dx, Shape::new([b, t, 3 * d]))
}

/// Each task's products run on its own thread (the tasks already fill rayon's threads).
pub(super) const ONE: gemm::Parallelism = gemm::Parallelism::None;

/// A pointer the tasks share; each writes its own disjoint elements.
#[derive(Clone, Copy)]
pub(super) struct SendPtr(pub *mut f32);
// SAFETY: tasks write disjoint elements through it and the owner waits for all of them.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer `offset` elements on.
    ///
    /// # Safety
    /// As `pointer::add`: the result must lie inside the same allocation.
    pub unsafe fn add(self, offset: usize) -> *mut f32 {
        // SAFETY: the caller's contract.
        unsafe { self.0.add(offset) }
    }
}

/// Pointer to `xs[offset]` (bounds-checked).
pub(super) fn at(xs: &[f32], offset: usize) -> *const f32 {
    xs[offset..].as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::agrees_on;
    use burn::tensor::{Device, Distribution};

    /// Output and the projection's gradient against the op's reference (what every other
    /// backend runs), on flex (the blocks), flex + autodiff and flex + autodiff + checkpointing
    /// (the weights kept, and recomputed in blocks at 260 positions); head sizes 4 and 7, one
    /// position and several. (Against the model's general attention path and its
    /// other causal path: ember-model's tests/ops_and_concepts.rs.)
    #[test]
    fn equals_the_reference() {
        for (b, t, heads, k) in [(2, 9, 3, 4), (1, 1, 2, 7), (3, 16, 1, 7), (1, 260, 2, 4)] {
            let d = heads * k;
            let draw = |dims: [usize; 3]| {
                Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.5), &Device::flex())
                    .into_data()
            };
            let (x, g) = (draw([b, t, 3 * d]), draw([b, t, d]));
            agrees_on(
                &Device::flex(),
                &x,
                &g,
                |qkv| causal_self_attention(qkv, heads, None).expect("a flex tensor"),
                |qkv| crate::causal_self_attention_reference(qkv, heads),
                2e-5,
                &format!("reference, {b}x{t}, {heads} heads of {k}"),
            );
        }
    }

    /// With dropout: output and the projection's gradient against the reference's weights
    /// multiplied by the mask's factors (element `((b H + h) T + i) T + j`), on flex, flex +
    /// autodiff and flex + autodiff + checkpointing; a sequence long enough that most of a
    /// row's weights are dropped or kept by chance.
    #[test]
    fn equals_the_reference_with_dropout() {
        let mask = Mask::new(crate::kernels::dropout::seed_of(0.618), 0.25);
        for (b, t, heads, k) in [(2, 9, 3, 4), (3, 40, 2, 8), (2, 300, 1, 4)] {
            let d = heads * k;
            let draw = |dims: [usize; 3]| {
                Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.5), &Device::flex())
                    .into_data()
            };
            let (x, g) = (draw([b, t, 3 * d]), draw([b, t, d]));
            let n = b * heads * t * t;
            let factors: Vec<f32> = (0..n).map(|i| mask.factor(i)).collect();
            let dropped = factors.iter().filter(|&&f| f == 0.0).count();
            assert!(dropped > 0 && dropped < n, "{dropped} of {n}");
            let reference = |qkv| crate::attention::masked_reference(qkv, heads, &factors);
            agrees_on(
                &Device::flex(),
                &x,
                &g,
                |qkv| causal_self_attention(qkv, heads, Some(mask)).expect("a flex tensor"),
                reference,
                2e-5,
                &format!("dropout, {b}x{t}, {heads} heads of {k}"),
            );
        }
    }
}
