//! Rotary positions on the query and key parts of the fused `[Q | K | V]` projection, in one pass
//! on Burn's flex backend, with its own backward pass (the inverse rotation).
//!
//! [`crate::rotation::apply_rotary`] is nine tensor ops on each of Q and K (two slices, six
//! products and sums, a concatenation), each a node of the autodiff graph, and it needs the heads
//! split first, which kept rotary models off the fused attention ([`super::attention`]). Here the
//! rotation reads and writes `[B, T, 3D]` in place of the projection, so the fused attention
//! takes the result as it takes an unrotated projection.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::Tensor;
use rayon::prelude::*;

use super::op;
use super::tensor::{Tracked, contiguous, from_values};
use crate::rotation::Rope;

/// One rotation: the heads of the projection, the position of its first row, the frequencies.
#[derive(Debug, Clone, Copy)]
struct Rotation {
    heads: usize,
    start: usize,
    rope: Rope,
}

/// `qkv` with each head's query and key rotated as [`crate::rotation::apply_rotary`] rotates
/// them (pairs `i` and `i + K/2`, row `p` at position `start + p`), values unchanged; `qkv` back
/// where this path does not apply (not a flex `f32` tensor).
///
/// # Shapes
/// - qkv: `[B, T, 3D]`, columns `[Q | K | V]`, head `h` at columns `h*K..(h+1)*K` of each
/// - output: `[B, T, 3D]`
pub(crate) fn rotate_qk(
    qkv: Tensor<3>,
    heads: usize,
    start: usize,
    rope: Rope,
) -> Result<Tensor<3>, Tensor<3>> {
    let d3 = qkv.dims()[2];
    assert!(
        d3.is_multiple_of(3)
            && (d3 / 3).is_multiple_of(heads)
            && (d3 / 3 / heads).is_multiple_of(2),
        "rotary: {d3} columns do not split into Q, K, V of {heads} heads of even size"
    );
    let rot = Rotation { heads, start, rope };
    op::unary(qkv, rot)
}

impl op::Unary for Rotation {
    fn plain(self, x: FlexTensor) -> FlexTensor {
        rotate(x, self, false)
    }

    fn tracked<C: CheckpointStrategy>(self, x: Tracked) -> Tracked {
        tracked::<C>(x, self)
    }
}

/// The autodiff op; its backward needs only the rotation.
fn tracked<C: CheckpointStrategy>(t: Tracked, rot: Rotation) -> Tracked {
    match RotateQk.prepare::<C>([t.node()]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(rot, rotate(t.primitive().clone(), rot, false)),
        OpsKind::UnTracked(prep) => prep.finish(rotate(t.into_primitive(), rot, false)),
    }
}

#[derive(Debug)]
struct RotateQk;

impl Backward<Flex, 1> for RotateQk {
    type State = Rotation;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let rot = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |g| rotate(g, rot, true));
    }
}

/// `cos` and `sin` of every (row, pair) angle, `[T * K/2]` each, as `positional::angles`
/// computes them (`f32` position times `f32` frequency).
fn tables(rot: Rotation, t: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
    let freqs = rot.rope.frequencies(k / 2, k as f64);
    let angles = (0..t).flat_map(|p| freqs.iter().map(move |&f| (rot.start + p) as f32 * f));
    angles.map(|a| (a.cos(), a.sin())).unzip()
}

/// Rows per task when a rotation is spread over rayon's threads.
const ROWS: usize = 64;

/// Rotates (or, `inverse`, rotates back: the transpose, which is the backward pass) the Q and K
/// columns of every row of `x` `[B, T, 3D]`; in place when no one else holds its buffer.
fn rotate(x: FlexTensor, rot: Rotation, inverse: bool) -> FlexTensor {
    let mut x = contiguous(x);
    let shape = x.shape();
    let (t, d3) = (shape[1], shape[2]);
    let k = d3 / 3 / rot.heads;
    let (cos, sin) = tables(rot, t, k);
    let sign = if inverse { -1.0 } else { 1.0 };
    let turn = |row: &mut [f32], r: usize| {
        let p = r % t;
        let (cos, sin) = (&cos[p * k / 2..][..k / 2], &sin[p * k / 2..][..k / 2]);
        // Q and K: the first 2D columns, 2 * heads blocks of K.
        for block in row[..2 * d3 / 3].chunks_exact_mut(k) {
            let (a, b) = block.split_at_mut(k / 2);
            for (((a, b), &c), &s) in a.iter_mut().zip(b).zip(cos).zip(sin) {
                let s = sign * s;
                (*a, *b) = (*a * c - *b * s, *a * s + *b * c);
            }
        }
    };
    let run = |out: &mut [f32]| {
        if out.len() < 2 * ROWS * d3 {
            out.chunks_exact_mut(d3)
                .enumerate()
                .for_each(|(r, row)| turn(row, r));
        } else {
            out.par_chunks_mut(ROWS * d3)
                .enumerate()
                .for_each(|(i, rows)| {
                    for (j, row) in rows.chunks_exact_mut(d3).enumerate() {
                        turn(row, i * ROWS + j)
                    }
                });
        }
    };
    let (start, end) = x.layout().contiguous_offsets().expect("contiguous");
    if let Some(storage) = x.try_storage_mut::<f32>() {
        run(&mut storage[start..end]);
        return x;
    }
    let mut out = x.storage::<f32>()[start..end].to_vec();
    run(&mut out);
    from_values(out, shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::agrees_on;
    use burn::tensor::{Device, Distribution};

    /// Output and gradient against `apply_rotary` on flex, flex + autodiff and flex + autodiff +
    /// checkpointing; several shapes, start positions, and sizes above and below the threshold
    /// for rayon.
    #[test]
    fn equals_apply_rotary() {
        for (b, t, heads, k, start) in [
            (2, 9, 3, 4, 0),
            (1, 1, 2, 8, 17),
            (3, 70, 2, 6, 5),
            (2, 64, 4, 32, 0),
        ] {
            let d = heads * k;
            let draw = |dims: [usize; 3]| {
                Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.5), &Device::flex())
                    .into_data()
            };
            let (x, g) = (draw([b, t, 3 * d]), draw([b, t, 3 * d]));
            agrees_on(
                &Device::flex(),
                &x,
                &g,
                |qkv| rotate_qk(qkv, heads, start, 10000.0.into()).expect("a flex tensor"),
                |qkv| crate::rotate_qk_reference(qkv, heads, start, 10000.0),
                2e-6,
                &format!("{b}x{t}, {heads} heads of {k}, from {start}"),
            );
        }
    }

    /// Rotating then rotating back gives the input; values are never touched; a rotation
    /// changes queries and keys.
    #[test]
    fn the_inverse_undoes_it_and_values_pass_through() {
        let x = Tensor::<3>::random([2, 5, 24], Distribution::Normal(0.0, 1.0), &Device::flex());
        let flex = crate::flex::tensor::as_flex(&x).unwrap();
        let rot = Rotation {
            heads: 2,
            start: 3,
            rope: 10000.0.into(),
        };
        let there = rotate(flex.clone(), rot, false);
        let back = rotate(there.clone(), rot, true);
        let (x, there, back) = (
            crate::flex::tensor::values(&contiguous(flex)).to_vec(),
            crate::flex::tensor::values(&there).to_vec(),
            crate::flex::tensor::values(&back).to_vec(),
        );
        for (i, ((a, b), c)) in x.iter().zip(&there).zip(&back).enumerate() {
            assert!((a - c).abs() < 1e-5, "element {i}: {a} -> {b} -> {c}");
            if i % 24 >= 16 {
                assert_eq!(a, b, "value column {i}");
            }
        }
        assert_ne!(x[..16], there[..16], "position 3 is rotated");
    }
}
