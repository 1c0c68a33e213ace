//! `ember prepare`: text corpora tokenized once into a prepared corpus folder
//! ([`crate::token_file`]), read in blocks so that memory does not grow with the corpus.
//!
//! The files are read a block at a time (UTF-8 checked as they go, the error naming the file,
//! byte and line); each block is cut into pieces that the tokenizer's workers encode in
//! parallel, and the ids are written in order. A character vocabulary takes one pass of its
//! own over the files first; a byte-level BPE is trained by the `tokenizers` library from the
//! files, or from their first [`BPE_SAMPLE_BYTES`] where they hold more (it counts words as it
//! reads: its memory grows with the distinct words of what it reads). Pieces end after a newline followed by a character that is not whitespace: there
//! the GPT-2 pre-tokenizer of a byte-level BPE always ends a word, so the ids are those of the
//! whole text encoded at once, as `ember train` encodes a text file. (Another `tokenizer.json`
//! may split words otherwise; its ids are those of each piece.)

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::char_tokenizer::CharTokenizer;
use crate::error::{DataError, Result};
use crate::token_file::{Header, TokenWriter, tokenizer_hash};
use crate::tokenizer::Tokenizer;

/// Bytes read from a file at a time, per worker: each worker encodes one piece of about this
/// size (the `tokenizers` library holds some 100 bytes per token while it encodes).
pub const PIECE_BYTES: usize = 1 << 20;

/// Which tokenizer a corpus is prepared with.
#[derive(Debug, Clone)]
pub enum TokenizerChoice {
    /// One id per distinct character of the files.
    Char,
    /// A byte-level BPE of this many tokens, trained on the files.
    Bpe(usize),
    /// A Hugging Face `tokenizer.json`.
    File(PathBuf),
    /// An existing tokenizer (a checkpoint's, to prepare a corpus for fine-tuning it).
    Given(Tokenizer),
}

/// What to prepare.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// Text files, or folders whose files are taken in name order.
    pub inputs: Vec<PathBuf>,
    /// The prepared corpus folder to write (created; its token file replaced).
    pub out: PathBuf,
    /// The tokenizer.
    pub tokenizer: TokenizerChoice,
    /// Encoding workers (at least 1).
    pub threads: usize,
    /// Bytes of text each worker encodes at a time ([`PIECE_BYTES`]).
    pub piece_bytes: usize,
    /// The most text a BPE is trained on: the inputs' first this many bytes, cut at a line
    /// ([`BPE_SAMPLE_BYTES`]), so that training's memory and time stay bounded whatever the
    /// corpus's size.
    pub bpe_sample_bytes: u64,
}

/// The default of [`PrepareOptions::bpe_sample_bytes`]: 256 MB.
pub const BPE_SAMPLE_BYTES: u64 = 256 << 20;

/// What a stage of [`prepare`] has done so far: `done` of `total` bytes of text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// `"vocabulary"`, `"tokenizer"` or `"tokens"`.
    pub stage: &'static str,
    /// Bytes read.
    pub done: u64,
    /// Bytes in all.
    pub total: u64,
}

/// What [`prepare`] wrote.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The token file's header.
    pub header: Header,
    /// The tokenizer, also saved in the folder.
    pub tokenizer: Tokenizer,
    /// Bytes of text read.
    pub bytes: u64,
    /// Pieces of text outside the vocabulary (unknown ids).
    pub unknown: u64,
    /// Seconds spent encoding and writing (after the tokenizer was made).
    pub encode_secs: f64,
}

/// Tokenizes the input files into `options.out`; `progress` hears of each block.
pub fn prepare(options: &PrepareOptions, progress: &mut dyn FnMut(Progress)) -> Result<Prepared> {
    let files = input_files(&options.inputs)?;
    let total: u64 = files.iter().map(|(_, size)| size).sum();
    let paths: Vec<&Path> = files.iter().map(|(p, _)| p.as_path()).collect();
    std::fs::create_dir_all(&options.out).map_err(|source| DataError::Write {
        path: options.out.clone(),
        source,
    })?;
    let tokenizer = match &options.tokenizer {
        TokenizerChoice::Char => {
            let mut chars = BTreeSet::new();
            let mut done = 0;
            for path in &paths {
                read_blocks(path, 1 << 24, false, &mut |text| {
                    chars.extend(text.chars());
                    done += text.len() as u64;
                    progress(Progress {
                        stage: "vocabulary",
                        done,
                        total,
                    });
                    Ok(())
                })?;
            }
            Tokenizer::Char(CharTokenizer::from_sorted(chars.into_iter().collect()))
        }
        TokenizerChoice::Bpe(vocab_size) => {
            progress(Progress {
                stage: "tokenizer",
                done: 0,
                total,
            });
            // Our own UTF-8 errors (file, byte, line) before the library reads the files; past
            // the sample, the first text of the inputs is what the BPE learns from.
            let sample = options.out.join("bpe-sample.txt.partial");
            let mut writer = (total > options.bpe_sample_bytes)
                .then(|| std::fs::File::create(&sample).map(std::io::BufWriter::new))
                .transpose()
                .map_err(|source| DataError::Write {
                    path: sample.clone(),
                    source,
                })?;
            let mut sampled = 0u64;
            for path in &paths {
                read_blocks(path, 1 << 24, true, &mut |text| {
                    if let Some(w) = writer.as_mut() {
                        let room = options.bpe_sample_bytes.saturating_sub(sampled) as usize;
                        let take = match text.len() <= room {
                            true => text.len(),
                            // Whole lines only.
                            false => text[..room].rfind('\n').map_or(0, |i| i + 1),
                        };
                        std::io::Write::write_all(w, &text.as_bytes()[..take]).map_err(
                            |source| DataError::Write {
                                path: sample.clone(),
                                source,
                            },
                        )?;
                        sampled += take as u64;
                    }
                    Ok(())
                })?;
            }
            let trained = match writer {
                Some(w) => {
                    w.into_inner().map_err(|e| DataError::Write {
                        path: sample.clone(),
                        source: e.into_error(),
                    })?;
                    let trained = crate::bpe::train_bpe_unchecked(&[&sample], *vocab_size, &[]);
                    let _ = std::fs::remove_file(&sample);
                    trained?
                }
                None => crate::bpe::train_bpe_unchecked(&paths, *vocab_size, &[])?,
            };
            Tokenizer::Bpe(Box::new(trained))
        }
        TokenizerChoice::File(path) => Tokenizer::Bpe(Box::new(crate::bpe::load_bpe(path)?)),
        TokenizerChoice::Given(tokenizer) => tokenizer.clone(),
    };
    // A folder prepared before with the other kind of tokenizer keeps only this one's file.
    for stale in [crate::tokenizer::CHAR_FILE, crate::tokenizer::BPE_FILE] {
        let _ = std::fs::remove_file(options.out.join(stale));
    }
    tokenizer.save(&options.out)?;

    let started = Instant::now();
    let vocab = tokenizer.vocab_size() as u64;
    let mut writer = TokenWriter::create(&options.out, vocab, tokenizer_hash(&tokenizer))?;
    let threads = options.threads.max(1);
    let unknown_id = tokenizer.unknown_id();
    let (mut done, mut unknown) = (0u64, 0u64);
    for path in &paths {
        read_blocks(
            path,
            options.piece_bytes.max(1) * threads,
            true,
            &mut |text| {
                let encoded = encode_pieces(&tokenizer, text, threads)?;
                for ids in &encoded {
                    if let Some(u) = unknown_id {
                        unknown += ids.iter().filter(|&&i| i == u).count() as u64;
                    }
                    writer.write(ids)?;
                }
                done += text.len() as u64;
                progress(Progress {
                    stage: "tokens",
                    done,
                    total,
                });
                Ok(())
            },
        )?;
    }
    let header = writer.finish()?;
    Ok(Prepared {
        header,
        tokenizer,
        bytes: total,
        unknown,
        encode_secs: started.elapsed().as_secs_f64(),
    })
}

/// The files of `inputs` with their sizes: files as given, folders' files in name order. No
/// file, or an empty one, is an error naming it.
pub fn input_files(inputs: &[PathBuf]) -> Result<Vec<(PathBuf, u64)>> {
    let mut files = Vec::new();
    for input in inputs {
        let meta = std::fs::metadata(input).map_err(|source| DataError::Read {
            path: input.clone(),
            source,
        })?;
        if meta.is_dir() {
            let mut inside: Vec<PathBuf> = std::fs::read_dir(input)
                .map_err(|source| DataError::Read {
                    path: input.clone(),
                    source,
                })?
                .filter_map(|entry| entry.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect();
            inside.sort();
            if inside.is_empty() {
                return Err(DataError::Invalid(format!(
                    "{} holds no files to prepare",
                    input.display()
                )));
            }
            files.extend(inside);
        } else {
            files.push(input.clone());
        }
    }
    if files.is_empty() {
        return Err(DataError::Invalid("no input files to prepare".into()));
    }
    files
        .into_iter()
        .map(|path| {
            let size = std::fs::metadata(&path)
                .map_err(|source| DataError::Read {
                    path: path.clone(),
                    source,
                })?
                .len();
            match size {
                0 => Err(DataError::Empty { path }),
                _ => Ok((path, size)),
            }
        })
        .collect()
}

/// Calls `each` with consecutive blocks of `path`'s text of about `block` bytes, in order:
/// each ends on a character boundary, and where `at_words`, after a newline followed by a
/// character that is not whitespace (where one is in the block). Invalid UTF-8 is an error
/// naming the file, byte offset and line.
pub fn read_blocks(
    path: &Path,
    block: usize,
    at_words: bool,
    each: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<()> {
    let read_err = |source| DataError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(read_err)?;
    let mut buffer: Vec<u8> = Vec::with_capacity(block + 4);
    let (mut offset, mut line) = (0usize, 1usize);
    // The bytes to hold before cutting: a block, or more while none can be cut.
    let (mut want, mut eof) = (block, false);
    while !eof || !buffer.is_empty() {
        if !eof && buffer.len() < want {
            let before = buffer.len();
            buffer.resize(want, 0);
            let n = read_full(&mut file, &mut buffer[before..]).map_err(read_err)?;
            buffer.truncate(before + n);
            eof = before + n < want;
        }
        let valid = match std::str::from_utf8(&buffer) {
            Ok(_) => buffer.len(),
            // An incomplete character at the end of the block waits for the next read.
            Err(e) if e.error_len().is_none() && !eof => e.valid_up_to(),
            Err(e) => {
                let at = e.valid_up_to();
                return Err(DataError::InvalidUtf8 {
                    path: path.to_path_buf(),
                    offset: offset + at,
                    line: line + buffer[..at].iter().filter(|&&b| b == b'\n').count(),
                });
            }
        };
        let cut = match (at_words, eof) {
            (true, false) => word_boundary(&buffer[..valid]).unwrap_or(valid),
            _ => valid,
        };
        if cut == 0 {
            // Not one whole character yet: read more before cutting.
            want = buffer.len() + block;
            continue;
        }
        want = block;
        let text = std::str::from_utf8(&buffer[..cut]).expect("checked above");
        each(text)?;
        offset += cut;
        line += text.bytes().filter(|&b| b == b'\n').count();
        buffer.drain(..cut);
    }
    Ok(())
}

/// Fills `buf` from `file` as far as it goes; the bytes read (fewer only at the end).
fn read_full(file: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The last position in `text` (valid UTF-8) just after a newline whose next byte is not
/// whitespace: where a byte-level BPE's pre-tokenizer ends a word whatever follows.
fn word_boundary(text: &[u8]) -> Option<usize> {
    (1..text.len())
        .rev()
        .find(|&i| text[i - 1] == b'\n' && !text[i].is_ascii_whitespace())
}

/// `text`'s ids, encoded in about `threads` pieces cut at word boundaries, in order.
fn encode_pieces(tokenizer: &Tokenizer, text: &str, threads: usize) -> Result<Vec<Vec<u32>>> {
    let target = text.len().div_ceil(threads).max(1);
    let mut pieces = Vec::with_capacity(threads);
    let mut rest = text;
    while !rest.is_empty() {
        let cut = match rest.len() <= target {
            true => rest.len(),
            false => word_boundary(&rest.as_bytes()[..target]).unwrap_or(rest.len()),
        };
        pieces.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    if pieces.len() == 1 {
        return Ok(vec![encode_fast(tokenizer, pieces[0])?]);
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = pieces
            .iter()
            .map(|piece| scope.spawn(move || encode_fast(tokenizer, piece)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("an encoding worker panicked"))
            .collect()
    })
}

/// The ids of `text` (without the offsets a BPE's full encoding also computes).
fn encode_fast(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    match tokenizer {
        Tokenizer::Char(t) => Ok(t.encode(text).ids),
        Tokenizer::Bpe(t) => t
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| DataError::Tokenizer(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token_file::TokenFile;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ember-prepare-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn blocks(path: &Path, block: usize, at_words: bool) -> Vec<String> {
        let mut out = Vec::new();
        read_blocks(path, block, at_words, &mut |text| {
            out.push(text.to_string());
            Ok(())
        })
        .unwrap();
        out
    }

    /// Blocks of any size give the text back whole, never cut inside a character; at words,
    /// each block but the last ends after a newline before a word where it holds one.
    #[test]
    fn blocks_give_the_text_back_whole() {
        let dir = temp_dir("blocks");
        let text = "Ünïcødé ✓ 🦀 words\n  indented\nNext line\n\n\nafter blanks 🦀🦀\nend";
        let path = dir.join("t.txt");
        std::fs::write(&path, text).unwrap();
        for block in [1, 2, 3, 5, 7, 16, 64, 1000] {
            for at_words in [false, true] {
                let parts = blocks(&path, block, at_words);
                assert_eq!(parts.concat(), text, "block {block}, at words {at_words}");
                if at_words {
                    for part in &parts[..parts.len() - 1] {
                        let bytes = part.as_bytes();
                        let whole = word_boundary(bytes).is_none()
                            || word_boundary(&[bytes, b"x"].concat()) == Some(bytes.len());
                        assert!(whole, "block {block}: {part:?} ends inside a word");
                    }
                }
            }
        }
    }

    #[test]
    fn invalid_utf8_names_the_byte_and_line_across_blocks() {
        let dir = temp_dir("utf8");
        let path = dir.join("bad.txt");
        std::fs::write(&path, b"ab\ncd\xffef").unwrap();
        for block in [1, 2, 4, 100] {
            let err = read_blocks(&path, block, false, &mut |_| Ok(())).unwrap_err();
            assert!(
                matches!(
                    err,
                    DataError::InvalidUtf8 {
                        offset: 5,
                        line: 2,
                        ..
                    }
                ),
                "block {block}: {err}"
            );
        }
    }

    /// The prepared ids are those of the whole text encoded at once (char and byte-level BPE),
    /// however the text is cut into blocks and pieces.
    #[test]
    fn prepared_ids_are_the_whole_texts() {
        let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/tinyshakespeare.txt");
        let text: String = std::fs::read_to_string(&corpus)
            .unwrap()
            .chars()
            .take(120_000)
            .collect();
        let dir = temp_dir("ids");
        let input = dir.join("part.txt");
        std::fs::write(&input, &text).unwrap();
        for (name, choice) in [
            ("char", TokenizerChoice::Char),
            ("bpe", TokenizerChoice::Bpe(300)),
        ] {
            for (threads, piece_bytes) in [(1, PIECE_BYTES), (3, 5_000)] {
                let out = dir.join(format!("{name}-{threads}"));
                let options = PrepareOptions {
                    inputs: vec![input.clone()],
                    out: out.clone(),
                    tokenizer: choice.clone(),
                    threads,
                    piece_bytes,
                    bpe_sample_bytes: BPE_SAMPLE_BYTES,
                };
                let prepared = prepare(&options, &mut |_| {}).unwrap();
                let whole = prepared.tokenizer.encode(&text).unwrap().ids;
                let file = TokenFile::open(&out, &Tokenizer::load(&out).unwrap()).unwrap();
                let ids: Vec<u32> = (0..file.len()).map(|i| file.get(i)).collect();
                assert_eq!(ids.len(), whole.len(), "{name}, {threads} workers");
                assert!(ids == whole, "{name}, {threads} workers: other ids");
                assert_eq!(file.header.width, 2);
            }
        }
    }

    /// Past the sample size, the BPE learns from the inputs' first whole lines only; the sample
    /// is not left behind, and the ids are still the whole text's under the trained tokenizer.
    #[test]
    fn a_bpe_learns_from_a_sample_of_a_large_corpus() {
        let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/tinyshakespeare.txt");
        let text: String = std::fs::read_to_string(&corpus)
            .unwrap()
            .chars()
            .take(60_000)
            .collect();
        let dir = temp_dir("sample");
        let input = dir.join("part.txt");
        std::fs::write(&input, &text).unwrap();
        let out = dir.join("out");
        let options = PrepareOptions {
            inputs: vec![input],
            out: out.clone(),
            tokenizer: TokenizerChoice::Bpe(300),
            threads: 2,
            piece_bytes: PIECE_BYTES,
            bpe_sample_bytes: 10_000,
        };
        let prepared = prepare(&options, &mut |_| {}).unwrap();
        let names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        assert!(names.iter().all(|n| !n.contains("sample")), "{names:?}");
        let whole = prepared.tokenizer.encode(&text).unwrap().ids;
        let file = TokenFile::open(&out, &prepared.tokenizer).unwrap();
        assert_eq!(file.len(), whole.len());
        // Learned from 10 KB, the merges compress the whole text less than the text's own.
        let own = crate::bpe::train_bpe(&[&dir.join("part.txt")], 300, &[]).unwrap();
        let own = Tokenizer::Bpe(Box::new(own))
            .encode(&text)
            .unwrap()
            .ids
            .len();
        assert!(
            whole.len() > own,
            "{} tokens from the sample's BPE, {own} from the text's",
            whole.len()
        );
    }

    /// Preparing a folder again with the other kind of tokenizer leaves only the new one.
    #[test]
    fn a_folder_prepared_again_keeps_only_its_new_tokenizer() {
        let dir = temp_dir("again");
        let input = dir.join("t.txt");
        std::fs::write(
            &input,
            "First Citizen:\nBefore we proceed any further, hear me speak.\n".repeat(50),
        )
        .unwrap();
        let out = dir.join("out");
        for tokenizer in [
            TokenizerChoice::Char,
            TokenizerChoice::Bpe(260),
            TokenizerChoice::Char,
        ] {
            let options = PrepareOptions {
                inputs: vec![input.clone()],
                out: out.clone(),
                tokenizer,
                threads: 1,
                piece_bytes: PIECE_BYTES,
                bpe_sample_bytes: BPE_SAMPLE_BYTES,
            };
            let prepared = prepare(&options, &mut |_| {}).unwrap();
            let loaded = Tokenizer::load(&out).unwrap();
            assert_eq!(loaded.is_char(), prepared.tokenizer.is_char());
            TokenFile::open(&out, &loaded).unwrap();
        }
    }
}
