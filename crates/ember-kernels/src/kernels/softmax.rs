//! The causal attention softmax over `f32` rows, forward and backward, in one pass each.
//!
//! Scores are `[rows, S]` with `rows = B * H * T`; query `i = row % T` may see keys
//! `0..=offset + i`, `offset = S - T` (the cached positions). The forward writes
//! `softmax(scale * x)` over the visible keys and 0 over the rest: what masking the scores with
//! a large negative value and taking an ordinary softmax gives, without the masked `exp`s.

use crate::kernels::vector_math::{dot, exp, lanes_max, lanes_sum, madd, multiversion};

/// Keys visible to row `row`: `offset + row % t + 1` (at most `s`, as `t <= s`).
#[inline(always)]
fn visible(row: usize, t: usize, s: usize) -> usize {
    s - t + row % t + 1
}

multiversion! {
    /// `x <- causal_softmax(scale * x)` row by row; `x` holds whole rows of `s` values, `t` is
    /// the number of query positions (`t <= s`) and `scale > 0`.
    pub fn causal_softmax_in_place(x: &mut [f32], t: usize, s: usize, scale: f32) {
        for (row, values) in x.chunks_exact_mut(s).enumerate() {
            let (seen, hidden) = values.split_at_mut(visible(row, t, s));
            let max = lanes_max(seen) * scale;
            for v in seen.iter_mut() {
                *v = exp::<F>(madd::<F>(*v, scale, -max));
            }
            let inv = 1.0 / lanes_sum(seen);
            seen.iter_mut().for_each(|v| *v *= inv);
            hidden.fill(0.0);
        }
    }
}

multiversion! {
    /// `g <- scale * y * (g - sum(g * y))` row by row: the gradient of the scores from the
    /// gradient `g` of the weights `y` (the forward's output). Hidden keys have `y = 0`, so
    /// their gradient is 0.
    pub fn causal_softmax_backward_in_place(y: &[f32], g: &mut [f32], s: usize, scale: f32) {
        for (ys, gs) in y.chunks_exact(s).zip(g.chunks_exact_mut(s)) {
            let dot = dot::<F, 16>(ys, gs);
            for (gv, &yv) in gs.iter_mut().zip(ys) {
                *gv = scale * yv * (*gv - dot);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(i: usize) -> f32 {
        ((i.wrapping_mul(2_654_435_761) % 10_007) as f32 / 10_007.0 - 0.5) * 8.0
    }

    /// Causal softmax of `scale * x` for one row seeing `seen` keys, in f64.
    fn reference(x: &[f32], seen: usize, scale: f64) -> Vec<f64> {
        let max = x[..seen]
            .iter()
            .map(|&v| v as f64 * scale)
            .fold(f64::MIN, f64::max);
        let e: Vec<f64> = x[..seen]
            .iter()
            .map(|&v| (v as f64 * scale - max).exp())
            .collect();
        let total: f64 = e.iter().sum();
        (0..x.len())
            .map(|j| if j < seen { e[j] / total } else { 0.0 })
            .collect()
    }

    #[test]
    fn forward_and_backward_match_f64_references() {
        // Two batch-heads of t = 5 queries over s = 37 keys (32 cached), and t = s = 20.
        for (rows, t, s) in [(10, 5, 37), (40, 20, 20)] {
            let scale = 0.3;
            let x: Vec<f32> = (0..rows * s).map(value).collect();
            let g: Vec<f32> = (0..rows * s).map(|i| value(i + 7)).collect();
            let mut y = x.clone();
            causal_softmax_in_place(&mut y, t, s, scale);
            let mut gx = g.clone();
            causal_softmax_backward_in_place(&y, &mut gx, s, scale);
            for row in 0..rows {
                let seen = s - t + row % t + 1;
                let at = row * s;
                let want = reference(&x[at..at + s], seen, scale as f64);
                let dot: f64 = (0..s).map(|j| want[j] * g[at + j] as f64).sum();
                for j in 0..s {
                    assert!(
                        (y[at + j] as f64 - want[j]).abs() < 1e-6,
                        "row {row} key {j}"
                    );
                    let want_g = scale as f64 * want[j] * (g[at + j] as f64 - dot);
                    assert!(
                        (gx[at + j] as f64 - want_g).abs() < 1e-5,
                        "grad row {row} key {j}"
                    );
                    if j >= seen {
                        assert_eq!(y[at + j], 0.0);
                        assert_eq!(gx[at + j], 0.0);
                    }
                }
            }
        }
    }
}
