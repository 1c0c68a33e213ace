//! Sinusoidal positions (Vaswani et al. 2017): a fixed `sin`/`cos` table added to the
//! embeddings, and the angles that rotary positions share with it.

use burn::tensor::{Device, Tensor};

use crate::ops::rotation::{angles, frequencies};

/// The sinusoidal table of Vaswani et al. for positions `start..start + T`:
/// `PE[pos, 2i] = sin(pos / 10000^(2i/D))`, `PE[pos, 2i+1] = cos(pos / 10000^(2i/D))`.
///
/// # Shapes
/// - output: `[T, D]`
pub fn sinusoidal_table(start: usize, t: usize, d_model: usize, device: &Device) -> Tensor<2> {
    sinusoidal_table_from(start as i64, t, d_model, device)
}

/// [`sinusoidal_table`] from a position that may be negative (the padding before a left-padded
/// sequence, which attention masks out).
pub(crate) fn sinusoidal_table_from(
    start: i64,
    t: usize,
    d_model: usize,
    device: &Device,
) -> Tensor<2> {
    let half = d_model.div_ceil(2);
    let freqs = frequencies(half, 10000.0, d_model as f64);
    let angles = angles(start, t, &freqs, device); // [T, half]
    // Interleave: stack sin and cos on a last axis, then flatten pairs into the width.
    let table = Tensor::stack::<3>(vec![angles.clone().sin(), angles.cos()], 2); // [T, half, 2]
    table.reshape([t, 2 * half]).slice([0..t, 0..d_model])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinusoidal_matches_the_formula() {
        let device = Device::flex();
        let d = 8;
        let table = sinusoidal_table(0, 50, d, &device)
            .try_into_vec_as::<f32>()
            .unwrap();
        for &(pos, i) in &[(0, 0), (1, 0), (1, 1), (7, 2), (13, 3), (49, 1), (49, 3)] {
            let angle = pos as f64 / 10000f64.powf(2.0 * i as f64 / d as f64);
            let sin = table[pos * d + 2 * i] as f64;
            let cos = table[pos * d + 2 * i + 1] as f64;
            assert!((sin - angle.sin()).abs() < 1e-5, "PE[{pos}, {}]", 2 * i);
            assert!((cos - angle.cos()).abs() < 1e-5, "PE[{pos}, {}]", 2 * i + 1);
        }
    }

    #[test]
    fn sinusoidal_offset_equals_slice_of_longer_table() {
        let device = Device::flex();
        let full = sinusoidal_table(0, 10, 6, &device).slice([4..7, 0..6]);
        let part = sinusoidal_table(4, 3, 6, &device);
        let diff = (full - part).abs().max().into_scalar::<f32>();
        assert!(diff < 1e-6);
    }
}
