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

/// Beam search for one sentence: [`beam_search_batch`] of one. The scorer starts with `beam`
/// identical rows.
pub fn beam_search(scorer: &mut impl StepScorer, options: &SearchOptions) -> Hypothesis {
    beam_search_batch(scorer, 1, options).remove(0)
}

/// Beam search for `n` sentences at once, each as [`beam_search`] would search it alone: every
/// step scores the rows of all the sentences still searching in one call. The scorer starts with
/// `n * beam` rows, sentence `i`'s at `i * beam..(i + 1) * beam` (identical: only the first of
/// them is live at the start). At each step a sentence ranks the best `2 * beam` continuations
/// of its rows; an end token among the best `beam` finishes its hypothesis, the other
/// continuations refill its beam. A sentence stops when `beam` hypotheses have finished or at
/// `max_len`, and gives the best by length-penalised score.
///
/// A sentence that has stopped leaves its rows in the scorer (stepped, never read) until half
/// the rows are such; then the searching sentences' rows are gathered. So the scorer steps on
/// few distinct row counts (GPU backends compile and tune kernels for each new shape), and on
/// no more than twice the rows still needed.
pub fn beam_search_batch(
    scorer: &mut impl StepScorer,
    n: usize,
    options: &SearchOptions,
) -> Vec<Hypothesis> {
    if n == 0 {
        return Vec::new();
    }
    let k = options.beam.max(1);
    let mut beams: Vec<Beam> = (0..n).map(|_| Beam::new(k)).collect();
    // Slot `s` is the scorer's rows `s * k..(s + 1) * k`: the sentence searching there, `None`
    // once it has stopped.
    let mut slots: Vec<Option<usize>> = (0..n).map(Some).collect();
    for _ in 0..options.max_len {
        let last: Vec<u32> = slots
            .iter()
            .flat_map(|slot| match slot {
                Some(i) => beams[*i].last_tokens(options.bos),
                None => vec![options.eos; k],
            })
            .collect();
        let log_probs = scorer.step(&last);
        let mut rows = Vec::with_capacity(slots.len() * k);
        for (s, slot) in slots.iter_mut().enumerate() {
            let base = s * k;
            let kept = slot.and_then(|i| beams[i].advance(&log_probs[base..base + k], options));
            match kept {
                Some(local) => rows.extend(local.into_iter().map(|r| base + r)),
                None => {
                    *slot = None;
                    rows.extend(base..base + k);
                }
            }
        }
        let searching = slots.iter().flatten().count();
        if searching == 0 {
            break;
        }
        if 2 * searching <= slots.len() {
            rows = (0..slots.len())
                .filter(|&s| slots[s].is_some())
                .flat_map(|s| rows[s * k..(s + 1) * k].to_vec())
                .collect();
            slots.retain(Option::is_some);
        }
        scorer.reorder(&rows);
    }
    beams.into_iter().map(|b| b.best(options)).collect()
}

/// The `m` largest values of `row` with their indices, largest first (equal values: the lower
/// index first), in one pass that compares most values with the smallest kept alone.
fn largest(row: &[f32], m: usize) -> Vec<(f32, u32)> {
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(m + 1);
    for (i, &p) in row.iter().enumerate() {
        if best.len() == m && best.last().is_none_or(|last| p.total_cmp(&last.0).is_le()) {
            continue;
        }
        let at = best.partition_point(|(q, _)| q.total_cmp(&p).is_ge());
        best.insert(at, (p, i as u32));
        best.truncate(m);
    }
    best
}

/// One sentence's search: its live hypotheses (`(tokens, log_prob)`, row `i` of its rows in the
/// scorer holds hypothesis `i`; a dead row's log-probability is minus infinity) and those
/// finished.
struct Beam {
    live: Vec<(Vec<u32>, f32)>,
    finished: Vec<Hypothesis>,
}

impl Beam {
    /// `k` rows, only the first live.
    fn new(k: usize) -> Self {
        let live = (0..k)
            .map(|i| (Vec::new(), if i == 0 { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        Self {
            live,
            finished: Vec::new(),
        }
    }

    /// Each row's last token (`bos` before the first).
    fn last_tokens(&self, bos: u32) -> Vec<u32> {
        let last = |(tokens, _): &(Vec<u32>, f32)| tokens.last().copied().unwrap_or(bos);
        self.live.iter().map(last).collect()
    }

    /// One step from the log-probabilities `[k][V]` of its rows: the rows (of its `k`) the new
    /// live hypotheses extend, in order, or `None` once the search has stopped.
    fn advance(&mut self, log_probs: &[Vec<f32>], options: &SearchOptions) -> Option<Vec<usize>> {
        let k = self.live.len();
        // Best 2k continuations over all rows: enough to refill k live rows even if k end.
        let mut candidates: Vec<(f32, usize, u32)> = Vec::new();
        for (row, lp) in log_probs.iter().enumerate() {
            if self.live[row].1 == f32::NEG_INFINITY {
                continue;
            }
            for (p, v) in largest(lp, 2 * k) {
                candidates.push((self.live[row].1 + p, row, v));
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
                let tokens = self.live[row].0.clone();
                let score = log_prob / penalty(tokens.len() + 1, options.length_penalty);
                self.finished.push(Hypothesis {
                    tokens,
                    log_prob,
                    score,
                });
            } else if next_live.len() < k {
                let mut tokens = self.live[row].0.clone();
                tokens.push(token);
                next_live.push((tokens, log_prob));
                rows.push(row);
            }
            if next_live.len() == k && self.finished.len() >= k {
                break;
            }
        }
        if self.finished.len() >= k || next_live.is_empty() {
            return None;
        }
        while next_live.len() < k {
            // Fewer continuations than rows (tiny vocabularies): pad with dead rows.
            next_live.push((Vec::new(), f32::NEG_INFINITY));
            rows.push(rows[0]);
        }
        self.live = next_live;
        Some(rows)
    }

    /// The best finished hypothesis by score; the best live ones where none finished within
    /// `max_len`.
    fn best(self, options: &SearchOptions) -> Hypothesis {
        let mut finished = self.finished;
        if finished.is_empty() {
            finished = self
                .live
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
}

#[cfg(test)]
mod tests {
    use super::*;

    const EOS: u32 = 0;
    const BOS: u32 = 9;

    /// Next-token distributions given a row's sentence and its tokens so far (without BOS), as
    /// probabilities; the number of rows of each step.
    struct Table {
        rows: Vec<(usize, Vec<u32>)>,
        dist: fn(usize, &[u32]) -> Vec<f32>,
        steps: Vec<usize>,
    }

    impl StepScorer for Table {
        fn step(&mut self, last: &[u32]) -> Vec<Vec<f32>> {
            assert_eq!(last.len(), self.rows.len(), "a token for each row");
            self.steps.push(last.len());
            for ((_, row), &t) in self.rows.iter_mut().zip(last) {
                if t != BOS {
                    row.push(t);
                }
            }
            self.rows
                .iter()
                .map(|(s, r)| (self.dist)(*s, r).iter().map(|p| p.ln()).collect())
                .collect()
        }
        fn reorder(&mut self, rows: &[usize]) {
            self.rows = rows.iter().map(|&i| self.rows[i].clone()).collect();
        }
    }

    /// Greedy takes token 1 (0.5) but then faces a flat distribution; token 2 (0.4) leads to a
    /// certain end: best sequence is [2] with p = 0.4 * 0.9, greedy's is [1, x] <= 0.5 * 0.34.
    fn trap(_: usize, prefix: &[u32]) -> Vec<f32> {
        match prefix {
            [] => vec![0.1, 0.5, 0.4],
            [1] => vec![0.34, 0.33, 0.33],
            [2] => vec![0.9, 0.05, 0.05],
            _ => vec![0.98, 0.01, 0.01],
        }
    }

    /// Six tokens whose weights are a hash of the sentence and the prefix; the end grows more
    /// likely with length, at a pace that differs between sentences.
    fn varied(sentence: usize, prefix: &[u32]) -> Vec<f32> {
        let mut h = (sentence as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for &t in prefix {
            h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01B3) ^ (h >> 29);
        }
        let mut w: Vec<f32> = (0..6)
            .map(|v| 1.0 + ((h >> (8 * v)) & 0xFF) as f32)
            .collect();
        w[EOS as usize] *= prefix.len() as f32 * (1 + sentence % 3) as f32 * 0.25;
        let total: f32 = w.iter().sum();
        w.iter().map(|x| x / total).collect()
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

    /// `n` rows for each of `sentences` sentences, in order.
    fn table(sentences: usize, n: usize, dist: fn(usize, &[u32]) -> Vec<f32>) -> Table {
        Table {
            rows: (0..sentences * n).map(|r| (r / n, Vec::new())).collect(),
            dist,
            steps: Vec::new(),
        }
    }

    #[test]
    fn beam_finds_a_better_sequence_than_greedy() {
        let g = greedy(&mut table(1, 1, trap), 1, &options(1)).remove(0);
        let b = beam_search(&mut table(1, 3, trap), &options(3));
        assert_eq!(g.tokens, vec![1]);
        assert_eq!(b.tokens, vec![2]);
        assert!(b.log_prob > g.log_prob, "{} vs {}", b.log_prob, g.log_prob);
        assert!((b.log_prob - (0.4f32 * 0.9).ln()).abs() < 1e-5);
    }

    #[test]
    fn beam_of_one_is_greedy() {
        let g = greedy(&mut table(1, 1, trap), 1, &options(1)).remove(0);
        let b = beam_search(&mut table(1, 1, trap), &options(1));
        assert_eq!(g.tokens, b.tokens);
        assert!((g.log_prob - b.log_prob).abs() < 1e-6);
    }

    /// The largest values against a full sort, ties included, and fewer values than asked.
    #[test]
    fn largest_keeps_the_top_values_in_order() {
        let row = [0.5, -1.0, 3.0, 0.5, 2.0, f32::NEG_INFINITY, 3.0, 0.25];
        let mut sorted: Vec<(f32, u32)> = row.iter().zip(0..).map(|(&p, i)| (p, i)).collect();
        sorted.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for m in [1, 3, 5, 8, 12] {
            assert_eq!(
                largest(&row, m),
                sorted[..m.min(row.len())].to_vec(),
                "m = {m}"
            );
        }
        assert!(largest(&row, 0).is_empty());
    }

    /// Sentences searched together give what each gives alone, to the bit, whether they stop at
    /// different steps or run to `max_len`; the rows of stopped sentences are gathered away
    /// once they are half of the rows, and only then.
    #[test]
    fn a_batch_searches_each_sentence_as_alone() {
        for (beam, max_len, penalty) in [(3, 12, 0.6), (4, 5, 1.0), (1, 12, 0.0)] {
            let mut options = options(beam);
            (options.max_len, options.length_penalty) = (max_len, penalty);
            let n = 7;
            let mut batch = table(n, beam, varied);
            let together = beam_search_batch(&mut batch, n, &options);
            let alone: Vec<Hypothesis> = (0..n)
                .map(|s| {
                    let mut one = table(1, beam, varied);
                    one.rows.iter_mut().for_each(|(sentence, _)| *sentence = s);
                    beam_search(&mut one, &options)
                })
                .collect();
            assert_eq!(together, alone, "beam {beam}, max_len {max_len}");
            let lengths: std::collections::BTreeSet<usize> =
                alone.iter().map(|h| h.tokens.len()).collect();
            assert!(lengths.len() > 1, "the sentences end alike: {alone:?}");
            // Row counts only fall, each to a multiple of the beam, the first a batch's.
            let steps = &batch.steps;
            assert_eq!(steps[0], n * beam);
            assert!(steps.windows(2).all(|w| w[1] <= w[0]), "{steps:?}");
            assert!(steps.iter().all(|&r| r % beam == 0), "{steps:?}");
            if max_len == 12 {
                assert!(
                    steps.last() < Some(&(n * beam)),
                    "never gathered: {steps:?}"
                );
            }
            // Gathered only once at least half the slots had stopped.
            for w in steps.windows(2).filter(|w| w[1] < w[0]) {
                assert!(2 * w[1] <= w[0], "gathered too early: {steps:?}");
            }
        }
        assert!(beam_search_batch(&mut table(0, 3, varied), 0, &options(3)).is_empty());
    }
}
