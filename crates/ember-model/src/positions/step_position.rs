//! The position of a one-token decoding step held on the device, and what each kind of position
//! needs to encode it there.
//!
//! A decoding step captured once as a graph and replayed for every token (CUDA graphs) replays
//! its kernels with the arguments they were recorded with. So the position cannot be a number
//! the host passes: it is a `[1]` tensor the host writes between replays, and everything that
//! depends on it reads it on the device: the KV cache's write and attention, a learned position
//! table's row, and the rows of tables of every position's sinusoidal encoding or rotary
//! `cos`/`sin`, computed once by the same ops that compute them per step (so the values are the
//! same to the bit).

use burn::tensor::{Device, Int, Tensor};

use super::sinusoidal::sinusoidal_table;
use crate::ops::rotation::{Rope, angles};

/// A decoding step's position on the device, with the tables its model's positions read (see
/// the module's documentation). Made by [`crate::DecoderOnly::step_position`]; handed to a
/// cache with [`crate::DecoderCache::read_position_from`].
#[derive(Debug, Clone)]
pub struct StepPosition {
    /// `[1]`: the position of the step's token.
    pub position: Tensor<1, Int>,
    /// Sinusoidal models: the encoding of every position the model takes, `[P, D]`.
    sinusoids: Option<Tensor<2>>,
    /// Rotary models: `cos` and `sin` of every position's angles, `[P, K/2]` each.
    rotary: Option<(Tensor<2>, Tensor<2>)>,
}

impl StepPosition {
    /// `position` alone: enough for learned positions (looked up in their table) and none.
    pub fn new(position: Tensor<1, Int>) -> Self {
        Self {
            position,
            sinusoids: None,
            rotary: None,
        }
    }

    /// With the sinusoidal encodings of positions `0..max_positions` of width `d_model`.
    pub fn with_sinusoids(mut self, max_positions: usize, d_model: usize, device: &Device) -> Self {
        self.sinusoids = Some(sinusoidal_table(0, max_positions, d_model, device));
        self
    }

    /// With the rotary `cos` and `sin` of positions `0..max_positions` for heads of size `head`
    /// (even) and rotation `rope`.
    pub fn with_rotary(
        mut self,
        max_positions: usize,
        head: usize,
        rope: Rope,
        device: &Device,
    ) -> Self {
        let freqs = rope.frequencies(head / 2, head as f64);
        let angles = angles(0, max_positions, &freqs, device);
        self.rotary = Some((angles.clone().cos(), angles.sin()));
        self
    }

    /// The sinusoidal encoding of the step's position, `[1, 1, D]`, if the tables were made.
    pub fn sinusoid(&self) -> Option<Tensor<3>> {
        let table = self.sinusoids.as_ref()?;
        Some(table.clone().select(0, self.position.clone()).unsqueeze())
    }

    /// The rotary `cos` and `sin` of the step's position, `[1, K/2]` each, if the tables were
    /// made.
    pub fn rotary(&self) -> Option<(Tensor<2>, Tensor<2>)> {
        let (cos, sin) = self.rotary.as_ref()?;
        let row = |t: &Tensor<2>| t.clone().select(0, self.position.clone());
        Some((row(cos), row(sin)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table's row at the position the tensor holds is, to the bit, what the per-step
    /// computation gives for that position (sinusoids of width 10 and rotary angles of heads of
    /// 8, at the first, a middle and the last position).
    #[test]
    fn table_rows_equal_the_per_step_encodings() {
        let device = Device::flex();
        for p in [0usize, 17, 39] {
            let step = StepPosition::new(Tensor::from_ints([p as i32], &device))
                .with_sinusoids(40, 10, &device)
                .with_rotary(40, 8, 500.0.into(), &device);
            let row = step.sinusoid().expect("made with sinusoids");
            let want = sinusoidal_table(p, 1, 10, &device).unsqueeze::<3>();
            row.into_data().assert_eq(&want.into_data(), true);
            let (cos, sin) = step.rotary().expect("made with rotary tables");
            let angles = angles(p as i64, 1, &Rope::from(500.0).frequencies(4, 8.0), &device);
            cos.into_data()
                .assert_eq(&angles.clone().cos().into_data(), true);
            sin.into_data().assert_eq(&angles.sin().into_data(), true);
        }
        let plain = StepPosition::new(Tensor::from_ints([3], &device));
        assert!(plain.sinusoid().is_none() && plain.rotary().is_none());
    }
}
