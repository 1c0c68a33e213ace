//! A tokenized corpus on disk: the token ids of a whole corpus, written once by `ember prepare`
//! and memory-mapped by training, so that a run's memory and start-up do not grow with the
//! corpus (nanoGPT's `train.bin`, with a header that says what the ids mean).
//!
//! A prepared corpus is a folder: [`TOKENS_FILE`] and the tokenizer that made it
//! (`chars.json` or `tokenizer.json`, as a checkpoint keeps it). The token file is a 64-byte
//! header, then the ids, little-endian, 2 bytes each where the vocabulary fits in `u16`, else 4:
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `EMBERTOK` |
//! | 8..12 | format version ([`FORMAT_VERSION`]) |
//! | 12..16 | bytes per id (2 or 4) |
//! | 16..24 | ids |
//! | 24..32 | vocabulary size |
//! | 32..40 | hash of the tokenizer's vocabulary ([`tokenizer_hash`]) |
//! | 40..64 | zero |
//!
//! The train/validation split is not stored: like a text corpus, the first `train_fraction`
//! of the ids train and the rest validate, so a prepared corpus gives the same batches as its
//! text.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{DataError, Result};
use crate::tokenizer::{BPE_FILE, CHAR_FILE, Tokenizer};

/// The token file inside a prepared corpus folder.
pub const TOKENS_FILE: &str = "tokens.bin";
/// The first bytes of a token file.
pub const MAGIC: &[u8; 8] = b"EMBERTOK";
/// The format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes before the first id.
pub const HEADER_BYTES: usize = 64;

/// What a token file's header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Bytes per id: 2 or 4.
    pub width: usize,
    /// Ids in the file.
    pub tokens: u64,
    /// The tokenizer's vocabulary size.
    pub vocab_size: u64,
    /// [`tokenizer_hash`] of the tokenizer that wrote the ids.
    pub tokenizer_hash: u64,
}

impl Header {
    /// Bytes per id of a vocabulary of `vocab_size`: 2 where every id fits in `u16`, else 4.
    pub fn width_for(vocab_size: u64) -> usize {
        if vocab_size <= 1 << 16 { 2 } else { 4 }
    }

    /// The 64 bytes written before the ids.
    pub fn to_bytes(&self) -> [u8; HEADER_BYTES] {
        let mut bytes = [0u8; HEADER_BYTES];
        bytes[0..8].copy_from_slice(MAGIC);
        bytes[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        bytes[12..16].copy_from_slice(&(self.width as u32).to_le_bytes());
        bytes[16..24].copy_from_slice(&self.tokens.to_le_bytes());
        bytes[24..32].copy_from_slice(&self.vocab_size.to_le_bytes());
        bytes[32..40].copy_from_slice(&self.tokenizer_hash.to_le_bytes());
        bytes
    }

    /// Reads a header; the error says what is wrong with `path`.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Self> {
        let bad = |message: String| DataError::BadTokenFile {
            path: path.to_path_buf(),
            message,
        };
        if bytes.len() < HEADER_BYTES || &bytes[0..8] != MAGIC {
            return Err(bad(
                "not a token file of `ember prepare` (no EMBERTOK header)".into(),
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != FORMAT_VERSION {
            return Err(bad(format!(
                "format version {version}; this build reads version {FORMAT_VERSION} (prepare the corpus again)"
            )));
        }
        let width = u32_at(12) as usize;
        if width != 2 && width != 4 {
            return Err(bad(format!("{width} bytes per token; expected 2 or 4")));
        }
        Ok(Self {
            width,
            tokens: u64_at(16),
            vocab_size: u64_at(24),
            tokenizer_hash: u64_at(32),
        })
    }
}

/// FNV-1a (64 bits) of a tokenizer's vocabulary ([`Tokenizer::vocabulary_bytes`]): what a
/// token file records of the tokenizer that made its ids.
pub fn tokenizer_hash(tokenizer: &Tokenizer) -> u64 {
    fnv1a(&tokenizer.vocabulary_bytes())
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// True when `path` is a prepared corpus folder (it holds [`TOKENS_FILE`]).
pub fn is_prepared(path: &Path) -> bool {
    path.join(TOKENS_FILE).is_file()
}

/// Writes the ids of a token file as they come, then its header (so that a file cut short by a
/// crash has none and is never read as whole), and moves it into place at the end.
pub struct TokenWriter {
    path: PathBuf,
    partial: PathBuf,
    file: std::io::BufWriter<File>,
    width: usize,
    vocab_size: u64,
    tokenizer_hash: u64,
    tokens: u64,
}

impl TokenWriter {
    /// A writer of `folder/tokens.bin` for ids of a vocabulary of `vocab_size`.
    pub fn create(folder: &Path, vocab_size: u64, tokenizer_hash: u64) -> Result<Self> {
        let path = folder.join(TOKENS_FILE);
        let partial = folder.join(format!("{TOKENS_FILE}.partial"));
        let write_err = |source| DataError::Write {
            path: partial.clone(),
            source,
        };
        let mut file =
            std::io::BufWriter::with_capacity(1 << 20, File::create(&partial).map_err(write_err)?);
        // A zero header until the end: an unfinished file is not a token file.
        file.write_all(&[0u8; HEADER_BYTES]).map_err(write_err)?;
        Ok(Self {
            width: Header::width_for(vocab_size),
            path,
            partial,
            file,
            vocab_size,
            tokenizer_hash,
            tokens: 0,
        })
    }

    /// Appends `ids` (each below the vocabulary size).
    pub fn write(&mut self, ids: &[u32]) -> Result<()> {
        let mut bytes = Vec::with_capacity(ids.len() * self.width);
        for &id in ids {
            debug_assert!(u64::from(id) < self.vocab_size.max(1));
            match self.width {
                2 => bytes.extend_from_slice(&(id as u16).to_le_bytes()),
                _ => bytes.extend_from_slice(&id.to_le_bytes()),
            }
        }
        self.file
            .write_all(&bytes)
            .map_err(|source| DataError::Write {
                path: self.partial.clone(),
                source,
            })?;
        self.tokens += ids.len() as u64;
        Ok(())
    }

    /// Ids written so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Writes the header, flushes to disk and renames the file into place.
    pub fn finish(self) -> Result<Header> {
        use std::io::{Seek, SeekFrom};
        let header = Header {
            width: self.width,
            tokens: self.tokens,
            vocab_size: self.vocab_size,
            tokenizer_hash: self.tokenizer_hash,
        };
        let write_err = |source| DataError::Write {
            path: self.partial.clone(),
            source,
        };
        let mut file = self
            .file
            .into_inner()
            .map_err(|e| write_err(e.into_error()))?;
        file.seek(SeekFrom::Start(0)).map_err(write_err)?;
        file.write_all(&header.to_bytes()).map_err(write_err)?;
        file.sync_all().map_err(write_err)?;
        std::fs::rename(&self.partial, &self.path).map_err(|source| DataError::Write {
            path: self.path.clone(),
            source,
        })?;
        Ok(header)
    }
}

/// A prepared corpus, its ids memory-mapped.
#[derive(Debug, Clone)]
pub struct TokenFile {
    /// The token file.
    pub path: PathBuf,
    /// Its header.
    pub header: Header,
    map: Arc<Mmap>,
}

impl TokenFile {
    /// Maps `folder/tokens.bin` and checks it against its header and `tokenizer` (the folder's,
    /// or a checkpoint's when a run resumes): every error names the file and what is wrong.
    pub fn open(folder: &Path, tokenizer: &Tokenizer) -> Result<Self> {
        let path = folder.join(TOKENS_FILE);
        let file = File::open(&path).map_err(|source| DataError::Read {
            path: path.clone(),
            source,
        })?;
        // SAFETY: the map is read-only; ember never writes a token file in place (a new one
        // is written beside it and renamed over it), so the mapped bytes do not change under
        // the run unless another program truncates the file, which the length check below
        // cannot prevent but makes unlikely to go unnoticed at start-up.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| DataError::Read {
            path: path.clone(),
            source,
        })?;
        let header = Header::parse(&path, &map)?;
        let bad = |message: String| DataError::BadTokenFile {
            path: path.clone(),
            message,
        };
        let expected = HEADER_BYTES as u64 + header.tokens * header.width as u64;
        if map.len() as u64 != expected {
            return Err(bad(format!(
                "{} bytes where its header says {} tokens of {} bytes ({expected} bytes): cut short or appended to; prepare the corpus again",
                map.len(),
                header.tokens,
                header.width
            )));
        }
        let vocab = tokenizer.vocab_size() as u64;
        if header.vocab_size != vocab || header.tokenizer_hash != tokenizer_hash(tokenizer) {
            return Err(bad(format!(
                "its ids were made by another tokenizer (a vocabulary of {}) than this run's ({}); prepare the corpus with the run's tokenizer (`ember prepare --tokenizer-from` its checkpoint)",
                header.vocab_size,
                tokenizer.describe()
            )));
        }
        #[cfg(unix)]
        let _ = map.advise(memmap2::Advice::Random);
        Ok(Self {
            path,
            header,
            map: Arc::new(map),
        })
    }

    /// Ids in the file.
    pub fn len(&self) -> usize {
        self.header.tokens as usize
    }

    /// True when the file holds no ids.
    pub fn is_empty(&self) -> bool {
        self.header.tokens == 0
    }

    /// Id `i`.
    pub fn get(&self, i: usize) -> u32 {
        let at = HEADER_BYTES + i * self.header.width;
        match self.header.width {
            2 => u16::from_le_bytes([self.map[at], self.map[at + 1]]) as u32,
            _ => u32::from_le_bytes(self.map[at..at + 4].try_into().expect("4 bytes")),
        }
    }

    /// Ids `range` appended to `out`, as `i32` (Burn's int tensors).
    pub fn extend_i32(&self, range: std::ops::Range<usize>, out: &mut Vec<i32>) {
        let w = self.header.width;
        let bytes = &self.map[HEADER_BYTES + range.start * w..HEADER_BYTES + range.end * w];
        match w {
            2 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]) as i32),
            ),
            _ => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i32),
            ),
        }
    }
}

/// The tokenizer file of a prepared corpus folder: `chars.json` or `tokenizer.json`.
pub fn load_folder_tokenizer(folder: &Path) -> Result<Tokenizer> {
    if !folder.join(CHAR_FILE).is_file() && !folder.join(BPE_FILE).is_file() {
        return Err(DataError::BadTokenFile {
            path: folder.join(TOKENS_FILE),
            message: format!(
                "its folder has no tokenizer ({CHAR_FILE} or {BPE_FILE}); prepare the corpus again"
            ),
        });
    }
    Tokenizer::load(folder)
}
