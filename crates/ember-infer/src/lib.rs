//! # ember-infer
//!
//! Autoregressive decoding for ember models: greedy, temperature, top-k and top-p sampling,
//! with the KV cache.

pub mod batch;
pub mod generate;
pub mod sampling;
pub mod summed_losses;

pub use batch::generate_batch;
pub use generate::{Decoding, GenerateOptions, generate, generate_reporting};
pub use sampling::{Sampling, argmax, distribution, sample};
pub use summed_losses::{SummedLosses, summed_losses};
pub mod beam_search;
pub use beam_search::{
    Hypothesis, SearchOptions, StepScorer, beam_search, beam_search_batch, greedy,
};
pub mod translate;
pub use translate::{Seq2SeqScorer, translate_batch};
pub mod attention_maps;
pub use attention_maps::{AttentionMap, cross_attention, mean_over_heads, self_attention};
