//! AdamW's step over `f32` slices (the loop under flex's [`crate::adamw_step`]).

use crate::AdamWStep;

/// Burn's AdamW step element by element, in place: `m1 = b1 m1 + (1 - b1) g`,
/// `m2 = b2 m2 + (1 - b2) g^2`, `p = p (1 - lr wd) - lr (m1 / c1) / (sqrt(m2 / c2) + eps)`.
pub fn adamw_in_place(k: &AdamWStep, p: &mut [f32], g: &[f32], m1: &mut [f32], m2: &mut [f32]) {
    assert!(p.len() == g.len() && m1.len() == g.len() && m2.len() == g.len());
    for (((p, &g), m1), m2) in p.iter_mut().zip(g).zip(m1.iter_mut()).zip(m2.iter_mut()) {
        *m1 = *m1 * k.beta_1 + g * k.factor_1;
        *m2 = *m2 * k.beta_2 + (g * g) * k.factor_2;
        let delta = (*m1 / k.correction_1) / ((*m2 / k.correction_2).sqrt() + k.epsilon);
        let decayed = match k.keep {
            Some(keep) => *p * keep,
            None => *p,
        };
        *p = decayed - delta * k.lr;
    }
}
