//! Picking the next token from logits: greedy, or sampling with temperature, top-k and top-p.

use rand::Rng;
use rand::rngs::StdRng;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Always take the most likely token.
    pub greedy: bool,
    /// Divide logits by this before the softmax; lower is more conservative. 0 means greedy.
    pub temperature: f32,
    /// Sample only among the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probabilities sum to `p` (nucleus).
    pub top_p: Option<f32>,
    /// Hugging Face's repetition penalty: the logit of every token already in the text (prompt
    /// included) is divided by this when positive and multiplied when negative, before
    /// anything else. 1 turns it off; above 1 discourages repeats.
    pub repetition_penalty: f32,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            greedy: false,
            temperature: 1.0,
            top_k: None,
            top_p: None,
            repetition_penalty: 1.0,
        }
    }
}

/// Applies the repetition penalty `penalty` to `logits` `[V]` for each distinct id in `seen`
/// (as Hugging Face's `RepetitionPenaltyLogitsProcessor`: a repeated token is penalised once).
pub fn penalize_repeats(logits: &mut [f32], seen: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let mut done = vec![false; logits.len()];
    for &id in seen {
        let i = id as usize;
        if i < logits.len() && !done[i] {
            done[i] = true;
            let l = &mut logits[i];
            *l = if *l < 0.0 { *l * penalty } else { *l / penalty };
        }
    }
}

/// Index of the largest value (the first one on ties).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// The probabilities sampling draws from: temperature, then top-k, then top-p, renormalised.
/// Tokens filtered out get probability 0.
pub fn distribution(logits: &[f32], s: &Sampling) -> Vec<f32> {
    // The same floor as the device's draw, so both paths pick alike at a temperature of 0.
    let t = s.temperature.max(ember_kernels::MIN_TEMPERATURE);
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<f32> = logits.iter().map(|&l| ((l - max) / t).exp()).collect();
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let mut keep = probs.len();
    if let Some(k) = s.top_k {
        keep = keep.min(k.max(1));
    }
    if let Some(p) = s.top_p {
        let total: f32 = probs.iter().sum();
        let mut cumulative = 0.0;
        for (rank, &i) in order.iter().enumerate().take(keep) {
            cumulative += probs[i] / total;
            if cumulative >= p {
                keep = rank + 1;
                break;
            }
        }
    }
    for &i in &order[keep..] {
        probs[i] = 0.0;
    }
    let total: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    probs
}

/// Chooses the next token id from `logits` `[V]`.
pub fn sample(logits: &[f32], s: &Sampling, rng: &mut StdRng) -> u32 {
    if s.greedy || s.temperature <= 0.0 {
        return argmax(logits);
    }
    let probs = distribution(logits, s);
    let mut u: f32 = rng.random();
    for (i, &p) in probs.iter().enumerate() {
        if u < p {
            return i as u32;
        }
        u -= p;
    }
    // Rounding left a sliver: take the most likely token.
    argmax(&probs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits_once() {
        let mut logits = [2.0, -1.0, 0.5, 3.0];
        penalize_repeats(&mut logits, &[0, 1, 0, 7], 2.0);
        assert_eq!(logits, [1.0, -2.0, 0.5, 3.0]);
        let mut same = [2.0, -1.0];
        penalize_repeats(&mut same, &[0, 1], 1.0);
        assert_eq!(same, [2.0, -1.0]);
    }

    #[test]
    fn top_k_and_top_p_keep_the_right_tokens() {
        let logits = [2.0f32.ln(), 4.0f32.ln(), 1.0f32.ln(), 3.0f32.ln()]; // probs 0.2 0.4 0.1 0.3
        let all = distribution(&logits, &Sampling::default());
        for (got, want) in all.iter().zip([0.2, 0.4, 0.1, 0.3]) {
            assert!((got - want).abs() < 1e-6);
        }
        let k2 = distribution(
            &logits,
            &Sampling {
                top_k: Some(2),
                ..Default::default()
            },
        );
        assert_eq!(k2[0], 0.0);
        assert!((k2[1] - 4.0 / 7.0).abs() < 1e-6 && (k2[3] - 3.0 / 7.0).abs() < 1e-6);
        // 0.4 + 0.3 = 0.7 >= 0.65: the nucleus is tokens 1 and 3.
        let p = distribution(
            &logits,
            &Sampling {
                top_p: Some(0.65),
                ..Default::default()
            },
        );
        assert_eq!((p[0], p[2]), (0.0, 0.0));
        assert!((p[1] - 4.0 / 7.0).abs() < 1e-6);
        // Temperature 0.5 squares the odds: 4:16:1:9.
        let t = distribution(
            &logits,
            &Sampling {
                temperature: 0.5,
                ..Default::default()
            },
        );
        assert!((t[1] - 16.0 / 30.0).abs() < 1e-5);
    }

    #[test]
    fn sampling_follows_the_distribution_and_greedy_takes_the_max() {
        let logits = [0.0f32, 1.0, 0.5];
        assert_eq!(
            sample(
                &logits,
                &Sampling {
                    greedy: true,
                    ..Default::default()
                },
                &mut StdRng::seed_from_u64(0)
            ),
            1
        );
        let mut rng = StdRng::seed_from_u64(1);
        let s = Sampling::default();
        let want = distribution(&logits, &s);
        let mut counts = [0usize; 3];
        for _ in 0..20_000 {
            counts[sample(&logits, &s, &mut rng) as usize] += 1;
        }
        for i in 0..3 {
            let freq = counts[i] as f32 / 20_000.0;
            assert!(
                (freq - want[i]).abs() < 0.015,
                "token {i}: {freq} vs {}",
                want[i]
            );
        }
    }
}
