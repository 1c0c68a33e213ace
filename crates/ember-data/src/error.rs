//! The one error type of the data crate. Every variant names the file (and where useful the
//! line or byte) at fault.

use std::path::PathBuf;

/// Something is wrong with a corpus, a tokenizer file or a tokenizer call.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds no text.
    #[error("{path} is empty: there is no text in it")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// The file is not valid UTF-8.
    #[error("{path} is not valid UTF-8: invalid byte at offset {offset} (line {line})")]
    InvalidUtf8 {
        /// The file.
        path: PathBuf,
        /// Byte offset of the first invalid byte.
        offset: usize,
        /// 1-based line of that byte.
        line: usize,
    },
    /// The corpus is too short for one training window.
    #[error(
        "{what} has {tokens} tokens, fewer than one window of {needed} (context_len + 1); use a longer text or a smaller context_len"
    )]
    TooShort {
        /// Which split or file.
        what: String,
        /// Tokens it has.
        tokens: usize,
        /// Tokens a window needs.
        needed: usize,
    },
    /// A tokenizer file is malformed.
    #[error("bad tokenizer file {path}: {message}")]
    BadTokenizer {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A prepared corpus's token file is malformed or does not fit the run.
    #[error("bad token file {path}: {message}")]
    BadTokenFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The `tokenizers` library failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// An invalid setting (name and value given in the message).
    #[error("{0}")]
    Invalid(String),
}

/// Short for `Result<T, DataError>`.
pub type Result<T> = std::result::Result<T, DataError>;
