//! Byte-level BPE through the Hugging Face `tokenizers` crate: trained offline on a corpus, or
//! loaded from any `tokenizer.json`.

use std::path::Path;

use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer, TokenizerBuilder, TokenizerImpl,
};

use crate::error::{DataError, Result};

fn tk_err(e: impl std::fmt::Display) -> DataError {
    DataError::Tokenizer(e.to_string())
}

/// Trains a byte-level BPE of `vocab_size` tokens on `files`; `special` tokens come first.
///
/// Byte-level means every byte has a token, so no text is ever unknown.
pub fn train_bpe(files: &[&Path], vocab_size: usize, special: &[&str]) -> Result<Tokenizer> {
    let min = 256 + special.len();
    if vocab_size < min {
        return Err(DataError::Invalid(format!(
            "bpe vocab_size = {vocab_size} is too small: a byte-level BPE needs at least {min} (256 bytes + {} special tokens)",
            special.len()
        )));
    }
    for file in files {
        // Checks existence, emptiness and UTF-8 with our clear errors before the library does.
        crate::corpus::read_text(file)?;
    }
    train_bpe_unchecked(files, vocab_size, special)
}

/// [`train_bpe`] of files already checked (they exist, hold text and are UTF-8).
pub fn train_bpe_unchecked(
    files: &[&Path],
    vocab_size: usize,
    special: &[&str],
) -> Result<Tokenizer> {
    let min = 256 + special.len();
    if vocab_size < min {
        return Err(DataError::Invalid(format!(
            "bpe vocab_size = {vocab_size} is too small: a byte-level BPE needs at least {min} (256 bytes + {} special tokens)",
            special.len()
        )));
    }
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(special.iter().map(|s| AddedToken::from(*s, true)).collect())
        .build();
    let byte_level = ByteLevel::default().add_prefix_space(false);
    let mut tk: TokenizerImpl<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None)
        .with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(byte_level)))
        .with_post_processor(Some(PostProcessorWrapper::ByteLevel(byte_level)))
        .with_decoder(Some(DecoderWrapper::ByteLevel(byte_level)))
        .build()
        .map_err(tk_err)?;
    let paths: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
    tk.train_from_files(&mut trainer, paths).map_err(tk_err)?;
    Ok(Tokenizer::from(tk))
}

/// Loads any Hugging Face `tokenizer.json`.
pub fn load_bpe(path: &Path) -> Result<Tokenizer> {
    let text = crate::corpus::read_text(path)?;
    text.parse::<Tokenizer>()
        .map_err(|e| DataError::BadTokenizer {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
}

/// Writes `tokenizer` as a Hugging Face `tokenizer.json`.
pub fn save_bpe(tokenizer: &Tokenizer, path: &Path) -> Result<()> {
    let json = tokenizer.to_string(false).map_err(tk_err)?;
    std::fs::write(path, json).map_err(|source| DataError::Write {
        path: path.to_path_buf(),
        source,
    })
}
