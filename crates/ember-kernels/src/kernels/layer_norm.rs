//! LayerNorm without its bias over rows of `f32` values, forward and backward, one row at a
//! time: `y = (x - mean) * rstd * gamma`, `rstd = 1 / sqrt(var + eps)`, with the biased
//! variance (what PyTorch and Burn compute); or, not `centred`, RMSNorm: the same with the mean
//! taken as 0 (`rstd = 1 / sqrt(mean(x^2) + eps)`). Rows are `gamma.len()` values long; `stats`
//! holds `[mean, rstd]` per row (mean 0 for RMSNorm), written by the forward pass for the
//! backward pass.

use crate::kernels::vector_math::{dot, lanes_sum, multiversion};

multiversion! {
    /// `y <- (x - mean) * rstd * gamma` row by row (mean 0 unless `centred`), and each row's
    /// `[mean, rstd]` into `stats`.
    pub fn forward(
        x: &[f32],
        gamma: &[f32],
        eps: f32,
        centred: bool,
        y: &mut [f32],
        stats: &mut [f32]
    ) {
        let d = gamma.len();
        let rows = x.chunks_exact(d).zip(y.chunks_exact_mut(d));
        for ((xs, ys), stat) in rows.zip(stats.chunks_exact_mut(2)) {
            let mean = if centred { lanes_sum(xs) / d as f32 } else { 0.0 };
            for (yv, &xv) in ys.iter_mut().zip(xs) {
                *yv = xv - mean;
            }
            let rstd = 1.0 / (dot::<F, 16>(ys, ys) / d as f32 + eps).sqrt();
            for (yv, &g) in ys.iter_mut().zip(gamma) {
                *yv *= rstd * g;
            }
            stat.copy_from_slice(&[mean, rstd]);
        }
    }
}

multiversion! {
    /// `g <- dx` from `g = dy` row by row, and adds each row's share of the gamma gradient
    /// (`sum over rows of dy * xhat`) to `dgamma`. With `h = dy * gamma`:
    /// `dx = rstd * (h - mean(h) - xhat * mean(h * xhat))`, without the `mean(h)` term unless
    /// `centred` (the mean a row's values do not move). `scratch` holds two rows.
    pub fn backward(
        x: &[f32],
        gamma: &[f32],
        stats: &[f32],
        centred: bool,
        g: &mut [f32],
        dgamma: &mut [f32],
        scratch: &mut [f32]
    ) {
        let d = gamma.len();
        let (xhat, h) = scratch.split_at_mut(d);
        let rows = x.chunks_exact(d).zip(g.chunks_exact_mut(d));
        for ((xs, gs), stat) in rows.zip(stats.chunks_exact(2)) {
            let (mean, rstd) = (stat[0], stat[1]);
            for (xh, &xv) in xhat.iter_mut().zip(xs) {
                *xh = (xv - mean) * rstd;
            }
            for (((hv, dg), &gv), (&xh, &w)) in
                h.iter_mut().zip(dgamma.iter_mut()).zip(gs.iter()).zip(xhat.iter().zip(gamma))
            {
                *dg += gv * xh;
                *hv = gv * w;
            }
            let a = if centred { lanes_sum(h) / d as f32 } else { 0.0 };
            let b = dot::<F, 16>(h, xhat) / d as f32;
            for ((gv, &hv), &xh) in gs.iter_mut().zip(h.iter()).zip(xhat.iter()) {
                *gv = rstd * (hv - a - xh * b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Forward and backward of one row in f64, straight from the definitions; `dgamma` is the
    /// row's share.
    fn reference(x: &[f32], gamma: &[f32], dy: &[f32], eps: f64, centred: bool) -> [Vec<f64>; 3] {
        let d = x.len() as f64;
        let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let mean = if centred {
            x.iter().sum::<f64>() / d
        } else {
            0.0
        };
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d;
        let rstd = 1.0 / (var + eps).sqrt();
        let xhat: Vec<f64> = x.iter().map(|v| (v - mean) * rstd).collect();
        let y = xhat.iter().zip(gamma).map(|(xh, &w)| xh * w as f64);
        let h: Vec<f64> = dy
            .iter()
            .zip(gamma)
            .map(|(&g, &w)| (g * w) as f64)
            .collect();
        let a = if centred {
            h.iter().sum::<f64>() / d
        } else {
            0.0
        };
        let b = h.iter().zip(&xhat).map(|(h, xh)| h * xh).sum::<f64>() / d;
        let dx = h.iter().zip(&xhat).map(|(h, xh)| rstd * (h - a - xh * b));
        let dgamma = dy.iter().zip(&xhat).map(|(&g, xh)| g as f64 * xh);
        [y.collect(), dx.collect(), dgamma.collect()]
    }

    fn value(i: usize, salt: usize) -> f32 {
        (((i * 7919 + salt * 104_729) % 1000) as f32 / 250.0 - 2.0) * (1.0 + salt as f32)
    }

    /// LayerNorm and RMSNorm (not centred). RMSNorm's `dx` is checked against the chain rule
    /// written out: `y = x r gamma`, `dr/dx_i = -r^3 x_i / d`, so `dx_i = r h_i - r^3 x_i
    /// sum_j(h_j x_j) / d` is `r (h_i - xhat_i mean(h xhat))`, the reference without its mean.
    #[test]
    fn forward_and_backward_match_f64_references() {
        for centred in [true, false] {
            match_references(centred);
        }
    }

    fn match_references(centred: bool) {
        // Widths that fill the 16 lanes exactly, leave a tail, and fit in fewer than 16.
        for d in [1, 7, 16, 37, 128] {
            let rows = 3;
            let x: Vec<f32> = (0..rows * d).map(|i| value(i, 1)).collect();
            let gamma: Vec<f32> = (0..d).map(|i| value(i, 2) / 3.0).collect();
            let dy: Vec<f32> = (0..rows * d).map(|i| value(i, 3)).collect();
            let (mut y, mut stats) = (vec![0.0; rows * d], vec![0.0; 2 * rows]);
            forward(&x, &gamma, 1e-5, centred, &mut y, &mut stats);
            let (mut g, mut dgamma, mut scratch) = (dy.clone(), vec![0.0; d], vec![0.0; 2 * d]);
            backward(
                &x,
                &gamma,
                &stats,
                centred,
                &mut g,
                &mut dgamma,
                &mut scratch,
            );
            let mut want_dgamma = vec![0.0; d];
            for r in 0..rows {
                let row = r * d..(r + 1) * d;
                let (xr, dyr) = (&x[row.clone()], &dy[row.clone()]);
                let [ry, rdx, rdg] = reference(xr, &gamma, dyr, 1e-5, centred);
                for j in 0..d {
                    let at = r * d + j;
                    assert!(
                        (y[at] as f64 - ry[j]).abs() < 1e-5,
                        "y, d {d}, row {r}, {j}, centred {centred}"
                    );
                    assert!(
                        (g[at] as f64 - rdx[j]).abs() < 1e-4,
                        "dx, d {d}, row {r}, {j}"
                    );
                    want_dgamma[j] += rdg[j];
                }
            }
            for j in 0..d {
                let err = (dgamma[j] as f64 - want_dgamma[j]).abs();
                assert!(err < 1e-4, "dgamma, d {d}, column {j}: off by {err}");
            }
        }
    }
}
