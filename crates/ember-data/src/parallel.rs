//! Parallel corpora: two line-aligned files (line i of one translates line i of the other),
//! tokenized into id pairs, filtered by length, and cut into batches of similar lengths.

use std::path::Path;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::batches::batch_seed;
use crate::error::{DataError, Result};
use crate::tokenizer::Tokenizer;

/// Special token ids every translation vocabulary starts with.
pub const PAD: u32 = 0;
/// Beginning of a target sentence (the decoder's first input).
pub const BOS: u32 = 1;
/// End of a sentence.
pub const EOS: u32 = 2;
/// A piece outside the vocabulary.
pub const UNK: u32 = 3;
/// The special tokens, in id order.
pub const SPECIALS: [&str; 4] = ["<pad>", "<bos>", "<eos>", "<unk>"];

/// Reads two line-aligned files. A different number of lines is an error naming both files
/// and both counts.
pub fn read_parallel(src: &Path, tgt: &Path) -> Result<Vec<(String, String)>> {
    let src_text = crate::corpus::read_text(src)?;
    let tgt_text = crate::corpus::read_text(tgt)?;
    let src_lines: Vec<&str> = src_text.lines().collect();
    let tgt_lines: Vec<&str> = tgt_text.lines().collect();
    if src_lines.len() != tgt_lines.len() {
        return Err(DataError::Invalid(format!(
            "parallel files are not aligned: {} has {} lines but {} has {}",
            src.display(),
            src_lines.len(),
            tgt.display(),
            tgt_lines.len()
        )));
    }
    Ok(src_lines
        .into_iter()
        .zip(tgt_lines)
        .map(|(s, t)| (s.trim().to_string(), t.trim().to_string()))
        .collect())
}

/// A sentence pair as ids: the source ends with `<eos>`; the target has no specials (the batch
/// adds `<bos>` to the decoder input and `<eos>` to its output).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    /// Source ids followed by EOS.
    pub src: Vec<u32>,
    /// Target ids.
    pub tgt: Vec<u32>,
}

/// Tokenizes pairs and drops those longer than `max_len` tokens on either side (with the
/// specials) or empty on either side. Returns the kept pairs and how many were dropped.
pub fn encode_pairs(
    pairs: &[(String, String)],
    src_tok: &Tokenizer,
    tgt_tok: &Tokenizer,
    max_len: usize,
) -> Result<(Vec<Pair>, usize)> {
    let mut kept = Vec::with_capacity(pairs.len());
    let mut dropped = 0;
    for (s, t) in pairs {
        let mut src = src_tok.encode(s)?.ids;
        let tgt = tgt_tok.encode(t)?.ids;
        src.push(EOS);
        if src.len() > max_len || tgt.len() + 1 > max_len || tgt.is_empty() || src.len() == 1 {
            dropped += 1;
            continue;
        }
        kept.push(Pair { src, tgt });
    }
    Ok((kept, dropped))
}

/// A padded batch of pairs, row-major, as i32 for Burn's int tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairBatch {
    /// Sources `[B, S]`, padded with PAD.
    pub src: Vec<i32>,
    /// Decoder inputs `[B, T]`: BOS + target, padded.
    pub tgt_in: Vec<i32>,
    /// Decoder outputs `[B, T]`: target + EOS, padded.
    pub tgt_out: Vec<i32>,
    /// Rows `B`.
    pub batch_size: usize,
    /// Source width `S`.
    pub src_len: usize,
    /// Target width `T`.
    pub tgt_len: usize,
    /// Target tokens that count in the loss (not padding).
    pub tokens: usize,
}

/// Pads `pairs` into one batch.
pub fn make_batch(pairs: &[&Pair]) -> PairBatch {
    let s = pairs.iter().map(|p| p.src.len()).max().unwrap_or(1);
    let t = pairs.iter().map(|p| p.tgt.len() + 1).max().unwrap_or(1);
    let mut batch = PairBatch {
        src: Vec::with_capacity(pairs.len() * s),
        tgt_in: Vec::with_capacity(pairs.len() * t),
        tgt_out: Vec::with_capacity(pairs.len() * t),
        batch_size: pairs.len(),
        src_len: s,
        tgt_len: t,
        tokens: 0,
    };
    for p in pairs {
        let pad = |v: &mut Vec<i32>, from: &mut dyn Iterator<Item = u32>, width: usize| {
            let start = v.len();
            v.extend(from.map(|i| i as i32));
            v.resize(start + width, PAD as i32);
        };
        pad(&mut batch.src, &mut p.src.iter().copied(), s);
        pad(
            &mut batch.tgt_in,
            &mut std::iter::once(BOS).chain(p.tgt.iter().copied()),
            t,
        );
        pad(
            &mut batch.tgt_out,
            &mut p.tgt.iter().copied().chain(std::iter::once(EOS)),
            t,
        );
        batch.tokens += p.tgt.len() + 1;
    }
    batch
}

/// A sequence width rounded up to one of a few buckets: a multiple of 8 up to 64, then of 32.
/// Batches padded to bucketed widths repeat their shapes, so that a GPU backend, which compiles
/// and tunes kernels for each new shape, meets few of them; the masks hide the extra padding.
pub fn bucketed_width(width: usize) -> usize {
    let step = if width <= 64 { 8 } else { 32 };
    width.max(1).div_ceil(step) * step
}

impl PairBatch {
    /// The same batch with its source and target widths padded up to `src_len` and `tgt_len`
    /// (at least the batch's own) with PAD; the loss's token count is unchanged.
    pub fn padded_to(&self, src_len: usize, tgt_len: usize) -> PairBatch {
        let (s, t) = (src_len.max(self.src_len), tgt_len.max(self.tgt_len));
        let widen = |rows: &[i32], from: usize, to: usize| -> Vec<i32> {
            let mut out = Vec::with_capacity(self.batch_size * to);
            for row in rows.chunks(from.max(1)).take(self.batch_size) {
                out.extend_from_slice(row);
                out.resize(out.len() + to - from, PAD as i32);
            }
            out
        };
        PairBatch {
            src: widen(&self.src, self.src_len, s),
            tgt_in: widen(&self.tgt_in, self.tgt_len, t),
            tgt_out: widen(&self.tgt_out, self.tgt_len, t),
            batch_size: self.batch_size,
            src_len: s,
            tgt_len: t,
            tokens: self.tokens,
        }
    }

    /// [`PairBatch::padded_to`] the bucketed widths of its own ([`bucketed_width`]).
    pub fn bucketed(&self) -> PairBatch {
        self.padded_to(bucketed_width(self.src_len), bucketed_width(self.tgt_len))
    }
}

/// Groups pairs of similar length into batches of at most `max_tokens` padded tokens (source or
/// target side, whichever is wider), and serves them in an order reshuffled every epoch.
#[derive(Debug, Clone)]
pub struct Bucketed {
    pairs: Vec<Pair>,
    /// Each batch as indices into `pairs`.
    batches: Vec<Vec<usize>>,
}

impl Bucketed {
    /// Sorts by length and cuts into batches of at most `max_tokens` padded tokens each.
    pub fn new(pairs: Vec<Pair>, max_tokens: usize) -> Result<Self> {
        if pairs.is_empty() {
            return Err(DataError::Invalid(
                "no sentence pairs left after length filtering".into(),
            ));
        }
        let mut order: Vec<usize> = (0..pairs.len()).collect();
        order.sort_by_key(|&i| (pairs[i].src.len(), pairs[i].tgt.len(), i));
        let mut batches = Vec::new();
        let mut current: Vec<usize> = Vec::new();
        let mut widest = 0;
        for i in order {
            let width = pairs[i].src.len().max(pairs[i].tgt.len() + 1);
            let new_widest = widest.max(width);
            if !current.is_empty() && new_widest * (current.len() + 1) > max_tokens {
                batches.push(std::mem::take(&mut current));
                widest = width;
            } else {
                widest = new_widest;
            }
            current.push(i);
        }
        batches.push(current);
        Ok(Self { pairs, batches })
    }

    /// Number of batches in an epoch.
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    /// True if there is no batch (never, after [`new`](Self::new)).
    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Each batch's padded tokens `(source, target)`: its rows times its longest source, and
    /// times its longest target plus one (the decoder's inputs start with BOS), as
    /// [`make_batch`] pads them.
    pub fn padded_tokens(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.batches.iter().map(|batch| {
            let longest = |len: &dyn Fn(&Pair) -> usize| {
                batch
                    .iter()
                    .map(|&i| len(&self.pairs[i]))
                    .max()
                    .unwrap_or(1)
            };
            let (src, tgt) = (longest(&|p| p.src.len()), longest(&|p| p.tgt.len() + 1));
            (batch.len() * src, batch.len() * tgt)
        })
    }

    /// Number of pairs.
    pub fn pairs(&self) -> &[Pair] {
        &self.pairs
    }

    /// The `index`-th batch of the whole run: epoch `index / len`, in that epoch's shuffled
    /// order. Depends only on `(seed, index)`, so a resumed run sees the same batches.
    pub fn batch(&self, seed: u64, index: u64) -> PairBatch {
        let n = self.batches.len() as u64;
        let epoch = index / n;
        let mut order: Vec<usize> = (0..self.batches.len()).collect();
        order.shuffle(&mut StdRng::seed_from_u64(batch_seed(seed, epoch, 0xB0C7)));
        let chosen = &self.batches[order[(index % n) as usize]];
        let pairs: Vec<&Pair> = chosen.iter().map(|&i| &self.pairs[i]).collect();
        make_batch(&pairs)
    }

    /// Batch `i` of the unshuffled, length-sorted order (for evaluation).
    pub fn sorted_batch(&self, i: usize) -> PairBatch {
        let pairs: Vec<&Pair> = self.batches[i].iter().map(|&j| &self.pairs[j]).collect();
        make_batch(&pairs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ember-par-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn misaligned_files_are_rejected_with_both_counts() {
        let a = temp("a.de", "eins\nzwei\ndrei\n");
        let b = temp("b.en", "one\ntwo\n");
        let err = read_parallel(&a, &b).unwrap_err().to_string();
        assert!(
            err.contains("a.de has 3 lines") && err.contains("b.en has 2"),
            "{err}"
        );
        let c = temp("c.en", "one\ntwo\nthree\n");
        assert_eq!(
            read_parallel(&a, &c).unwrap()[2],
            ("drei".into(), "three".into())
        );
    }

    /// Bucketed widths: multiples of 8 up to 64, of 32 beyond, never below the width.
    #[test]
    fn widths_round_up_to_few_buckets() {
        let got: Vec<usize> = [1, 8, 9, 17, 64, 65, 96, 97].map(bucketed_width).into();
        assert_eq!(got, [8, 8, 16, 24, 64, 96, 96, 128]);
        let distinct: std::collections::BTreeSet<usize> = (1..=64).map(bucketed_width).collect();
        assert_eq!(distinct.len(), 8);
    }

    /// A batch padded to wider widths keeps every row's tokens in place, PAD after them, and its
    /// token count.
    #[test]
    fn padding_to_wider_widths_keeps_the_rows() {
        let p1 = Pair {
            src: vec![7, 8, EOS],
            tgt: vec![9],
        };
        let p2 = Pair {
            src: vec![5, EOS],
            tgt: vec![4, 6],
        };
        let b = make_batch(&[&p1, &p2]);
        let w = b.padded_to(5, 4);
        let pad = PAD as i32;
        assert_eq!(
            (w.src_len, w.tgt_len, w.batch_size, w.tokens),
            (5, 4, 2, b.tokens)
        );
        assert_eq!(
            w.src,
            vec![7, 8, EOS as i32, pad, pad, 5, EOS as i32, pad, pad, pad]
        );
        assert_eq!(
            w.tgt_in,
            vec![BOS as i32, 9, pad, pad, BOS as i32, 4, 6, pad]
        );
        assert_eq!(
            w.tgt_out,
            vec![9, EOS as i32, pad, pad, 4, 6, EOS as i32, pad]
        );
        assert_eq!(b.padded_to(1, 1), b, "never narrower than the batch");
        assert_eq!(b.bucketed().src_len, 8);
    }

    #[test]
    fn batches_are_padded_and_shifted() {
        let p1 = Pair {
            src: vec![7, 8, EOS],
            tgt: vec![5],
        };
        let p2 = Pair {
            src: vec![9, EOS],
            tgt: vec![4, 6],
        };
        let b = make_batch(&[&p1, &p2]);
        assert_eq!((b.src_len, b.tgt_len, b.tokens), (3, 3, 5));
        assert_eq!(b.src, vec![7, 8, 2, 9, 2, 0]);
        assert_eq!(b.tgt_in, vec![1, 5, 0, 1, 4, 6]);
        assert_eq!(b.tgt_out, vec![5, 2, 0, 4, 6, 2]);
    }

    #[test]
    fn buckets_respect_the_token_budget_and_cover_every_pair_each_epoch() {
        let pairs: Vec<Pair> = (0..50)
            .map(|i| Pair {
                src: vec![4; 1 + i % 7],
                tgt: vec![5; 1 + (i * 3) % 5],
            })
            .collect();
        let b = Bucketed::new(pairs, 24).unwrap();
        let mut seen = 0;
        for i in 0..b.len() as u64 {
            let batch = b.batch(9, i);
            assert!(batch.batch_size * batch.src_len.max(batch.tgt_len) <= 24);
            seen += batch.batch_size;
        }
        assert_eq!(seen, 50);
        assert_eq!(b.batch(9, 3), b.batch(9, 3));
        // Each batch's padded tokens are the sorted batch's own, as make_batch pads it.
        let tokens: Vec<(usize, usize)> = b.padded_tokens().collect();
        assert_eq!(tokens.len(), b.len());
        for (i, &(src, tgt)) in tokens.iter().enumerate() {
            let batch = b.sorted_batch(i);
            assert_eq!(src, batch.batch_size * batch.src_len);
            assert_eq!(tgt, batch.batch_size * batch.tgt_len);
        }
        assert!(tokens.iter().any(|&(src, tgt)| src != tgt));
    }
}
