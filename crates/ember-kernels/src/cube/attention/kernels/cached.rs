//! Decoding's attention over the KV cache's whole buffer: one cube per query row, the start
//! position a launch argument or read on the device.

use super::*;
use crate::cube::{cube_row, reduce_cube};

/// Attention over a KV cache's whole buffer: one cube of `units` units per query row
/// `(b, h, i)` (at position `start + i`), over keys `0..=start + i`; inputs read through
/// their strides (the queries are a view of the projection), the output contiguous. The
/// units split the keys for the scores (kept in shared memory, `capacity` of them), reduce
/// their maximum and sum through shared memory, and split the head's columns for the
/// weighted sum of values.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn cached_attention<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    start: u32,
    scale: f32,
    #[comptime] head: usize,
    #[comptime] capacity: usize,
    #[comptime] units: usize,
) {
    cached_rows::<F>(q, k, v, out, start, scale, head, capacity, units);
}

/// [`cached_attention`] for queries starting at `position[0]`, read on the device (a
/// captured step attends wherever the position buffer says when it is replayed).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub(crate) fn cached_attention_at<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    position: &Tensor<i32>,
    scale: f32,
    #[comptime] head: usize,
    #[comptime] capacity: usize,
    #[comptime] units: usize,
) {
    let start = position[0] as u32;
    cached_rows::<F>(q, k, v, out, start, scale, head, capacity, units);
}

/// The body of [`cached_attention`], for either source of `start`.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn cached_rows<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    start: u32,
    scale: f32,
    #[comptime] head: usize,
    #[comptime] capacity: usize,
    #[comptime] units: usize,
) {
    let row = cube_row();
    let t = q.shape(2);
    let heads = q.shape(1);
    if row >= q.shape(0) * heads * t {
        terminate!();
    }
    let u = UNIT_POS_X as usize;
    let i = row % t;
    let h = (row / t) % heads;
    let b = row / t / heads;
    let qi = b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
    let k0 = b * k.stride(0) + h * k.stride(1);
    let v0 = b * v.stride(0) + h * v.stride(1);
    let (qc, kc, vc) = (q.stride(3), k.stride(3), v.stride(3));
    let scale = F::cast_from(scale);
    let n = start as usize + i + 1; // keys this row sees

    // Scores of keys u, u + units, ..., and this unit's maximum.
    let mut scores = Shared::<[F]>::new_slice(capacity);
    let mut m = F::min_value();
    // The keys of unit u: u, u + units, ... below n.
    let mine = (n + units - 1 - u) / units;
    for r in 0..mine {
        let j = u + r * units;
        let kj = k0 + j * k.stride(2);
        let mut dot = F::new(0.0);
        #[unroll]
        for c in 0..head {
            dot += q[qi + c * qc] * k[kj + c * kc];
        }
        let s = dot * scale;
        scores[j] = s;
        if s > m {
            m = s;
        }
    }
    let mut partial = Shared::<[F]>::new_slice(units);
    let row_max = reduce_cube::<F>(&mut partial, m, true);

    // Weights `exp(s - m)` in place of the scores, and their sum.
    let mut l = F::new(0.0);
    for r in 0..mine {
        let j = u + r * units;
        let p = F::exp(scores[j] - row_max);
        scores[j] = p;
        l += p;
    }
    let total = reduce_cube::<F>(&mut partial, l, false);

    // Column c of the output: the weighted sum of the values' column c.
    let columns = (head + units - 1 - u) / units;
    for r in 0..columns {
        let c = u + r * units;
        let mut acc = F::new(0.0);
        for j in 0..n {
            acc += scores[j] * v[v0 + j * v.stride(2) + c * vc];
        }
        out[row * head + c] = acc / total;
    }
}
