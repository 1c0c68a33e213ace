//! # ember-data
//!
//! Text in, token ids out: corpus loading with clear errors, character-level and BPE
//! tokenizers, corpora tokenized once into memory-mapped token files (`prepare`,
//! `token_file`), and language-model batches of random windows.

pub mod batches;
pub mod bleu;
pub mod bpe;
pub mod char_tokenizer;
pub mod chat;
pub mod corpus;
pub mod error;
pub mod hf_tokenizer;
pub mod parallel;
pub mod prepare;
pub mod token_file;
pub mod tokenizer;

pub use batches::{LmBatch, WindowSampler, batch_seed};
pub use char_tokenizer::{CharTokenizer, Encoded};
pub use error::{DataError, Result};
pub use token_file::TokenFile;
pub use tokenizer::Tokenizer;
