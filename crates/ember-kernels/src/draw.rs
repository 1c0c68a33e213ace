//! Drawing a token from a model's logits: the index that a uniform number picks from
//! `softmax(logits / temperature)`, computed where the logits are. Decoding on a GPU then reads
//! back token ids, never a distribution, and feeds each id to the next step from the device.

use burn::tensor::{Int, Tensor};

/// Temperatures below this count as this (a temperature of zero would divide by zero; the
/// draw is then the argmax, up to ties).
pub const MIN_TEMPERATURE: f32 = 1e-6;

/// The token of `softmax(logits / temperature)` that the uniform number `u` in `[0, 1)` picks:
/// the number of cumulative probabilities at or below `u`, that is the first index whose
/// cumulative probability passes `u`, or the argmax where rounding leaves `u` above them all.
/// This is the token a walk over the probabilities that subtracts each from `u` until `u`
/// falls below one stops at (ember-infer's host sampler), up to rounding: the sums are taken
/// in another order, so a `u` within rounding of a boundary can pick the neighbour. Every row
/// is drawn with the same `u` (decoding draws one sequence at a time).
///
/// On GPU backends, one kernel does the whole draw (`cube::draw`: a cube per row, where
/// [`draw_reference`] launches about a dozen kernels); elsewhere [`draw_reference`].
///
/// # Shapes
/// - logits: `[B, V]`
/// - output: `[B, 1]`
pub fn draw(logits: Tensor<2>, u: f32, temperature: f32) -> Tensor<2, Int> {
    let temperature = temperature.max(MIN_TEMPERATURE);
    #[cfg(feature = "cube")]
    let logits = match super::cube::draw::draw(logits, u, temperature) {
        Ok(index) => return index,
        Err(logits) => logits,
    };
    draw_reference(logits, u, temperature)
}

/// [`draw`] by the uniform number `u` `[1]` holds on the device (written there between replays
/// of a captured decoding step); `u` is not read back to the host on GPU backends.
///
/// # Shapes
/// - logits: `[B, V]`
/// - u: `[1]`
/// - output: `[B, 1]`
pub fn draw_at(logits: Tensor<2>, u: &Tensor<1>, temperature: f32) -> Tensor<2, Int> {
    let temperature = temperature.max(MIN_TEMPERATURE);
    #[cfg(feature = "cube")]
    let logits = match super::cube::draw::draw_at(logits, u, temperature) {
        Ok(index) => return index,
        Err(logits) => logits,
    };
    let u = u.clone().into_scalar::<f32>();
    draw_reference(logits, u, temperature)
}

/// [`draw`] in Burn's tensor ops, on every backend: the shifted exponentials' cumulative sums,
/// how many are at or below `u` times their total, and the argmax where that is every one.
pub fn draw_reference(logits: Tensor<2>, u: f32, temperature: f32) -> Tensor<2, Int> {
    let t = temperature.max(MIN_TEMPERATURE);
    let [b, v] = logits.dims();
    let max = logits.clone().max_dim(1);
    let cumulative = (logits.clone() - max).div_scalar(t).exp().cumsum(1);
    let total = cumulative.clone().slice([0..b, v - 1..v]);
    let below = cumulative.lower_equal(total.mul_scalar(u).expand([b, v]));
    let index = below.int().sum_dim(1);
    let past_all = index.clone().greater_equal_elem(v as i64);
    index.mask_where(past_all, logits.argmax(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution, TensorData};

    /// The reference against a walk in f64: the walk's token wherever `u` is clear of a
    /// boundary, and a token spanning `u` within rounding where it is not; a spread of `u`,
    /// temperatures and vocabularies, on flex (which has no kernel for it).
    #[test]
    fn the_reference_picks_the_walks_token() {
        use crate::check::{spans, walked};
        let device = Device::flex();
        for (v, t) in [(5, 1.0), (65, 0.8), (300, 2.0), (1000, 0.3)] {
            let logits = Tensor::<2>::random([1, v], Distribution::Normal(0.0, 3.0), &device);
            let values = logits.to_data().try_into_vec::<f32>().unwrap();
            let mut compared = 0;
            for k in 0..40 {
                let u = (k as f32 + 0.5) / 40.0;
                let got = draw(logits.clone(), u, t).into_data().convert::<i64>();
                let got = got.try_into_vec::<i64>().unwrap();
                assert!(
                    spans(&values, u, t, got[0] as usize, 1e-5),
                    "V {v}, t {t}, u {u}"
                );
                let (want, margin) = walked(&values, u, t);
                if margin > 1e-5 {
                    assert_eq!(got, [want as i64], "V {v}, t {t}, u {u}");
                    compared += 1;
                }
            }
            assert!(
                compared >= 30,
                "V {v}: {compared} draws clear of a boundary"
            );
        }
    }

    /// `u` so close to one that `u` times the total rounds to the total: every cumulative sum
    /// is at or below it, and the draw is the argmax (the first of tied maxima).
    #[test]
    fn a_u_past_every_sum_takes_the_argmax() {
        let device = Device::flex();
        let logits = Tensor::<2>::from_data(
            TensorData::new(vec![0.0f32, 2.0, 5.0, 5.0, 1.0], [1, 5]),
            &device,
        );
        let got = draw_reference(logits, 1.0, 1.0)
            .into_data()
            .convert::<i64>();
        assert_eq!(got.try_into_vec::<i64>().unwrap(), [2]);
    }
}
