//! Language-model batches: random contiguous windows of the corpus, with targets shifted by one.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{DataError, Result};
use crate::token_file::TokenFile;

/// A batch of `B` windows of `T` tokens, row-major, as i32 for Burn's int tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LmBatch {
    /// Inputs `[B, T]`: `ids[s..s + T]` for each window start `s`.
    pub inputs: Vec<i32>,
    /// Targets `[B, T]`: `ids[s + 1..s + T + 1]`.
    pub targets: Vec<i32>,
    /// Windows `B`.
    pub batch_size: usize,
    /// Window length `T`.
    pub context_len: usize,
}

/// Where a split's ids are: in memory, or a range of a memory-mapped token file.
#[derive(Debug, Clone)]
enum Ids {
    Owned(Vec<u32>),
    Mapped { file: TokenFile, start: usize },
}

/// Draws windows from one split of a tokenized corpus.
#[derive(Debug, Clone)]
pub struct WindowSampler {
    ids: Ids,
    len: usize,
    context_len: usize,
}

impl WindowSampler {
    /// A sampler over `ids`; errors if it is shorter than one window of `context_len + 1`.
    pub fn new(what: &str, ids: Vec<u32>, context_len: usize) -> Result<Self> {
        let len = ids.len();
        Self::checked(what, Ids::Owned(ids), len, context_len)
    }

    /// A sampler over ids `range` of a memory-mapped token file (nothing read until a window
    /// is drawn); errors if the range is shorter than one window of `context_len + 1`.
    pub fn mapped(
        what: &str,
        file: TokenFile,
        range: std::ops::Range<usize>,
        context_len: usize,
    ) -> Result<Self> {
        assert!(range.end <= file.len(), "a range of the token file");
        let len = range.len();
        let ids = Ids::Mapped {
            file,
            start: range.start,
        };
        Self::checked(what, ids, len, context_len)
    }

    fn checked(what: &str, ids: Ids, len: usize, context_len: usize) -> Result<Self> {
        if len < context_len + 1 {
            return Err(DataError::TooShort {
                what: what.to_string(),
                tokens: len,
                needed: context_len + 1,
            });
        }
        Ok(Self {
            ids,
            len,
            context_len,
        })
    }

    /// Number of tokens in the split.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if the split holds no tokens (never, after [`new`](Self::new)).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `batch_size` windows at uniformly random starts drawn from `seed`: the same seed
    /// always gives the same batch, from memory or from a token file alike.
    pub fn sample(&self, batch_size: usize, seed: u64) -> LmBatch {
        let mut rng = StdRng::seed_from_u64(seed);
        let t = self.context_len;
        let mut inputs = Vec::with_capacity(batch_size * t);
        let mut targets = Vec::with_capacity(batch_size * t);
        for _ in 0..batch_size {
            let start = rng.random_range(0..=self.len - t - 1);
            match &self.ids {
                Ids::Owned(ids) => {
                    let window = &ids[start..start + t + 1];
                    inputs.extend(window[..t].iter().map(|&i| i as i32));
                    targets.extend(window[1..].iter().map(|&i| i as i32));
                }
                Ids::Mapped { file, start: first } => {
                    let at = first + start;
                    file.extend_i32(at..at + t, &mut inputs);
                    file.extend_i32(at + 1..at + t + 1, &mut targets);
                }
            }
        }
        LmBatch {
            inputs,
            targets,
            batch_size,
            context_len: t,
        }
    }
}

/// Mixes a run seed with a step (and micro-step) into the seed of one batch, so that a resumed
/// run draws exactly the batches the uninterrupted run would have (SplitMix64 finaliser).
pub fn batch_seed(seed: u64, step: u64, micro: u64) -> u64 {
    let mut z = seed
        .wrapping_add(step.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(micro.wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_true_slices_with_shifted_targets() {
        let ids: Vec<u32> = (0..50)
            .map(|i| (i * 7 % 13) as u32 + 100 * (i as u32))
            .collect();
        let sampler = WindowSampler::new("train", ids.clone(), 8).unwrap();
        let batch = sampler.sample(16, 3);
        for b in 0..16 {
            let x = &batch.inputs[b * 8..b * 8 + 8];
            let y = &batch.targets[b * 8..b * 8 + 8];
            // Values are distinct, so the first one locates the window in the corpus.
            let start = ids.iter().position(|&v| v as i32 == x[0]).unwrap();
            let want_x: Vec<i32> = ids[start..start + 8].iter().map(|&v| v as i32).collect();
            let want_y: Vec<i32> = ids[start + 1..start + 9]
                .iter()
                .map(|&v| v as i32)
                .collect();
            assert_eq!(x, want_x.as_slice());
            assert_eq!(y, want_y.as_slice());
        }
    }

    #[test]
    fn same_seed_same_batch_other_seed_other_batch() {
        let ids: Vec<u32> = (0..1000).collect();
        let sampler = WindowSampler::new("train", ids, 16).unwrap();
        assert_eq!(sampler.sample(4, 42), sampler.sample(4, 42));
        assert_ne!(sampler.sample(4, 42), sampler.sample(4, 43));
        assert_ne!(batch_seed(1, 2, 0), batch_seed(1, 3, 0));
        assert_ne!(batch_seed(1, 2, 0), batch_seed(1, 2, 1));
    }

    #[test]
    fn every_start_is_reachable_including_the_last() {
        let ids: Vec<u32> = (0..10).collect();
        let sampler = WindowSampler::new("val", ids, 9).unwrap();
        let batch = sampler.sample(64, 0);
        assert!(batch.inputs.chunks(9).any(|w| w[0] == 0));
        assert!(
            batch.inputs.chunks(9).any(|w| w[0] == 0) && batch.targets.chunks(9).any(|w| w[8] == 9)
        );
    }

    #[test]
    fn too_short_corpus_is_an_error() {
        let err = WindowSampler::new("val split of x.txt", vec![1, 2, 3], 8)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("val split of x.txt") && err.contains("3 tokens") && err.contains("9"),
            "{err}"
        );
    }
}
