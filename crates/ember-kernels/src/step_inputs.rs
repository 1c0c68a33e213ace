//! The inputs a captured decoding step reads from the device: a graph replays its kernels with
//! the arguments they were recorded with, so whatever changes from one token to the next (the
//! position, the sampler's uniform number, the token just chosen) lives in small device buffers
//! that the host writes between replays ([`write_in_place`]) or the step itself writes
//! ([`write_token`]).
//!
//! Reference ([`write_token_reference`]): the position read back to the host and a
//! `slice_assign`. Kernel (GPU backends): one unit writes the token, in place where the buffer
//! is not shared, without a read back (`cube/step_inputs`).

use burn::tensor::{Int, Tensor, TensorData};

/// `history` with `token` written at `position + offset`: the step at position `p` writes the
/// token it chose for position `p + 1` with `offset` 1, and the next replay reads its input
/// token from there.
///
/// # Shapes
/// - history: `[N]`, `position + offset < N`
/// - position: `[1]`
/// - token: `[1, 1]`
/// - output: `[N]`
pub fn write_token(
    history: Tensor<1, Int>,
    position: &Tensor<1, Int>,
    offset: usize,
    token: Tensor<2, Int>,
) -> Tensor<1, Int> {
    #[cfg(feature = "cube")]
    let (history, token) =
        match super::cube::step_inputs::write_token(history, position, offset, token) {
            Ok(history) => return history,
            Err(parts) => parts,
        };
    write_token_reference(history, position, offset, token)
}

/// [`write_token`] in Burn's tensor ops, on every backend (the position read back to the host).
pub fn write_token_reference(
    history: Tensor<1, Int>,
    position: &Tensor<1, Int>,
    offset: usize,
    token: Tensor<2, Int>,
) -> Tensor<1, Int> {
    let at = super::read_position(position) + offset;
    history.slice_assign(burn::tensor::s![at..at + 1], token.reshape([1]))
}

/// Writes `data` into `tensor`'s own memory, where the backend allows it (Burn's CubeCL
/// backends: wgpu, vulkan, cuda): every clone of `tensor` then reads the new values, and so does
/// a captured graph that read it, which is what the write is for. False, with nothing written,
/// where it does not (another backend, a dtype or length other than `data`'s, a view into a
/// larger buffer).
pub fn write_in_place<const D: usize, K: burn::tensor::kind::Basic>(
    tensor: &Tensor<D, K>,
    data: TensorData,
) -> bool {
    #[cfg(feature = "cube")]
    {
        super::cube::step_inputs::write_in_place(tensor, data)
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = (tensor, data);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution};

    fn ints(t: Tensor<1, Int>) -> Vec<i64> {
        t.into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .unwrap()
    }

    /// On flex (no kernel): the token lands at position plus offset, the rest unchanged; the
    /// draw by a number on the device is the draw by the same number given; nothing is written
    /// in place.
    #[test]
    fn the_references_read_the_step_inputs_back_on_flex() {
        let device = Device::flex();
        let history = Tensor::<1, Int>::from_ints([0, 0, 0, 0], &device);
        let position = Tensor::<1, Int>::from_ints([1], &device);
        let token = Tensor::<1, Int>::from_ints([9], &device).reshape([1, 1]);
        let written = write_token(history, &position, 1, token);
        assert_eq!(ints(written), [0, 0, 9, 0]);
        let logits = Tensor::<2>::random([3, 40], Distribution::Normal(0.0, 2.0), &device);
        for u in [0.1f32, 0.5, 0.93] {
            let at = Tensor::<1>::from_floats([u], &device);
            let by_device = super::super::draw_at(logits.clone(), &at, 0.7);
            let by_host = super::super::draw(logits.clone(), u, 0.7);
            by_device.into_data().assert_eq(&by_host.into_data(), true);
        }
        assert!(!write_in_place(&position, TensorData::new(vec![3i32], [1])));
        assert_eq!(ints(position), [1]);
    }
}
