//! The log-softmax of rows of logits outside autodiff: what a decoding step ranks (beam
//! search's log-probabilities of every token for every hypothesis).
//!
//! Reference: Burn's `log_softmax`. Kernel (plain flex `f32` tensors): each row's log-sum-exp
//! by [`crate::kernels::cross_entropy::log_sum_exp`] (two reads of the row, vectorised `exp`)
//! and one pass subtracting it, in place where the buffer is the op's alone
//! ([`crate::flex::softmax`]). Burn's flex `log_softmax` passes over the rows several times
//! with a scalar `expf`: about 9% of a beam search's time with a vocabulary of 8000.

use burn::tensor::Tensor;
use burn::tensor::activation::log_softmax as burn_log_softmax;

/// `log(softmax(x))` over the last axis.
///
/// # Shapes
/// - x: `[N, V]`
/// - output: `[N, V]`
pub fn log_softmax(x: Tensor<2>) -> Tensor<2> {
    #[cfg(feature = "flex")]
    let x = match super::flex::softmax::log_softmax(x) {
        Ok(y) => return y,
        Err(x) => x,
    };
    log_softmax_reference(x)
}

/// [`log_softmax`] in Burn's tensor ops, on every backend.
pub fn log_softmax_reference(x: Tensor<2>) -> Tensor<2> {
    burn_log_softmax(x, 1)
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, TensorData};

    /// Against `f64` arithmetic on the host and against the reference, for rows of a decoding
    /// step's size (spread over threads) and small ones, logits far from zero, one column, and
    /// a transposed view; a tensor under autodiff takes the reference.
    #[test]
    fn matches_f64_and_the_reference() {
        let device = Device::flex();
        for (n, v, offset) in [
            (256, 8000, 0.0),
            (3, 5, 0.0),
            (7, 1, 3.0),
            (40, 300, 900.0_f32),
        ] {
            let x = Tensor::<2>::random([n, v], Distribution::Normal(0.0, 4.0), &device)
                .add_scalar(offset);
            let values = x.to_data().try_to_vec::<f32>().unwrap();
            let exact: Vec<f32> = values
                .chunks(v)
                .flat_map(|row| {
                    let max = row.iter().fold(f64::MIN, |m, &x| m.max(f64::from(x)));
                    let sum: f64 = row.iter().map(|&x| (f64::from(x) - max).exp()).sum();
                    let lse = max + sum.ln();
                    row.iter().map(move |&x| (f64::from(x) - lse) as f32)
                })
                .collect();
            let exact = TensorData::new(exact, [n, v]);
            let ours = super::log_softmax(x.clone()).into_data();
            // `x - L` in f32 rounds to the spacing of numbers of `x`'s size (6e-5 near 900).
            let tolerance = burn::tensor::Tolerance::absolute(2e-5 + 1e-7 * offset);
            ours.assert_approx_eq::<f32>(&exact, tolerance);
            let reference = super::log_softmax_reference(x.clone()).into_data();
            ours.assert_approx_eq::<f32>(&reference, burn::tensor::Tolerance::absolute(1e-4));
            // The input is untouched (its buffer is shared with `values`' tensor).
            x.into_data()
                .assert_eq(&TensorData::new(values, [n, v]), true);
        }
        let x = Tensor::<2>::random([30, 20], Distribution::Normal(0.0, 1.0), &device);
        let view = x.clone().swap_dims(0, 1); // [20, 30], not contiguous
        let ours = super::log_softmax(view.clone()).into_data();
        let reference = super::log_softmax_reference(view).into_data();
        ours.assert_approx_eq::<f32>(&reference, burn::tensor::Tolerance::absolute(1e-5));
        let tracked = Tensor::<2>::from_data(x.to_data(), &device.clone().autodiff());
        let ours = super::log_softmax(tracked.clone()).into_data();
        let reference = super::log_softmax_reference(tracked).into_data();
        ours.assert_eq(&reference, true);
    }
}
