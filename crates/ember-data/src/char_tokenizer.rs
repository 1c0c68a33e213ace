//! Character-level tokenizer: one id per distinct character of the training corpus, plus one
//! id for characters it never saw.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};

/// Text turned into ids, with the number of characters outside the vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// Token ids.
    pub ids: Vec<u32>,
    /// How many input characters mapped to the unknown id.
    pub unknown: usize,
}

/// A vocabulary of characters; id `i < chars.len()` is `chars[i]`, id `chars.len()` is unknown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CharTokenizer {
    chars: Vec<char>,
    index: HashMap<char, u32>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CharFile {
    kind: String,
    chars: String,
}

/// What an unknown id decodes to.
pub const UNKNOWN_CHAR: char = '\u{FFFD}';

impl CharTokenizer {
    /// The sorted distinct characters of `text`.
    pub fn from_text(text: &str) -> Self {
        let chars: std::collections::BTreeSet<char> = text.chars().collect();
        Self::from_chars(chars.into_iter().collect())
    }

    /// The vocabulary of `chars`, sorted and distinct (as [`Self::from_text`] makes it from the
    /// text they come from).
    pub fn from_sorted(chars: Vec<char>) -> Self {
        debug_assert!(chars.windows(2).all(|w| w[0] < w[1]), "sorted and distinct");
        Self::from_chars(chars)
    }

    fn from_chars(chars: Vec<char>) -> Self {
        let index = chars
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, i as u32))
            .collect();
        Self { chars, index }
    }

    /// Vocabulary size, the unknown id included.
    pub fn vocab_size(&self) -> usize {
        self.chars.len() + 1
    }

    /// The id characters outside the vocabulary map to.
    pub fn unknown_id(&self) -> u32 {
        self.chars.len() as u32
    }

    /// Ids of `text`, counting characters outside the vocabulary.
    pub fn encode(&self, text: &str) -> Encoded {
        let mut unknown = 0;
        let ids = text
            .chars()
            .map(|c| {
                self.index.get(&c).copied().unwrap_or_else(|| {
                    unknown += 1;
                    self.unknown_id()
                })
            })
            .collect();
        Encoded { ids, unknown }
    }

    /// Text of `ids`; the unknown id and ids out of range decode to U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&id| self.chars.get(id as usize).copied().unwrap_or(UNKNOWN_CHAR))
            .collect()
    }

    /// The text of one id, for labels (`None` for unknown or out of range).
    pub fn token(&self, id: u32) -> Option<String> {
        self.chars.get(id as usize).map(|c| c.to_string())
    }

    /// Writes the vocabulary as JSON.
    pub fn save(&self, path: &Path) -> Result<()> {
        let file = CharFile {
            kind: "char".into(),
            chars: self.chars.iter().collect(),
        };
        let json = serde_json::to_string_pretty(&file).expect("a string always serializes");
        std::fs::write(path, json).map_err(|source| DataError::Write {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Reads a vocabulary written by [`save`](Self::save).
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::corpus::read_text(path)?;
        let bad = |message: String| DataError::BadTokenizer {
            path: path.to_path_buf(),
            message,
        };
        let file: CharFile = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if file.kind != "char" {
            return Err(bad(format!("kind is {:?}, expected \"char\"", file.kind)));
        }
        let chars: Vec<char> = file.chars.chars().collect();
        let mut sorted = chars.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted != chars {
            return Err(bad("characters must be sorted and distinct".into()));
        }
        Ok(Self::from_chars(chars))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_known_text() {
        let tok = CharTokenizer::from_text("hello world\n");
        assert_eq!(tok.vocab_size(), 10); // "\n dehlorw" + unknown
        let text = "low lord\nhe";
        let enc = tok.encode(text);
        assert_eq!(enc.unknown, 0);
        assert_eq!(tok.decode(&enc.ids), text);
        // Sorted vocabulary: '\n' < ' ' < 'd' < ...
        assert_eq!(tok.encode("\n d").ids, vec![0, 1, 2]);
    }

    #[test]
    fn unknown_characters_are_counted_not_fatal() {
        let tok = CharTokenizer::from_text("abc");
        let enc = tok.encode("abxcé");
        assert_eq!(enc.unknown, 2);
        assert_eq!(enc.ids, vec![0, 1, 3, 2, 3]);
        assert_eq!(tok.decode(&enc.ids), "ab\u{FFFD}c\u{FFFD}");
        // Out-of-range ids never panic.
        assert_eq!(tok.decode(&[0, 99, u32::MAX]), "a\u{FFFD}\u{FFFD}");
    }

    #[test]
    fn save_and_load_round_trip() {
        let dir = std::env::temp_dir().join(format!("ember-char-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("chars.json");
        let tok = CharTokenizer::from_text("To be, or not to be: that is the question.\n");
        tok.save(&path).unwrap();
        assert_eq!(CharTokenizer::load(&path).unwrap(), tok);
        std::fs::write(&path, "{\"kind\": \"char\", \"chars\": \"ba\"}").unwrap();
        let err = CharTokenizer::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("chars.json") && err.contains("sorted"),
            "{err}"
        );
    }
}
