//! Translating with an [`EncoderDecoder`]: the encoder runs once per batch of sentences, the
//! decoder steps with the KV cache, greedily or with beam search.

use burn::tensor::{Device, Int, Tensor};
use ember_model::{DecoderCache, EncoderDecoder, Memory};

use crate::beam_search::{Hypothesis, SearchOptions, StepScorer, beam_search_batch, greedy};

/// Decoder steps of an encoder-decoder model over a fixed encoder output.
pub struct Seq2SeqScorer<'a> {
    model: &'a EncoderDecoder,
    memory: Memory,
    cache: DecoderCache,
    device: Device,
    /// Each row's source: rows with the same one hold the same encoder output.
    sources: Vec<usize>,
    /// Tokens never chosen (the decoder's start and padding, which no target holds).
    never: Vec<u32>,
}

impl<'a> Seq2SeqScorer<'a> {
    /// Rows of `memory` are the hypotheses to extend.
    pub fn new(model: &'a EncoderDecoder, memory: Memory) -> Self {
        let sources = (0..memory.states.dims()[0]).collect();
        Self::with_sources(model, memory, sources)
    }

    /// `beam` rows for each row of `memory`, the hypotheses of its source: row `i * beam + j`
    /// is hypothesis `j` of source `i`, as [`crate::beam_search_batch`] takes them.
    pub fn for_beams(model: &'a EncoderDecoder, memory: Memory, beam: usize) -> Self {
        let n = memory.states.dims()[0];
        let sources: Vec<usize> = (0..n).flat_map(|i| std::iter::repeat_n(i, beam)).collect();
        let rows: Vec<i32> = sources.iter().map(|&i| i as i32).collect();
        let rows = Tensor::<1, Int>::from_ints(rows.as_slice(), &memory.states.device());
        let memory = Memory {
            states: memory.states.select(0, rows.clone()),
            pad: memory.pad.map(|p| p.select(0, rows)),
        };
        Self::with_sources(model, memory, sources)
    }

    fn with_sources(model: &'a EncoderDecoder, memory: Memory, sources: Vec<usize>) -> Self {
        let device = memory.states.device();
        Self {
            model,
            memory,
            cache: model.new_cache(),
            device,
            sources,
            never: Vec::new(),
        }
    }

    /// The same scorer giving `tokens` a log-probability of minus infinity, so that no search
    /// chooses them: the start token and padding, which a target never holds (a weakly trained
    /// model can still rank them first, and its translation would print `<bos>`).
    pub fn never(mut self, tokens: &[u32]) -> Self {
        self.never = tokens.to_vec();
        self
    }
}

impl StepScorer for Seq2SeqScorer<'_> {
    fn step(&mut self, last: &[u32]) -> Vec<Vec<f32>> {
        let n = last.len();
        let ids: Vec<i32> = last.iter().map(|&t| t as i32).collect();
        let tokens = Tensor::<1, Int>::from_ints(ids.as_slice(), &self.device).reshape([n, 1]);
        let logits = self
            .model
            .decode(tokens, None, &self.memory, Some(&mut self.cache), false)
            .logits; // [N, 1, V]
        let v = logits.dims()[2];
        let flat = ember_kernels::log_softmax(logits.reshape([n, v]))
            .try_into_vec_as::<f32>()
            .expect("logits are f32");
        let mut rows: Vec<Vec<f32>> = flat.chunks(v).map(<[f32]>::to_vec).collect();
        for row in &mut rows {
            for &token in &self.never {
                if let Some(p) = row.get_mut(token as usize) {
                    *p = f32::NEG_INFINITY;
                }
            }
        }
        rows
    }

    fn reorder(&mut self, rows: &[usize]) {
        let ids: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let index = Tensor::<1, Int>::from_ints(ids.as_slice(), &self.device);
        let sources: Vec<usize> = rows.iter().map(|&r| self.sources[r]).collect();
        if sources == self.sources {
            // Rows change places only among hypotheses of one source: the encoder output, its
            // padding and the cross-attention keys and values stay where they are.
            self.cache.select_self_batch(index);
            return;
        }
        self.sources = sources;
        self.cache.select_batch(index.clone());
        self.memory.states = self.memory.states.clone().select(0, index.clone());
        self.memory.pad = self.memory.pad.take().map(|p| p.select(0, index));
    }
}

/// Source id sequences padded into `[B, S]` with their padding mask.
fn pad_sources(
    sources: &[Vec<u32>],
    pad: u32,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, burn::tensor::Bool>) {
    let b = sources.len();
    let s = sources.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let mut flat = Vec::with_capacity(b * s);
    for src in sources {
        flat.extend(src.iter().map(|&t| t as i32));
        flat.extend(std::iter::repeat_n(pad as i32, s - src.len()));
    }
    let ids = Tensor::<1, Int>::from_ints(flat.as_slice(), device).reshape([b, s]);
    let mask = ids.clone().equal_elem(pad as i64);
    (ids, mask)
}

/// Translates a batch of tokenized sources (each ending with EOS): the encoder runs once over the
/// batch, then the decoder steps every sentence at once, greedily (beam 1) or with beam search
/// (`beam` rows a sentence, [`beam_search_batch`]), never choosing the start token or `pad`.
pub fn translate_batch(
    model: &EncoderDecoder,
    sources: &[Vec<u32>],
    pad: u32,
    options: &SearchOptions,
) -> Vec<Hypothesis> {
    if sources.is_empty() {
        return Vec::new();
    }
    let device = model.src_embed.weight.device();
    // A source longer than the positional table keeps its start and its end token.
    let limit = model.max_positions;
    let clipped: Vec<Vec<u32>> = sources
        .iter()
        .map(|s| match s.len() > limit {
            true => s[..limit - 1].iter().chain(s.last()).copied().collect(),
            false => s.clone(),
        })
        .collect();
    let (src, mask) = pad_sources(&clipped, pad, &device);
    let memory = model.encode(src, Some(mask));
    let options = SearchOptions {
        max_len: options.max_len.min(model.max_positions),
        ..*options
    };
    let never = [options.bos, pad];
    if options.beam <= 1 {
        let mut scorer = Seq2SeqScorer::new(model, memory).never(&never);
        return greedy(&mut scorer, sources.len(), &options);
    }
    let mut scorer = Seq2SeqScorer::for_beams(model, memory, options.beam).never(&never);
    beam_search_batch(&mut scorer, sources.len(), &options)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use ember_model::EncoderDecoderConfig;

    const PAD: u32 = 0;
    const BOS: u32 = 1;
    const EOS: u32 = 2;

    /// A model whose decoder ranks BOS first, then PAD, then EOS, at every step: its final
    /// LayerNorm outputs ones whatever its input (gain 0, bias 1), and the output layer's
    /// columns for those tokens are 1, 0.5 and 0.25, the others 0.
    fn model_preferring_bos() -> EncoderDecoder {
        let device = Device::flex();
        let config = EncoderDecoderConfig {
            src_vocab_size: 10,
            tgt_vocab_size: 10,
            shared_embeddings: false,
            tie_output: false,
            d_model: 8,
            n_heads: 2,
            n_encoder_layers: 1,
            n_decoder_layers: 1,
            max_positions: 16,
            ..Default::default()
        };
        let mut model = config.init(&device).unwrap();
        let norm = model
            .decoder_norm
            .as_mut()
            .expect("pre-norm has a final LayerNorm");
        norm.gamma = Param::from_tensor(Tensor::zeros([8], &device));
        norm.beta = Some(Param::from_tensor(Tensor::ones([8], &device)));
        let mut columns = vec![0.0f32; 10];
        (
            columns[BOS as usize],
            columns[PAD as usize],
            columns[EOS as usize],
        ) = (1.0, 0.5, 0.25);
        let weight: Vec<f32> = (0..8).flat_map(|_| columns.clone()).collect();
        let weight = Tensor::<1>::from_floats(weight.as_slice(), &device).reshape([8, 10]);
        model.output.as_mut().unwrap().weight = Param::from_tensor(weight);
        model
    }

    #[test]
    fn translations_never_choose_the_start_token_or_padding() {
        let model = model_preferring_bos();
        let options = SearchOptions {
            beam: 1,
            length_penalty: 0.0,
            max_len: 5,
            bos: BOS,
            eos: EOS,
        };
        let sources = vec![vec![5, 6, EOS], vec![7, EOS]];
        // Searched as the model ranks them: the start token, every step.
        let (src, mask) = pad_sources(&sources, PAD, &Device::flex());
        let memory = model.encode(src, Some(mask));
        let plain = greedy(&mut Seq2SeqScorer::new(&model, memory), 2, &options);
        assert!(plain.iter().all(|h| h.tokens == [BOS; 5]), "{plain:?}");
        // Translated: the best token that is neither, the end.
        for beam in [1, 3] {
            let options = SearchOptions { beam, ..options };
            for h in translate_batch(&model, &sources, PAD, &options) {
                assert!(
                    h.tokens.is_empty() && h.log_prob.is_finite(),
                    "beam {beam}: {h:?}"
                );
            }
        }
    }
}
