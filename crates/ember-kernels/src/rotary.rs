//! The rotary-positions op on the fused `[Q | K | V]` projection: each head's query and key
//! turned by their positions, values unchanged.
//!
//! Reference: split the heads and [`crate::rotation::apply_rotary`] on each of Q and K (nine
//! tensor ops each). Kernel (flex `f32`, tracked or not): one pass in place of the projection,
//! with the inverse rotation as its backward ([`crate::flex::rotary`]), so that
//! [`crate::causal_self_attention`] takes the result as it takes an unrotated projection.

use burn::tensor::Tensor;

use crate::rotation::{Rope, apply_rotary, apply_rotary_from, rotate_by};

/// `qkv` with every head's query and key rotated as [`apply_rotary`] rotates them (row `p` at
/// position `start + p`, rotation `rope`: a [`Rope`], or the base of the plain one).
///
/// # Shapes
/// - qkv: `[B, T, 3D]`, columns `[Q | K | V]`, head size `D / heads` even
/// - output: `[B, T, 3D]`
pub fn rotate_qk(qkv: Tensor<3>, heads: usize, start: usize, rope: impl Into<Rope>) -> Tensor<3> {
    let rope = rope.into();
    #[cfg(feature = "flex")]
    let qkv = match super::flex::rotary::rotate_qk(qkv, heads, start, rope) {
        Ok(turned) => return turned,
        Err(qkv) => qkv,
    };
    rotate_qk_reference(qkv, heads, start, rope)
}

/// [`rotate_qk`] in Burn's tensor ops, on every backend.
pub fn rotate_qk_reference(
    qkv: Tensor<3>,
    heads: usize,
    start: usize,
    rope: impl Into<Rope>,
) -> Tensor<3> {
    let rope = rope.into();
    turn_qk(qkv, heads, |x| apply_rotary(x, start, rope))
}

/// [`rotate_qk`] with row `b` of the batch at positions `starts[b]..` (a left-padded batch,
/// whose padding has negative positions). Burn's tensor ops only: batched decoding of
/// several prompts is the one user.
///
/// # Shapes
/// - qkv: `[B, T, 3D]` with `B = starts.len()`
/// - output: `[B, T, 3D]`
pub fn rotate_qk_rows(
    qkv: Tensor<3>,
    heads: usize,
    starts: &[i64],
    rope: impl Into<Rope>,
) -> Tensor<3> {
    let rope = rope.into();
    let [b, t, d3] = qkv.dims();
    assert_eq!(b, starts.len(), "one start position per batch row");
    let rows = starts.iter().enumerate().map(|(row, &start)| {
        let one = qkv.clone().slice([row..row + 1, 0..t, 0..d3]);
        turn_qk(one, heads, |x| apply_rotary_from(x, start, rope))
    });
    Tensor::cat(rows.collect(), 0)
}

/// [`rotate_qk`] by the angles' `cos` and `sin` per row (a decoding step replayed at any
/// position reads them from tables of every position: `ember_model::positions::StepPosition`).
/// Burn's tensor ops only.
///
/// # Shapes
/// - qkv: `[B, T, 3D]`
/// - cos, sin: `[T, K/2]` with `K = D / heads`
/// - output: `[B, T, 3D]`
pub fn rotate_qk_by(qkv: Tensor<3>, heads: usize, cos: Tensor<2>, sin: Tensor<2>) -> Tensor<3> {
    turn_qk(qkv, heads, |x| rotate_by(x, cos.clone(), sin.clone()))
}

/// Where the rows of a rotary projection sit: the positions whose angles turn each row's query
/// and key.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one per attention call, passed by value and consumed
pub enum RotaryAt {
    /// Every batch row at positions `start..` ([`rotate_qk`]).
    From(usize),
    /// Row `b` at positions `starts[b]..` (a left-padded batch, [`rotate_qk_rows`]).
    Rows(Vec<i64>),
    /// One position per row whose `cos` and `sin` the device holds (a replayed decoding step,
    /// [`rotate_qk_by`]), `[1, K/2]` each.
    Tables(Tensor<2>, Tensor<2>),
}

/// `qkv` with every head's query and key rotated at the positions `at` names (rotation
/// `rope`): [`rotate_qk`], [`rotate_qk_rows`] or [`rotate_qk_by`] (whose tables were made with
/// the rotation).
///
/// # Shapes
/// - qkv: `[B, T, 3D]`, columns `[Q | K | V]`, head size `D / heads` even
/// - output: `[B, T, 3D]`
pub fn rotate_qk_at(
    qkv: Tensor<3>,
    heads: usize,
    at: RotaryAt,
    rope: impl Into<Rope>,
) -> Tensor<3> {
    match at {
        RotaryAt::From(start) => rotate_qk(qkv, heads, start, rope),
        RotaryAt::Rows(starts) => rotate_qk_rows(qkv, heads, &starts, rope),
        RotaryAt::Tables(cos, sin) => rotate_qk_by(qkv, heads, cos, sin),
    }
}

/// `qkv` with `turn` applied to the heads of its query and key parts, values unchanged.
fn turn_qk(qkv: Tensor<3>, heads: usize, turn: impl Fn(Tensor<4>) -> Tensor<4>) -> Tensor<3> {
    let [b, t, d3] = qkv.dims();
    let d = d3 / 3;
    let part = |i: usize| qkv.clone().slice([0..b, 0..t, i * d..(i + 1) * d]);
    let turned = |x: Tensor<3>| {
        let heads_split = x.reshape([b, t, heads, d / heads]).swap_dims(1, 2); // [B, H, T, K]
        turn(heads_split).swap_dims(1, 2).reshape([b, t, d])
    };
    Tensor::cat(vec![turned(part(0)), turned(part(1)), part(2)], 2)
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use crate::check::agrees_on;
    use burn::tensor::{Device, Distribution};

    /// The op (ember's kernel on flex) against its reference, output and gradient.
    #[test]
    fn equals_its_reference() {
        let draw = |dims: [usize; 3]| {
            Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &Device::flex()).into_data()
        };
        let (x, g) = (draw([2, 5, 3 * 12]), draw([2, 5, 3 * 12]));
        agrees_on(
            &Device::flex(),
            &x,
            &g,
            |qkv| rotate_qk(qkv, 3, 4, 10000.0),
            |qkv| rotate_qk_reference(qkv, 3, 4, 10000.0),
            2e-6,
            "3 heads of 4 from position 4",
        );
        let stretched = crate::rotation::Rope {
            base: 500.0,
            scaling: Some(crate::rotation::RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_positions: 16,
            }),
        };
        agrees_on(
            &Device::flex(),
            &x,
            &g,
            |qkv| rotate_qk(qkv, 3, 4, stretched),
            |qkv| rotate_qk_reference(qkv, 3, 4, stretched),
            2e-6,
            "3 heads of 4 from position 4, frequencies stretched",
        );
    }
}
