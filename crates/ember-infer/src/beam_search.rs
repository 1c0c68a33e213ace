//! Greedy decoding and beam search for sequence-to-sequence models, written against a small
//! step interface so the search can be tested on hand-built distributions.

/// One decoding step over `N` rows (hypotheses).
pub trait StepScorer {
    /// Log-probabilities `[N][V]` of the next token, given each row's last token.
    fn step(&mut self, last: &[u32]) -> Vec<Vec<f32>>;
    /// Keeps rows `rows` (in that order, repeats allowed) for the next step.
    fn reorder(&mut self, rows: &[usize]);
}

/// Settings of a search.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SearchOptions {
    /// Hypotheses kept at each step; 1 is greedy.
    pub beam: usize,
    /// GNMT length penalty exponent `a`: scores are divided by `((5 + len) / 6)^a`.
    pub length_penalty: f32,
    /// Most tokens to produce (the end token included).
    pub max_len: usize,
    /// The decoder's first input.
    pub bos: u32,
    /// The token that ends a hypothesis.
    pub eos: u32,
}

/// A finished hypothesis.
#[derive(Debug, Clone, PartialEq)]
pub struct Hypothesis {
    /// Tokens, without BOS and EOS.
    pub tokens: Vec<u32>,
    /// Sum of log-probabilities (EOS included when it was produced).
    pub log_prob: f32,
    /// `log_prob` divided by the length penalty: what the search ranks by.
    pub score: f32,
}

fn penalty(len: usize, alpha: f32) -> f32 {
    ((5.0 + len as f32) / 6.0).powf(alpha)
}

/// Greedy decoding of `n` rows at once (one sentence per row): each row takes its most likely
/// token until it produces EOS or `max_len` tokens.
pub fn greedy(scorer: &mut impl StepScorer, n: usize, options: &SearchOptions) -> Vec<Hypothesis> {
    let mut out: Vec<Hypothesis> = (0..n)
        .map(|_| Hypothesis {
            tokens: Vec::new(),
            log_prob: 0.0,
            score: 0.0,
        })
        .collect();
    let mut done = vec![false; n];
    let mut last = vec![options.bos; n];
    for _ in 0..options.max_len {
        let log_probs = scorer.step(&last);
        for (i, row) in log_probs.iter().enumerate() {
            if done[i] {
                last[i] = options.eos;
                continue;
            }
            let next = crate::sampling::argmax(row);
            out[i].log_prob += row[next as usize];
            if next == options.eos {
                done[i] = true;
            } else {
                out[i].tokens.push(next);
            }
            last[i] = next;
        }
        if done.iter().all(|&d| d) {
            break;
        }
    }
    for h in &mut out {
        h.score = h.log_prob / penalty(h.tokens.len() + 1, options.length_penalty);
    }
    out
}

/// Beam search for one sentence. The scorer starts with `beam` identical rows; only the first
/// is live at the start. At each step the best `2 * beam` continuations are ranked; an end
/// token among the best `beam` finishes its hypothesis, the other continuations refill the
/// beam. Stops when `beam` hypotheses have finished or at `max_len`; returns the best by
/// length-penalised score.
pub fn beam_search(scorer: &mut impl StepScorer, options: &SearchOptions) -> Hypothesis {
    let k = options.beam.max(1);
    // (tokens, log_prob) of the live rows; row i of the scorer holds hypothesis i.
    let mut live: Vec<(Vec<u32>, f32)> = (0..k)
        .map(|i| (Vec::new(), if i == 0 { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mut finished: Vec<Hypothesis> = Vec::new();
    for _ in 0..options.max_len {
        let last: Vec<u32> = live
            .iter()
            .map(|(t, _)| t.last().copied().unwrap_or(options.bos))
            .collect();
        let log_probs = scorer.step(&last);
        // Best 2k continuations over all rows: enough to refill k live rows even if k end.
        let mut candidates: Vec<(f32, usize, u32)> = Vec::new();
        for (row, lp) in log_probs.iter().enumerate() {
            if live[row].1 == f32::NEG_INFINITY {
                continue;
            }
            let mut best: Vec<(f32, u32)> =
                lp.iter().enumerate().map(|(v, &p)| (p, v as u32)).collect();
            let take = (2 * k).min(best.len());
            best.select_nth_unstable_by(take - 1, |a, b| b.0.total_cmp(&a.0));
            for &(p, v) in &best[..take] {
                candidates.push((live[row].1 + p, row, v));
            }
        }
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0));
        let mut next_live: Vec<(Vec<u32>, f32)> = Vec::new();
        let mut rows = Vec::new();
        for (rank, (log_prob, row, token)) in candidates.into_iter().enumerate() {
            if token == options.eos {
                // Only an end that ranks among the best k ends a hypothesis (as in fairseq and
                // Hugging Face); otherwise unlikely early ends would fill the finished list.
                if rank >= k {
                    continue;
                }
                let tokens = live[row].0.clone();
                let score = log_prob / penalty(tokens.len() + 1, options.length_penalty);
                finished.push(Hypothesis {
                    tokens,
                    log_prob,
                    score,
                });
            } else if next_live.len() < k {
                let mut tokens = live[row].0.clone();
                tokens.push(token);
                next_live.push((tokens, log_prob));
                rows.push(row);
            }
            if next_live.len() == k && finished.len() >= k {
                break;
            }
        }
        if finished.len() >= k || next_live.is_empty() {
            break;
        }
        while next_live.len() < k {
            // Fewer continuations than rows (tiny vocabularies): pad with dead rows.
            next_live.push((Vec::new(), f32::NEG_INFINITY));
            rows.push(rows[0]);
        }
        scorer.reorder(&rows);
        live = next_live;
    }
    if finished.is_empty() {
        // Nothing ended within max_len: rank the live hypotheses.
        finished = live
            .into_iter()
            .filter(|(_, lp)| lp.is_finite())
            .map(|(tokens, log_prob)| {
                let score = log_prob / penalty(tokens.len(), options.length_penalty);
                Hypothesis {
                    tokens,
                    log_prob,
                    score,
                }
            })
            .collect();
    }
    finished
        .into_iter()
        .max_by(|a, b| a.score.total_cmp(&b.score))
        .expect("at least one hypothesis")
}

#[cfg(test)]
mod tests {
    use super::*;

    const EOS: u32 = 0;
    const BOS: u32 = 9;

    /// Next-token distributions given the tokens so far (without BOS), as probabilities.
    struct Table {
        rows: Vec<Vec<u32>>,
        dist: fn(&[u32]) -> Vec<f32>,
    }

    impl StepScorer for Table {
        fn step(&mut self, last: &[u32]) -> Vec<Vec<f32>> {
            for (row, &t) in self.rows.iter_mut().zip(last) {
                if t != BOS {
                    row.push(t);
                }
            }
            self.rows
                .iter()
                .map(|r| (self.dist)(r).iter().map(|p| p.ln()).collect())
                .collect()
        }
        fn reorder(&mut self, rows: &[usize]) {
            self.rows = rows.iter().map(|&i| self.rows[i].clone()).collect();
        }
    }

    /// Greedy takes token 1 (0.5) but then faces a flat distribution; token 2 (0.4) leads to a
    /// certain end: best sequence is [2] with p = 0.4 * 0.9, greedy's is [1, x] <= 0.5 * 0.34.
    fn trap(prefix: &[u32]) -> Vec<f32> {
        match prefix {
            [] => vec![0.1, 0.5, 0.4],
            [1] => vec![0.34, 0.33, 0.33],
            [2] => vec![0.9, 0.05, 0.05],
            _ => vec![0.98, 0.01, 0.01],
        }
    }

    fn options(beam: usize) -> SearchOptions {
        SearchOptions {
            beam,
            length_penalty: 0.0,
            max_len: 10,
            bos: BOS,
            eos: EOS,
        }
    }

    fn table(n: usize) -> Table {
        Table {
            rows: vec![Vec::new(); n],
            dist: trap,
        }
    }

    #[test]
    fn beam_finds_a_better_sequence_than_greedy() {
        let g = greedy(&mut table(1), 1, &options(1)).remove(0);
        let b = beam_search(&mut table(3), &options(3));
        assert_eq!(g.tokens, vec![1]);
        assert_eq!(b.tokens, vec![2]);
        assert!(b.log_prob > g.log_prob, "{} vs {}", b.log_prob, g.log_prob);
        assert!((b.log_prob - (0.4f32 * 0.9).ln()).abs() < 1e-5);
    }

    #[test]
    fn beam_of_one_is_greedy() {
        let g = greedy(&mut table(1), 1, &options(1)).remove(0);
        let b = beam_search(&mut table(1), &options(1));
        assert_eq!(g.tokens, b.tokens);
        assert!((g.log_prob - b.log_prob).abs() < 1e-6);
    }
}
