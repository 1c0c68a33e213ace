//! The training attention's two passes as cuDNN operation graphs: scaled dot-product attention
//! under the causal mask, softmax statistics kept, dropout by cuDNN's Philox generator,
//! FlashAttention-2's backward pass; node for node what NVIDIA's cudnn-frontend (1.x, the
//! `sdpa` and `sdpa_backward` nodes PyTorch builds) gives cuDNN, which fuses each into one flash
//! kernel on tensor cores.
//!
//! The tensors are read and written where ember keeps them: the queries, keys and values are
//! column blocks of the fused projection `[B, T, 3D]` (head `h` at columns `h*K..(h+1)*K` of
//! each block), the output `[B, T, D]` holds the merged heads, the gradient `[B, T, 3D]` mirrors
//! the projection, and the softmax statistics are the `[B, H, T]` log-sum-exps ember's own
//! kernels keep: so no copy is made on either side of the call.
//!
//! Per head, with `S = scale Q K^T` under the causal mask, `L` each row's log-sum-exp, `P =
//! exp(S - L)`, `M` the dropout mask and `r = 1 / (1 - p)`:
//! - forward: `L`, then `O = (P M r) V`;
//! - backward: `delta = rowsum(dO O) (1 - p)`, `dV = (P M r)^T dO`, `dS = P (dO V^T M -
//!   delta) r scale`, `dK = dS^T Q`, `dQ = dS K` (accumulated in `f32`, then rounded).

use super::graph::{DataType, Graph, Pointwise, Reduce, Uid, contiguous};

/// The uids of the tensors in memory (the caller's buffers in the variant pack).
pub(crate) mod uid {
    use super::Uid;
    pub const Q: Uid = 1;
    pub const K: Uid = 2;
    pub const V: Uid = 3;
    pub const O: Uid = 4;
    pub const STATS: Uid = 5;
    pub const SEED: Uid = 6;
    pub const OFFSET: Uid = 7;
    pub const DO: Uid = 8;
    pub const DQ: Uid = 9;
    pub const DK: Uid = 10;
    pub const DV: Uid = 11;
    /// The backward pass's `delta` per query row, `f32` `[B, H, T]` (work memory).
    pub const DELTA: Uid = 12;
    /// The backward pass's queries' gradient accumulated in `f32` `[B, H, T, K]` (work memory).
    pub const DQ_ACCUMULATOR: Uid = 13;
}

/// What fixes one pair of graphs: the shapes, the type of the projection and the dropout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AttentionShape {
    /// Sequences `B`, heads `H`, positions `T`, head size `K`.
    pub b: i64,
    pub h: i64,
    pub t: i64,
    pub k: i64,
    /// The projection's type (bf16 or f16).
    pub dtype: DataType,
    /// The probability of dropping a weight.
    pub dropout: f32,
    /// Whether the graphs keep their dropout nodes (the generator, its mask and the rescale)
    /// when nothing is dropped: some cuDNN versions fuse the graph without them differently
    /// (`cube::cudnn_attention` checks which form agrees with ember's kernels).
    pub rng: bool,
    /// Whether a query sees only the keys up to its own position (the decoder's mask); else every
    /// key.
    pub causal: bool,
    /// The score that hides a masked position (cuDNN before 9.1 wants the lowest finite `f32`
    /// where later versions take minus infinity, as cudnn-frontend chooses).
    pub masked: f32,
}

impl AttentionShape {
    /// The model's width `D = H K`.
    pub fn d(&self) -> i64 {
        self.h * self.k
    }

    /// `1 / sqrt(K)`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.k as f32).sqrt()
    }

    /// Where each tensor in memory starts in its buffer, in elements: the keys and values (and
    /// their gradients) are column blocks of the projection (and its gradient).
    pub fn element_offset(&self, uid: Uid) -> i64 {
        match uid {
            uid::K | uid::DK => self.d(),
            uid::V | uid::DV => 2 * self.d(),
            _ => 0,
        }
    }

    /// `[B, H, T, K]` of a column block of the projection: rows `3D` apart.
    fn projection_block(&self) -> ([i64; 4], [i64; 4]) {
        let (b, h, t, k) = (self.b, self.h, self.t, self.k);
        let row = 3 * self.d();
        ([b, h, t, k], [t * row, k, row, 1])
    }

    /// The same block read transposed, `[B, H, K, T]` (`K^T`, `V^T`).
    fn projection_block_transposed(&self) -> ([i64; 4], [i64; 4]) {
        let ([b, h, t, k], [sb, sh, st, sk]) = self.projection_block();
        ([b, h, k, t], [sb, sh, sk, st])
    }

    /// `[B, H, T, K]` of the merged heads `[B, T, D]`.
    fn merged(&self) -> ([i64; 4], [i64; 4]) {
        let (b, h, t, k) = (self.b, self.h, self.t, self.k);
        let d = self.d();
        ([b, h, t, k], [t * d, k, d, 1])
    }

    /// `[B, H, T, 1]` per-row statistics, contiguous `[B, H, T]`.
    fn rows(&self) -> ([i64; 4], [i64; 4]) {
        let (b, h, t) = (self.b, self.h, self.t);
        ([b, h, t, 1], [h * t, t, 1, 1])
    }

    /// `[B, H, T, T]` scores, contiguous.
    fn scores(&self) -> [i64; 4] {
        [self.b, self.h, self.t, self.t]
    }

    /// The `[B, H, T, T]` scores transposed in place: `[B, H, T(keys), T(queries)]`.
    fn scores_transposed(&self) -> ([i64; 4], [i64; 4]) {
        let (b, h, t) = (self.b, self.h, self.t);
        ([b, h, t, t], [h * t * t, t * t, 1, t])
    }

    /// Whether the graphs have dropout nodes.
    fn dropped(&self) -> bool {
        self.dropout > 0.0 || self.rng
    }
}

/// The forward pass: `O` and the statistics `L` from `Q`, `K^T`, `V` (and the dropout seed and
/// offset).
pub(crate) fn forward_graph(shape: &AttentionShape) -> Graph {
    let mut g = Graph::new();
    let io = shape.dtype;
    let (qd, qs) = shape.projection_block();
    let (ktd, kts) = shape.projection_block_transposed();
    let (od, os) = shape.merged();
    let (rd, rs) = shape.rows();
    let q = g.memory(uid::Q, qd, qs, io);
    let kt = g.memory(uid::K, ktd, kts, io);
    let v = g.memory(uid::V, qd, qs, io);
    let o = g.memory(uid::O, od, os, io);
    let stats = g.memory(uid::STATS, rd, rs, DataType::F32);

    let sd = shape.scores();
    let s = g.inner(sd, contiguous(sd), DataType::F32);
    g.matmul_into(q, kt, s);
    let scale = g.scalar(shape.scale());
    let s = g.pointwise(Pointwise::Mul, s, Some(scale), DataType::F32);
    let s = match shape.causal {
        true => causal_mask(&mut g, s, shape.masked),
        false => s,
    };

    // Softmax, keeping each row's log-sum-exp: max, exp(s - max), its sum, max + log(sum).
    let max = g.inner(rd, rs, DataType::F32);
    g.reduce_into(Reduce::Max, s, max);
    let centred = g.pointwise(Pointwise::Sub, s, Some(max), DataType::F32);
    let e = g.pointwise(Pointwise::Exp, centred, None, DataType::F32);
    let sum = g.inner(rd, rs, DataType::F32);
    g.reduce_into(Reduce::Add, e, sum);
    let log = g.pointwise(Pointwise::Log, sum, None, DataType::F32);
    g.pointwise_into(Pointwise::Add, max, Some(log), None, stats, DataType::F32);
    // The weights that multiply `V` are in the projection's type (cuDNN's second product
    // takes its operands in one type).
    let p = match shape.dropped() {
        false => g.inner(sd, contiguous(sd), io),
        true => g.inner(sd, contiguous(sd), DataType::F32),
    };
    g.pointwise_into(Pointwise::Div, e, Some(sum), None, p, DataType::F32);
    let p = match shape.dropped() {
        false => p,
        true => {
            let (seed, offset) = seeds(&mut g);
            let keep = 1.0 - f64::from(shape.dropout);
            let mask = g.rng(seed, offset, keep, sd);
            let kept = g.pointwise(Pointwise::Mul, p, Some(mask), DataType::F32);
            let rescale = g.scalar(1.0 / (1.0 - shape.dropout));
            g.pointwise(Pointwise::Mul, kept, Some(rescale), io)
        }
    };
    g.matmul_into(p, v, o);
    g
}

/// The backward pass: `dQ`, `dK`, `dV` from `Q`, `K^T`, `V^T`, `O`, `dO` and the statistics
/// (and the dropout seed and offset of the forward pass), with two tensors of work memory
/// ([`uid::DELTA`], [`uid::DQ_ACCUMULATOR`]).
pub(crate) fn backward_graph(shape: &AttentionShape) -> Graph {
    let mut g = Graph::new();
    let io = shape.dtype;
    let f32_ = DataType::F32;
    let (b, h, t, k) = (shape.b, shape.h, shape.t, shape.k);
    let (qd, qs) = shape.projection_block();
    let (ktd, kts) = shape.projection_block_transposed();
    let (od, os) = shape.merged();
    let (rd, rs) = shape.rows();
    let q = g.memory(uid::Q, qd, qs, io);
    let kt = g.memory(uid::K, ktd, kts, io);
    let vt = g.memory(uid::V, ktd, kts, io);
    let o = g.memory(uid::O, od, os, io);
    let d_o = g.memory(uid::DO, od, os, io);
    let stats = g.memory(uid::STATS, rd, rs, f32_);
    let dq = g.memory(uid::DQ, qd, qs, io);
    let dk = g.memory(uid::DK, qd, qs, io);
    let dv = g.memory(uid::DV, qd, qs, io);
    let delta = g.memory(uid::DELTA, rd, rs, f32_);
    let dq_accumulator = g.memory(uid::DQ_ACCUMULATOR, qd, contiguous(qd), f32_);

    let scale = g.scalar(shape.scale());
    let sd = shape.scores();
    let mask = match shape.dropped() {
        false => None,
        true => {
            let (seed, offset) = seeds(&mut g);
            Some(g.rng(seed, offset, 1.0 - f64::from(shape.dropout), sd))
        }
    };
    let (keep, rescale) = match shape.dropped() {
        false => (g.scalar(1.0), None),
        true => (
            g.scalar(1.0 - shape.dropout),
            Some(g.scalar(1.0 / (1.0 - shape.dropout))),
        ),
    };

    // delta = rowsum(dO O) (1 - p): the strides cudnn-frontend gives this virtual product.
    let product = g.inner(od, [h * t * k, t * k, h * k, 1], f32_);
    g.pointwise_into(Pointwise::Mul, d_o, Some(o), None, product, f32_);
    let summed = g.inner(rd, rs, f32_);
    g.reduce_into(Reduce::Add, product, summed);
    g.pointwise_into(Pointwise::Mul, summed, Some(keep), None, delta, f32_);

    // P = exp(scale Q K^T - L) under the mask; dV = (P M r)^T dO.
    let s = g.inner(sd, contiguous(sd), f32_);
    g.matmul_into(q, kt, s);
    let s = g.pointwise(Pointwise::Mul, s, Some(scale), f32_);
    let s = g.pointwise(Pointwise::Sub, s, Some(stats), f32_);
    let s = match shape.causal {
        true => causal_mask(&mut g, s, shape.masked),
        false => s,
    };
    let p = g.pointwise(Pointwise::Exp, s, None, f32_);
    let mut dropped = p;
    if let (Some(mask), Some(rescale)) = (mask, rescale) {
        dropped = g.pointwise(Pointwise::Mul, dropped, Some(mask), f32_);
        dropped = g.pointwise(Pointwise::Mul, dropped, Some(rescale), f32_);
    }
    let (td, ts) = shape.scores_transposed();
    let dropped_t = g.reshape(dropped, td, ts, io);
    g.matmul_into(dropped_t, d_o, dv);

    // dS = P (dO V^T M - delta) r scale; dK = dS^T Q.
    let dp = g.inner(sd, contiguous(sd), f32_);
    g.matmul_into(d_o, vt, dp);
    let mut ds = dp;
    if let Some(mask) = mask {
        ds = g.pointwise(Pointwise::Mul, ds, Some(mask), f32_);
    }
    ds = g.pointwise(Pointwise::Sub, ds, Some(delta), f32_);
    ds = g.pointwise(Pointwise::Mul, ds, Some(p), f32_);
    if let Some(rescale) = rescale {
        ds = g.pointwise(Pointwise::Mul, ds, Some(rescale), f32_);
    }
    ds = g.pointwise(Pointwise::Mul, ds, Some(scale), f32_);
    let ds_t = g.reshape(ds, td, ts, io);
    g.matmul_into(ds_t, q, dk);

    // dQ = dS K, accumulated in f32, then rounded into the gradient.
    let k_rows = g.reshape(kt, [b, h, t, k], [kts[0], kts[1], kts[3], kts[2]], f32_);
    g.matmul_into(ds, k_rows, dq_accumulator);
    g.pointwise_into(Pointwise::Identity, dq_accumulator, None, None, dq, f32_);
    g
}

/// The dropout's seed and offset, `[1, 1, 1, 1]` `i64` tensors in memory.
fn seeds(g: &mut Graph) -> (Uid, Uid) {
    let one = [1; 4];
    (
        g.memory(uid::SEED, one, one, DataType::I64),
        g.memory(uid::OFFSET, one, one, DataType::I64),
    )
}

/// `s` with every score of a key after its query replaced by `masked`: row index >= column
/// index keeps a score (cudnn-frontend's causal mask, top-left diagonal).
fn causal_mask(g: &mut Graph, s: Uid, masked: f32) -> Uid {
    let (dims, strides) = {
        let s = g.tensor(s);
        (s.dims, s.strides)
    };
    let row = g.pointwise(Pointwise::GenIndex { axis: 2 }, s, None, DataType::I32);
    let col = g.pointwise(Pointwise::GenIndex { axis: 3 }, s, None, DataType::I32);
    let keep = g.inner(dims, strides, DataType::Bool);
    g.pointwise_into(Pointwise::CmpGe, row, Some(col), None, keep, DataType::Bool);
    let hidden = g.scalar(masked);
    let y = g.inner(dims, strides, DataType::F32);
    g.pointwise_into(
        Pointwise::BinarySelect,
        s,
        Some(hidden),
        Some(keep),
        y,
        DataType::F32,
    );
    y
}
