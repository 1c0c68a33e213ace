//! Two-dimensional matrix products on Burn's flex backend through `gemm` (the crate flex itself
//! calls), with their own autodiff op.
//!
//! Burn 0.22.1's flex matmul allocates each output zero-filled with a one-byte alignment and then
//! copies it into an aligned buffer (docs/burn-findings.md, finding 2): 18% of a baby-GPT
//! training step. Here gemm writes the product straight into a new, unfilled buffer, and the
//! backward pass reads the transposes of its inputs in place (a transpose is a swap of
//! strides), so a layer's weight gradient is one product over all rows.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{Shape, Tensor};

use crate::flex::op;
use crate::flex::tensor::{Tracked, from_values};

/// Products with at least this many multiply-adds (`m * n * k`) run on all of rayon's threads;
/// smaller ones on the calling thread. Flex's own threshold. Products of a few rows by large
/// weights are split by [`column_block`] instead.
const PARALLEL_WORK: usize = 192 * 192 * 192;

/// `lhs @ rhs`: on flex `f32` tensors (tracked by autodiff or not) by gemm into a new buffer,
/// reading strided views (a transpose, a slice) in place; elsewhere Burn's `matmul`.
///
/// # Shapes
/// - lhs: `[M, K]`
/// - rhs: `[K, N]`
/// - output: `[M, N]`, contiguous
pub(crate) fn matmul(lhs: Tensor<2>, rhs: Tensor<2>) -> Result<Tensor<2>, (Tensor<2>, Tensor<2>)> {
    op::binary(lhs, rhs, FlexMatmul)
}

impl op::Binary for FlexMatmul {
    fn plain(self, a: FlexTensor, b: FlexTensor) -> FlexTensor {
        product(&a, &b)
    }

    fn tracked<C: CheckpointStrategy>(self, a: Tracked, b: Tracked) -> Tracked {
        tracked::<C>(a, b)
    }
}

/// The autodiff op. Like Burn's matmul it keeps `lhs` only when `rhs` needs a gradient, and
/// `rhs` only when `lhs` does.
fn tracked<C: CheckpointStrategy>(lhs: Tracked, rhs: Tracked) -> Tracked {
    let (lhs_tracked, rhs_tracked) = (lhs.is_tracked(), rhs.is_tracked());
    match FlexMatmul
        .prepare::<C>([lhs.node(), rhs.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let lhs_state = rhs_tracked.then(|| prep.checkpoint(&lhs));
            let rhs_state = lhs_tracked.then(|| prep.checkpoint(&rhs));
            let out = product(lhs.primitive(), rhs.primitive());
            prep.finish((lhs_state, rhs_state), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(product(lhs.primitive(), rhs.primitive())),
    }
}

#[derive(Debug)]
struct FlexMatmul;

impl Backward<Flex, 2> for FlexMatmul {
    /// The nodes of `lhs` and `rhs`, where the other side needs them.
    type State = (Option<NodeId>, Option<NodeId>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let (lhs, rhs) = ops.state;
        let lhs: Option<FlexTensor> = lhs.map(|id| checkpointer.retrieve_node_output(id));
        let rhs: Option<FlexTensor> = rhs.map(|id| checkpointer.retrieve_node_output(id));
        binary::<Flex, _, _>(
            ops.parents,
            ops.node,
            grads,
            // d lhs = grad @ rhs^T
            |grad| {
                let rhs = rhs.expect("rhs kept for lhs's gradient");
                gemm_new(Mat::of(&grad), Mat::of(&rhs).transposed())
            },
            // d rhs = lhs^T @ grad
            |grad| {
                let lhs = lhs.expect("lhs kept for rhs's gradient");
                gemm_new(Mat::of(&lhs).transposed(), Mat::of(&grad))
            },
        );
    }
}

/// `a @ b` of two 2-D flex `f32` tensors.
fn product(a: &FlexTensor, b: &FlexTensor) -> FlexTensor {
    gemm_new(Mat::of(a), Mat::of(b))
}

/// A strided 2-D view of an `f32` buffer: element `(i, j)` is `data[offset + i * rs + j * cs]`.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    offset: usize,
    rows: usize,
    cols: usize,
    rs: isize,
    cs: isize,
}

impl<'a> Mat<'a> {
    /// The view of a 2-D flex `f32` tensor.
    fn of(t: &'a FlexTensor) -> Self {
        let shape = t.shape();
        assert_eq!(shape.num_dims(), 2, "flex matmul takes 2-D tensors");
        let layout = t.layout();
        let strides = layout.strides();
        let mat = Mat {
            data: t.storage::<f32>(),
            offset: layout.start_offset(),
            rows: shape[0],
            cols: shape[1],
            rs: strides[0],
            cs: strides[1],
        };
        mat.check();
        mat
    }

    fn transposed(self) -> Self {
        Mat {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Panics unless every element the view names lies inside its buffer (what makes the raw
    /// pointer reads in [`gemm_new`] sound).
    fn check(&self) {
        if self.rows == 0 || self.cols == 0 {
            return;
        }
        let reach = |n: usize, stride: isize| (n as isize - 1) * stride;
        let (lo_r, hi_r) = sorted(0, reach(self.rows, self.rs));
        let (lo_c, hi_c) = sorted(0, reach(self.cols, self.cs));
        let lo = self.offset as isize + lo_r + lo_c;
        let hi = self.offset as isize + hi_r + hi_c;
        assert!(
            lo >= 0 && (hi as usize) < self.data.len(),
            "flex matmul: a view outside its buffer"
        );
    }

    /// Pointer to element `(0, 0)`.
    fn origin(&self) -> *const f32 {
        self.data[self.offset..].as_ptr()
    }
}

fn sorted(a: isize, b: isize) -> (isize, isize) {
    if a <= b { (a, b) } else { (b, a) }
}

/// `a @ b` into a new contiguous `[a.rows, b.cols]` tensor.
fn gemm_new(a: Mat, b: Mat) -> FlexTensor {
    assert_eq!(a.cols, b.rows, "flex matmul: inner sizes differ");
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let shape = Shape::new([m, n]);
    if m == 0 || n == 0 || k == 0 {
        return from_values(vec![0.0; m * n], shape);
    }
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    // SAFETY: both views were bounds-checked by `Mat::check` and outlive the call; `out` has
    // room for m * n elements, and the products write every one of them without reading any,
    // so all are initialised when the length is set.
    unsafe {
        let (c, a, b) = (
            out.as_mut_ptr(),
            (a.origin(), a.rs, a.cs),
            (b.origin(), b.rs, b.cs),
        );
        match column_block(m, n, k, rayon::current_num_threads()) {
            Some(block) => mm_column_blocks((m, n, k), block, (c, n as isize), a, b),
            None => {
                let parallelism = match m.saturating_mul(n).saturating_mul(k) >= PARALLEL_WORK {
                    true => gemm::Parallelism::Rayon(0),
                    false => gemm::Parallelism::None,
                };
                mm((m, n, k), (c, n as isize), a, b, parallelism)
            }
        }
        out.set_len(m * n);
    }
    from_values(out, shape)
}

/// A product of at most this many rows (a decoding step of up to 16 sequences) by a
/// right-hand side of at least [`SPLIT_WEIGHTS`] values (a layer's weights) costs the reading of
/// those weights, which one core cannot do as fast as two; yet gemm keeps one row on one thread
/// whatever it is asked (its matrix-vector path), and a few rows below [`PARALLEL_WORK`]. Such
/// products split their columns over rayon's threads: a step of GPT-2 124M's decoding reads
/// 500 MB of weights.
const FEW_ROWS: usize = 16;

/// 512 KiB of `f32` weights: see [`FEW_ROWS`].
const SPLIT_WEIGHTS: usize = 1 << 17;

/// The split's blocks are a multiple of this many columns (4 cache lines of `f32`).
const COLUMN_BLOCK: usize = 64;

/// The columns per block when a `[m, k] @ [k, n]` product is split over `threads` threads
/// ([`FEW_ROWS`]), else `None`.
fn column_block(m: usize, n: usize, k: usize, threads: usize) -> Option<usize> {
    let split = threads > 1
        && m <= FEW_ROWS
        && n >= 2 * COLUMN_BLOCK
        && k.saturating_mul(n) >= SPLIT_WEIGHTS;
    split.then(|| n.div_ceil(threads).next_multiple_of(COLUMN_BLOCK))
}

/// [`mm`] as independent products of `block` columns each (the last one shorter), on rayon's
/// threads, each by [`few_rows`] where it takes them, else by gemm on the block's thread.
///
/// # Safety
/// As [`mm`].
unsafe fn mm_column_blocks(
    (m, n, k): (usize, usize, usize),
    block: usize,
    (c, c_rs): (*mut f32, isize),
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
) {
    use rayon::prelude::*;
    // Raw pointers are not `Send`; the blocks write disjoint columns of `c`.
    let (c, a, b) = (c as usize, a as usize, b as usize);
    (0..n.div_ceil(block)).into_par_iter().for_each(|i| {
        let first = i * block;
        let cols = block.min(n - first);
        // SAFETY: columns `first..first + cols` of the caller's views, which lie inside their
        // allocations; no two blocks write the same element of `c`.
        unsafe {
            let (a, b) = (
                a as *const f32,
                (b as *const f32).offset(first as isize * b_cs),
            );
            let c = (c as *mut f32).add(first);
            if !few_rows((m, cols, k), (c, c_rs), (a, a_rs, a_cs), (b, b_rs, b_cs)) {
                mm(
                    (m, cols, k),
                    (c, c_rs),
                    (a, a_rs, a_cs),
                    (b, b_rs, b_cs),
                    gemm::Parallelism::None,
                )
            }
        }
    });
}

/// [`mm`] by ember's kernels for a few rows (`kernels::few_rows`), which read each weight once,
/// where the layout suits them: `A`'s rows contiguous, `B` row-major, or its transpose for more
/// than one row. Returns `false`, having done nothing, otherwise.
///
/// # Safety
/// As [`mm`].
unsafe fn few_rows(
    (m, n, k): (usize, usize, usize),
    (c, c_rs): (*mut f32, isize),
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
) -> bool {
    use crate::kernels::few_rows::{MAX_ROWS, rows_by_matrix, rows_by_transposed};
    let positive = |stride: isize| usize::try_from(stride).ok().filter(|&s| s > 0);
    let (Some(a_rs), Some(c_rs)) = (positive(a_rs), positive(c_rs)) else {
        return false;
    };
    let by_rows = b_cs == 1 && positive(b_rs).is_some();
    // One row by a transposed table (a tied output head) is gemm's matrix-vector loop's best
    // case: a token of GPT-2 124M 1.2x faster with it on 2 cores (four rows 1.2x slower).
    let by_columns = m > 1 && b_rs == 1 && positive(b_cs).is_some();
    if m == 0 || m > MAX_ROWS || a_cs != 1 || !(by_rows || by_columns) || n == 0 || k == 0 {
        return false;
    }
    // SAFETY: the caller's views lie inside live allocations: `A`'s `m` rows of `k`, `B`'s `k`
    // rows of `n` (or `n` rows of `k`), and `C`'s `m` rows of `n`, which nobody else touches.
    unsafe {
        let a = std::slice::from_raw_parts(a, (m - 1) * a_rs + k);
        let mut out: Vec<&mut [f32]> = (0..m)
            .map(|r| std::slice::from_raw_parts_mut(c.add(r * c_rs), n))
            .collect();
        if by_rows {
            let b_rs = b_rs as usize;
            let b = std::slice::from_raw_parts(b, (k - 1) * b_rs + n);
            rows_by_matrix(a, a_rs, k, b, b_rs, &mut out);
        } else {
            let b_cs = b_cs as usize;
            let b = std::slice::from_raw_parts(b, (n - 1) * b_cs + k);
            rows_by_transposed(a, a_rs, k, b, b_cs, &mut out);
        }
    }
    true
}

/// `C = A B` by gemm for sizes `(m, n, k)`: `C` `[m, n]` (pointer, row stride; columns
/// contiguous), `A` `[m, k]` and `B` `[k, n]` (pointer, row stride, column stride). `C` is
/// written, never read.
///
/// # Safety
/// Every element of the three views must lie inside live allocations, and `C` must not
/// overlap `A` or `B` or be written by anyone else during the call.
pub(crate) unsafe fn mm(
    sizes: (usize, usize, usize),
    c: (*mut f32, isize),
    a: (*const f32, isize, isize),
    b: (*const f32, isize, isize),
    parallelism: gemm::Parallelism,
) {
    // SAFETY: the caller's contract.
    unsafe { gemm_call(sizes, c, false, a, b, parallelism) }
}

/// `C += A B`, otherwise as [`mm`] (`C` is read, so it must hold values).
///
/// # Safety
/// As [`mm`], and every element of `C` initialized.
pub(crate) unsafe fn mm_add(
    sizes: (usize, usize, usize),
    c: (*mut f32, isize),
    a: (*const f32, isize, isize),
    b: (*const f32, isize, isize),
    parallelism: gemm::Parallelism,
) {
    // SAFETY: the caller's contract.
    unsafe { gemm_call(sizes, c, true, a, b, parallelism) }
}

/// gemm's `C = [C +] A B` (`read_dst`: add to `C`'s values, else overwrite them).
///
/// # Safety
/// As [`mm_add`] where `read_dst`, else as [`mm`].
unsafe fn gemm_call(
    (m, n, k): (usize, usize, usize),
    (c, c_rs): (*mut f32, isize),
    read_dst: bool,
    (a, a_rs, a_cs): (*const f32, isize, isize),
    (b, b_rs, b_cs): (*const f32, isize, isize),
    parallelism: gemm::Parallelism,
) {
    // SAFETY: the caller's contract; gemm computes `alpha C + beta A B` where `read_dst`,
    // `beta A B` otherwise.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c,
            1,
            c_rs,
            read_dst,
            a,
            a_cs,
            a_rs,
            b,
            b_cs,
            b_rs,
            if read_dst { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul;
    use burn::tensor::{Device, Distribution, TensorData};

    /// `a @ b` in f64 by the definition, from row-major data.
    fn reference(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                    .sum();
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    /// The product against the f64 definition for shapes on both sides of the threading
    /// threshold, odd sizes, an inner size of 0, and inputs that are transposed views or
    /// slices with an offset.
    #[test]
    fn products_equal_the_definition() {
        let device = Device::flex();
        let normal = Distribution::Normal(0.0, 1.0);
        for (m, k, n) in [
            (1, 1, 1),
            (3, 5, 7),
            (17, 33, 9),
            (200, 190, 210),
            (4, 0, 3),
        ] {
            let a = Tensor::<2>::random([m, k], normal, &device);
            let b = Tensor::<2>::random([k, n], normal, &device);
            let want = reference(&values(a.clone()), &values(b.clone()), m, k, n);
            // Plain, transposed views (a = (a^T)^T read through swapped strides), and
            // slices starting past the buffer's first element.
            let a_t = Tensor::<2>::from_data(
                TensorData::new(values(a.clone().transpose()), [k, m]),
                &device,
            )
            .transpose();
            let padded = Tensor::cat(vec![Tensor::zeros([1, n], &device), b.clone()], 0);
            let b_off = padded.slice([1..k + 1, 0..n]);
            for (x, y) in [(a.clone(), b.clone()), (a_t, b.clone()), (a.clone(), b_off)] {
                assert!(crate::kernels_take(&x));
                let got = values(matmul(x, y));
                assert_eq!(got.len(), want.len());
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() < 1e-4 * (1.0 + w.abs()),
                        "{m}x{k}x{n}: {g} vs {w}"
                    );
                }
            }
        }
    }

    /// Few rows by large weights split their columns over the threads: blocks of whole
    /// multiples of 64 columns, one per thread, covering every column; anything else does not.
    #[test]
    fn few_rows_split_their_columns() {
        assert_eq!(column_block(1, 2304, 768, 2), Some(1152));
        assert_eq!(column_block(FEW_ROWS, 1000, 768, 2), Some(512)); // 512 + 488
        let block = column_block(1, 50257, 768, 3).unwrap();
        assert!(block.is_multiple_of(COLUMN_BLOCK) && 3 * block >= 50257 && 2 * block < 50257);
        assert_eq!(column_block(FEW_ROWS + 1, 2304, 768, 2), None);
        assert_eq!(column_block(1, 2304, 768, 1), None);
        assert_eq!(column_block(1, 100, 2000, 2), None);
        assert_eq!(column_block(1, 256, 256, 2), None);
    }

    /// Products of few rows by weights large enough to be split, against the f64 definition:
    /// by ember's loops (up to 8 rows; weights row-major or a transposed table) and by gemm
    /// (12 rows, or a left side that is a transposed view), left sides with wider rows, column
    /// counts that leave a short last block.
    #[test]
    fn few_row_products_equal_the_definition() {
        let device = Device::flex();
        let normal = Distribution::Normal(0.0, 1.0);
        for (m, k, n) in [(1, 300, 700), (3, 260, 1000), (8, 512, 300), (12, 300, 450)] {
            assert!(column_block(m, n, k, 2).is_some());
            let a = Tensor::<2>::random([m, k], normal, &device);
            let b = Tensor::<2>::random([k, n], normal, &device);
            let want = reference(&values(a.clone()), &values(b.clone()), m, k, n);
            let b_t = Tensor::<2>::from_data(
                TensorData::new(values(b.clone().transpose()), [n, k]),
                &device,
            )
            .transpose();
            let a_t = Tensor::<2>::from_data(
                TensorData::new(values(a.clone().transpose()), [k, m]),
                &device,
            )
            .transpose();
            let wide =
                Tensor::cat(vec![a.clone(), Tensor::zeros([m, 5], &device)], 1).slice([0..m, 0..k]);
            for (x, y) in [
                (a.clone(), b.clone()),
                (a.clone(), b_t),
                (wide, b.clone()),
                (a_t, b.clone()),
            ] {
                let got = values(matmul(x, y));
                assert_eq!(got.len(), want.len());
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() < 1e-4 * (1.0 + w.abs()),
                        "{m}x{k}x{n} [{}, {}]: {g} vs {w}",
                        i / n,
                        i % n
                    );
                }
            }
        }
    }

    /// Gradients of both sides against Burn's matmul, with and without checkpointing, and
    /// when only one side is tracked; with a transposed right-hand side (the tied output head).
    #[test]
    fn gradients_equal_burns() {
        let draw = |dims: [usize; 2]| {
            Tensor::<2>::random(dims, Distribution::Normal(0.0, 1.0), &Device::flex()).into_data()
        };
        let (a, b, g) = (draw([37, 19]), draw([23, 19]), draw([37, 23]));
        for device in [
            Device::flex().autodiff(),
            Device::flex().autodiff().gradient_checkpointing(),
        ] {
            for (track_a, track_b) in [(true, true), (true, false), (false, true)] {
                let run = |ours: bool| {
                    let load = |d: &TensorData, track: bool| {
                        let x = Tensor::<2>::from_data(d.clone(), &device);
                        if track { x.require_grad() } else { x }
                    };
                    let (x, w) = (load(&a, track_a), load(&b, track_b));
                    let y = if ours {
                        matmul(x.clone().exp(), w.clone().transpose())
                    } else {
                        x.clone().exp().matmul(w.clone().transpose())
                    };
                    let weight = Tensor::<2>::from_data(g.clone(), &device);
                    let grads = (y.clone() * weight).sum().backward();
                    let mut out = vec![values(y.inner())];
                    for (t, track) in [(x, track_a), (w, track_b)] {
                        let grad = t.grad(&grads);
                        assert_eq!(grad.is_some(), track);
                        out.extend(grad.map(values));
                    }
                    out
                };
                let (ours, burns) = (run(true), run(false));
                assert_eq!(ours.len(), burns.len());
                for (o, b) in ours.iter().zip(&burns) {
                    for (x, y) in o.iter().zip(b) {
                        assert!((x - y).abs() < 1e-3 * (1.0 + y.abs()), "{x} vs {y}");
                    }
                }
            }
        }
    }
}
