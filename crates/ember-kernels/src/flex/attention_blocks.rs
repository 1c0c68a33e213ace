//! The fused causal self-attention of [`super::attention`] in blocks of query rows, its weights
//! recomputed in the backward pass instead of kept: what flash attention does for the memory,
//! with whole rows per block, since a block of rows over every key fits in a core's cache.
//!
//! Kept weights cost `B * H * T * T` floats per layer until the backward pass: at context 1024
//! with GPT-2's 12 heads, 805 MB per layer for 16 sequences, more than the rest of the layer's
//! activations. Here the forward pass keeps nothing but its input, and each (sequence, head)
//! task works through its queries `BLOCK` rows at a time, over the keys up to the block's last
//! row only (causal: the products skip the keys no row of the block sees, about half of them at
//! long context). The backward pass multiplies the block's scores again and takes their
//! softmax again, the same products and the same softmax as the forward pass, so the weights
//! it uses are the forward pass's to the bit.
//!
//! Per block of rows `r0..r1` (`Qb`, `dOb` its rows, `K`, `V` the rows `0..r1`):
//! forward `P = softmax(Qb K^T / sqrt(K))`, `Ob = (P M) V` with dropout's factors `M`;
//! backward `dP = (dOb V^T) M`, `dS = P (dP - rowsum(P dP)) / sqrt(K)`, `dQb = dS K`,
//! `dK += dS^T Qb`, `dV += (P M)^T dOb`. The blocks run from the last to the first, so the
//! first (whose keys are all of them) writes `dK` and `dV` and the others add to them.

use rayon::prelude::*;

use super::attention::{Dims, ONE, SendPtr, at};
use crate::kernels::dropout::Mask;
use crate::kernels::softmax::{causal_softmax_backward_in_place, causal_softmax_in_place};
use crate::products::flex::{mm, mm_add};

/// Query rows per block: the block's scores, their gradient and the dropped weights (three
/// `[BLOCK, T]` buffers, 768 KB at context 1024) stay in a core's L2 cache.
pub(super) const BLOCK: usize = 64;

/// The merged heads `[B * T * D]` of the projection `x` (`[B, T, 3D]`, contiguous).
pub(super) fn forward(x: &[f32], dims: Dims, mask: Option<Mask>, block: usize) -> Vec<f32> {
    let Dims { b, t, d, heads } = dims;
    assert_eq!(x.len(), b * t * 3 * d);
    let mut out: Vec<f32> = Vec::with_capacity(b * t * d);
    let dst = SendPtr(out.as_mut_ptr());
    // At least one row: `step_by` takes no 0 (a call with no positions has no blocks).
    let rows = block.min(t).max(1);
    (0..b * heads).into_par_iter().for_each_init(
        || Scratch::new(rows, t, mask.is_some()),
        |scratch, pair| {
            let (bi, h) = (pair / heads, pair % heads);
            for r0 in (0..t).step_by(rows) {
                let r1 = (r0 + rows).min(t);
                let span = Rows::new(dims, bi, h, r0, r1);
                // SAFETY: `span`'s views lie inside `x` (offsets from `Dims`); the task writes
                // only its own head's columns of `out`'s rows `r0..r1`, whose capacity is
                // b * t * d.
                unsafe {
                    let p = span.weights(x, &mut scratch.p);
                    let weighs = span.dropped(p, mask, pair, &mut scratch.dropped);
                    let o = dst.add(dims.out_at(bi, h) + r0 * d);
                    let (k, row) = (dims.k(), 3 * d as isize);
                    let v = at(x, dims.qkv_at(bi, h, 2));
                    mm(
                        (r1 - r0, k, r1),
                        (o, d as isize),
                        (weighs, r1 as isize, 1),
                        (v, row, 1),
                        ONE,
                    );
                }
            }
        },
    );
    // SAFETY: the tasks together wrote all b * t * d elements (every head's columns of every
    // row, block by block).
    unsafe { out.set_len(b * t * d) };
    out
}

/// The gradient of the projection `[B * T * 3D]` from `x` (`[B, T, 3D]`) and the output's
/// gradient `g` (`[B, T, D]`), both contiguous.
pub(super) fn backward(
    x: &[f32],
    g: &[f32],
    dims: Dims,
    mask: Option<Mask>,
    block: usize,
) -> Vec<f32> {
    let Dims { b, t, d, heads } = dims;
    assert_eq!(x.len(), b * t * 3 * d);
    assert_eq!(
        g.len(),
        b * t * d,
        "fused attention backward: gradient size"
    );
    let mut dx: Vec<f32> = Vec::with_capacity(b * t * 3 * d);
    let dst = SendPtr(dx.as_mut_ptr());
    // At least one row: `step_by` takes no 0 (a call with no positions has no blocks).
    let rows = block.min(t).max(1);
    let (k, row, di) = (dims.k(), 3 * d as isize, d as isize);
    (0..b * heads).into_par_iter().for_each_init(
        || Scratch::new(rows, t, mask.is_some()),
        |scratch, pair| {
            let (bi, h) = (pair / heads, pair % heads);
            let (q, kk, v) = (
                dims.qkv_at(bi, h, 0),
                dims.qkv_at(bi, h, 1),
                dims.qkv_at(bi, h, 2),
            );
            for (nth, r0) in (0..t).step_by(rows).rev().enumerate() {
                let r1 = (r0 + rows).min(t);
                let (n, s) = (r1 - r0, r1 as isize);
                let span = Rows::new(dims, bi, h, r0, r1);
                let go = at(g, dims.out_at(bi, h) + r0 * d);
                let qb = at(x, q + r0 * 3 * d);
                // The last block sees every key: it writes dK and dV, the others add to them.
                let into_k_v = match nth {
                    0 => mm,
                    _ => mm_add,
                };
                // SAFETY: as in `forward`; the task writes only its own head's Q, K and V
                // columns of `dx` (rows `r0..r1` of Q, rows `0..r1` of K and V, the latter
                // written by the first block before any block adds to them), whose capacity is
                // b * t * 3d.
                unsafe {
                    let p = span.weights(x, &mut scratch.p);
                    // dP = dO V^T times dropout's factors (the gradient of P, not of P M),
                    // then dS in place of it.
                    let dp = &mut scratch.dp[..n * r1];
                    mm(
                        (n, r1, k),
                        (dp.as_mut_ptr(), s),
                        (go, di, 1),
                        (at(x, v), 1, row),
                        ONE,
                    );
                    if let Some(mask) = mask {
                        for (i, values) in dp.chunks_exact_mut(r1).enumerate() {
                            mask.apply_in_place(values, span.mask_at(pair, i));
                        }
                    }
                    causal_softmax_backward_in_place(p, dp, r1, dims.scale());
                    let (dq, dk, dv) = (dst.add(q + r0 * 3 * d), dst.add(kk), dst.add(v));
                    mm(
                        (n, k, r1),
                        (dq, row),
                        (dp.as_ptr(), s, 1),
                        (at(x, kk), row, 1),
                        ONE,
                    );
                    into_k_v(
                        (r1, k, n),
                        (dk, row),
                        (dp.as_ptr(), 1, s),
                        (qb, row, 1),
                        ONE,
                    );
                    let weighed = span.dropped(p, mask, pair, &mut scratch.dropped);
                    into_k_v((r1, k, n), (dv, row), (weighed, 1, s), (go, di, 1), ONE);
                }
            }
        },
    );
    // SAFETY: the tasks together wrote every element: each (sequence, head) its Q, K and V
    // columns of every row.
    unsafe { dx.set_len(b * t * 3 * d) };
    dx
}

/// One task's buffers, each `[block, T]` (the rows of a block use `r1` of each row's `T`).
struct Scratch {
    p: Vec<f32>,
    dp: Vec<f32>,
    dropped: Vec<f32>,
}

impl Scratch {
    fn new(rows: usize, t: usize, dropout: bool) -> Self {
        Self {
            p: vec![0.0; rows * t],
            dp: vec![0.0; rows * t],
            dropped: vec![0.0; if dropout { rows * t } else { 0 }],
        }
    }
}

/// Query rows `r0..r1` of head `h` of sequence `b`, over keys `0..r1`.
struct Rows {
    dims: Dims,
    b: usize,
    h: usize,
    r0: usize,
    r1: usize,
}

impl Rows {
    fn new(dims: Dims, b: usize, h: usize, r0: usize, r1: usize) -> Self {
        Self { dims, b, h, r0, r1 }
    }

    /// The block's weights `softmax(Qb K^T / sqrt(K))` (causal), `[r1 - r0, r1]`, in `buf`.
    ///
    /// # Safety
    /// `x` must be the whole projection of `self.dims`.
    unsafe fn weights<'a>(&self, x: &[f32], buf: &'a mut [f32]) -> &'a [f32] {
        let (n, s) = (self.r1 - self.r0, self.r1);
        let (k, row) = (self.dims.k(), 3 * self.dims.d as isize);
        let q = at(
            x,
            self.dims.qkv_at(self.b, self.h, 0) + self.r0 * 3 * self.dims.d,
        );
        let kk = at(x, self.dims.qkv_at(self.b, self.h, 1));
        let p = &mut buf[..n * s];
        // SAFETY: `n` rows of `Q` from `r0` and `s` rows of `K` lie inside `x`; `p` holds n * s.
        unsafe {
            mm(
                (n, s, k),
                (p.as_mut_ptr(), s as isize),
                (q, row, 1),
                (kk, 1, row),
                ONE,
            )
        };
        // Row i of the block sees keys 0..=r0 + i: `t = n` queries after `s - n = r0` others.
        causal_softmax_in_place(p, n, s, self.dims.scale());
        p
    }

    /// `p` times dropout's factors in `buf`, or `p` itself without dropout.
    fn dropped(&self, p: &[f32], mask: Option<Mask>, pair: usize, buf: &mut [f32]) -> *const f32 {
        let Some(mask) = mask else {
            return p.as_ptr();
        };
        let s = self.r1;
        let out = &mut buf[..p.len()];
        for (i, (values, into)) in p.chunks_exact(s).zip(out.chunks_exact_mut(s)).enumerate() {
            mask.apply_into(values, into, self.mask_at(pair, i));
        }
        out.as_ptr()
    }

    /// The mask's index of row `i` of the block's first key: element `((b H + h) T + r0 + i) T`
    /// (the index of the weight `(r0 + i, 0)` of (sequence, head) `pair`).
    fn mask_at(&self, pair: usize, i: usize) -> usize {
        let t = self.dims.t;
        (pair * t + self.r0 + i) * t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::masked_reference;
    use crate::kernels::dropout::seed_of;
    use burn::tensor::{Device, Distribution, Tensor, TensorData};

    /// The reference's output and the gradient of `sum(output * g)` with respect to `x`, by
    /// Burn's ops under autodiff, with every weight multiplied by its factor in `factors`.
    fn reference(x: &TensorData, g: &TensorData, heads: usize, factors: &[f32]) -> [Vec<f32>; 2] {
        let device = Device::flex().autodiff();
        let input = Tensor::<3>::from_data(x.clone(), &device).require_grad();
        let out = masked_reference(input.clone(), heads, factors);
        let grads = (out.clone() * Tensor::<3>::from_data(g.clone(), &device))
            .sum()
            .backward();
        let grad = input.grad(&grads).expect("a gradient");
        let values = |t: Tensor<3>| t.into_data().try_to_vec::<f32>().expect("f32");
        [values(out.inner()), values(grad)]
    }

    /// Output and gradient against the reference for blocks that divide the sequence and
    /// blocks that leave a shorter last one, one row per block up to the whole sequence in
    /// one, with and without dropout.
    #[test]
    fn equal_the_reference_for_every_block_size() {
        let dropout = Mask::new(seed_of(0.377), 0.3);
        for (b, t, heads, k) in [(2, 9, 3, 4), (1, 1, 2, 7), (3, 40, 2, 8)] {
            let d = heads * k;
            let draw = |dims: [usize; 3]| {
                Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.5), &Device::flex())
                    .into_data()
            };
            let (x, g) = (draw([b, t, 3 * d]), draw([b, t, d]));
            let (xs, gs) = (
                x.try_to_vec::<f32>().unwrap(),
                g.try_to_vec::<f32>().unwrap(),
            );
            let dims = Dims { b, t, d, heads };
            for mask in [None, Some(dropout)] {
                let n = b * heads * t * t;
                let factors: Vec<f32> = (0..n)
                    .map(|i| mask.map_or(1.0, |m: Mask| m.factor(i)))
                    .collect();
                let [out, grad] = reference(&x, &g, heads, &factors);
                for block in [1, 3, 8, 16, t, t + 5] {
                    let what = format!("{b}x{t}, {heads} heads of {k}, block {block}, {mask:?}");
                    let ours = [
                        forward(&xs, dims, mask, block),
                        backward(&xs, &gs, dims, mask, block),
                    ];
                    for (name, ours, want) in
                        [("output", &ours[0], &out), ("gradient", &ours[1], &grad)]
                    {
                        assert_eq!(ours.len(), want.len(), "{what}: {name} size");
                        let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                        let diff = ours
                            .iter()
                            .zip(want)
                            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                        assert!(diff < 2e-5 * scale, "{what}: {name} off by {diff}");
                    }
                }
            }
        }
    }

    /// The blocks after the first add to the K and V gradients the first wrote: with a zero
    /// output gradient on all but the last 8 rows, the later blocks of 8 add nothing, and the
    /// gradient equals the whole sequence's in one block (a later block that wrote instead of
    /// adding would zero the first rows' K and V gradients).
    #[test]
    fn later_blocks_add_to_what_the_first_wrote() {
        let (b, t, heads, k) = (1, 24, 2, 4);
        let d = heads * k;
        let draw = |dims: [usize; 3]| {
            Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &Device::flex())
                .into_data()
                .try_to_vec::<f32>()
                .unwrap()
        };
        let x = draw([b, t, 3 * d]);
        let mut g = draw([b, t, d]);
        let dims = Dims { b, t, d, heads };
        // Only the last 8 rows' outputs matter: the blocks of 8 that run later add zeros.
        g[..(t - 8) * d].fill(0.0);
        let whole = backward(&x, &g, dims, None, t);
        let blocks = backward(&x, &g, dims, None, 8);
        let diff = whole
            .iter()
            .zip(&blocks)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff < 1e-5, "{diff}");
        // The first rows' K and V gradients are not zero: the last rows see them.
        assert!(blocks[d..3 * d].iter().any(|&v| v != 0.0));
    }
}
