//! Cross-entropy over `f32` rows of logits, forward and backward, with label smoothing: each
//! row's log-sum-exp `L` in two reads of the row (its maximum, then the sum of `exp(x - max)`),
//! and the gradient `softmax - q` written in one pass from the row and `L`.
//!
//! With smoothing `e` over a vocabulary of `V`, the target distribution is
//! `q = (1 - e) onehot(t) + e / V`, so a row's loss is
//! `-sum_j q_j log p_j = (1 - e) (L - x_t) + e (L - mean(x))`.

use crate::kernels::vector_math::{exp, lanes_max, lanes_sum, multiversion};

multiversion! {
    /// The log-sum-exp of `row` (not empty).
    pub fn log_sum_exp(row: &[f32]) -> f32 {
        let max = lanes_max(row);
        let mut acc = [0.0f32; 16];
        let split = row.len() / 16 * 16;
        for chunk in row[..split].chunks_exact(16) {
            for i in 0..16 {
                acc[i] += exp::<F>(chunk[i] - max);
            }
        }
        let mut width = 8;
        while width > 0 {
            for i in 0..width {
                acc[i] += acc[i + width];
            }
            width /= 2;
        }
        let tail: f32 = row[split..].iter().map(|&x| exp::<F>(x - max)).sum();
        max + (acc[0] + tail).ln()
    }
}

/// The loss of one row whose log-sum-exp is `lse`, against target `t`, with smoothing `e`.
pub fn row_loss(row: &[f32], lse: f32, t: usize, smoothing: f32) -> f32 {
    let nll = lse - row[t];
    match smoothing > 0.0 {
        true => {
            let mean = lanes_sum(row) / row.len() as f32;
            (1.0 - smoothing) * nll + smoothing * (lse - mean)
        }
        false => nll,
    }
}

multiversion! {
    /// `out[j] = scale (exp(row[j] - lse) - q_j)`: the gradient of `scale` times the row's
    /// loss, `q` the target distribution of target `t` with smoothing `e`.
    pub fn row_gradient(
        row: &[f32],
        lse: f32,
        t: usize,
        smoothing: f32,
        scale: f32,
        out: &mut [f32]
    ) {
        let uniform = smoothing / row.len() as f32;
        for (o, &x) in out.iter_mut().zip(row) {
            *o = scale * (exp::<F>(x - lse) - uniform);
        }
        out[t] -= scale * (1.0 - smoothing);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Log-sum-exp, loss and gradient of a row against the definitions in f64, with and without
    /// smoothing, for lengths with and without a tail past the 16 lanes; a row of large values
    /// does not overflow.
    #[test]
    fn rows_equal_the_definitions() {
        for v in [1usize, 7, 16, 65, 8000] {
            let row: Vec<f32> = (0..v)
                .map(|i| ((i * 2_654_435_761usize) % 1009) as f32 / 100.0 - 5.0)
                .collect();
            let wide: Vec<f64> = row.iter().map(|&x| x as f64).collect();
            let max = wide.iter().copied().fold(f64::MIN, f64::max);
            let lse = max + wide.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
            let ours = log_sum_exp(&row);
            assert!(
                (ours as f64 - lse).abs() < 1e-5 * lse.abs().max(1.0),
                "{v}: {ours} {lse}"
            );
            let t = v / 3;
            for e in [0.0f32, 0.1] {
                let q = |j: usize| e as f64 / v as f64 + if j == t { 1.0 - e as f64 } else { 0.0 };
                let loss: f64 = (0..v).map(|j| -q(j) * (wide[j] - lse)).sum();
                let got = row_loss(&row, ours, t, e);
                assert!((got as f64 - loss).abs() < 1e-4, "{v}, {e}: {got} {loss}");
                let mut out = vec![f32::NAN; v];
                row_gradient(&row, ours, t, e, 0.5, &mut out);
                for (j, &o) in out.iter().enumerate() {
                    let want = 0.5 * ((wide[j] - lse).exp() - q(j));
                    assert!((o as f64 - want).abs() < 1e-6, "{v}, {e}, {j}: {o} {want}");
                }
            }
        }
        let large = [1000.0f32, 999.0, 998.0];
        let lse = log_sum_exp(&large);
        assert!((lse - (1000.0 + (1.0 + (-1f32).exp() + (-2f32).exp()).ln())).abs() < 1e-3);
    }
}
