//! One tokenizer type for the rest of ember: character-level or BPE, saved beside a checkpoint
//! as `chars.json` or `tokenizer.json`.

use std::path::Path;

use crate::bpe::{load_bpe, save_bpe};
use crate::char_tokenizer::{CharTokenizer, Encoded};
use crate::error::{DataError, Result};

/// File name of a character vocabulary inside a checkpoint folder.
pub const CHAR_FILE: &str = "chars.json";
/// File name of a BPE tokenizer inside a checkpoint folder.
pub const BPE_FILE: &str = "tokenizer.json";

/// A character-level or BPE tokenizer.
#[derive(Debug, Clone)]
pub enum Tokenizer {
    /// One id per character.
    Char(CharTokenizer),
    /// Any Hugging Face tokenizer (byte-level BPE when ember trains it).
    Bpe(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// Vocabulary size, special and unknown tokens included.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Char(t) => t.vocab_size(),
            Tokenizer::Bpe(t) => t.get_vocab_size(true),
        }
    }

    /// Ids of `text` and the count of pieces outside the vocabulary.
    pub fn encode(&self, text: &str) -> Result<Encoded> {
        self.encode_with(text, false)
    }

    /// [`Tokenizer::encode`] of a prompt, with the special tokens the tokenizer's post-processor
    /// puts around one (Llama's and TinyLlama's `<s>` before it; nothing for GPT-2's, Pythia's
    /// or ember's own), as transformers' tokenizers encode a prompt for `generate`.
    pub fn encode_prompt(&self, text: &str) -> Result<Encoded> {
        self.encode_with(text, true)
    }

    fn encode_with(&self, text: &str, special: bool) -> Result<Encoded> {
        match self {
            Tokenizer::Char(t) => Ok(t.encode(text)),
            Tokenizer::Bpe(t) => {
                let enc = t
                    .encode(text, special)
                    .map_err(|e| DataError::Tokenizer(e.to_string()))?;
                let ids = enc.get_ids().to_vec();
                let unknown = self.unknown_count(&ids);
                Ok(Encoded { ids, unknown })
            }
        }
    }

    /// The id of text outside the vocabulary, if the tokenizer has one (a byte-level BPE has
    /// none: it can spell anything).
    pub fn unknown_id(&self) -> Option<u32> {
        match self {
            Tokenizer::Char(t) => Some(t.unknown_id()),
            Tokenizer::Bpe(t) => t.token_to_id("<unk>"),
        }
    }

    /// The id of the token that ends a text (GPT-2's `<|endoftext|>`, `</s>`, ...), if the
    /// tokenizer has one as a special token; generation stops there. Character tokenizers have
    /// none.
    pub fn end_of_text_id(&self) -> Option<u32> {
        match self {
            Tokenizer::Char(_) => None,
            Tokenizer::Bpe(t) => {
                let special: Vec<String> = t
                    .get_added_tokens_decoder()
                    .values()
                    .filter(|token| token.special)
                    .map(|token| token.content.clone())
                    .collect();
                [
                    "<|endoftext|>",
                    "<|end_of_text|>",
                    "</s>",
                    "<eos>",
                    "<|eos|>",
                ]
                .iter()
                .find(|name| special.iter().any(|s| s == *name))
                .and_then(|name| t.token_to_id(name))
            }
        }
    }

    /// The id of the token spelled `token` (a special token such as `<|im_end|>`), if the
    /// tokenizer has it; character tokenizers have none.
    pub fn id_of(&self, token: &str) -> Option<u32> {
        match self {
            Tokenizer::Char(_) => None,
            Tokenizer::Bpe(t) => t.token_to_id(token),
        }
    }

    /// How many of `ids` are the unknown id.
    pub fn unknown_count(&self, ids: &[u32]) -> usize {
        self.unknown_id()
            .map_or(0, |u| ids.iter().filter(|&&i| i == u).count())
    }

    /// Text of `ids`. Ids outside the vocabulary are skipped (BPE) or shown as U+FFFD (char);
    /// this never fails.
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tokenizer::Char(t) => t.decode(ids),
            Tokenizer::Bpe(t) => {
                // Per id, not against `get_vocab_size(true)`: that walks every added token on
                // each call (42k of them in a vocabulary padded to GPT-2's size), and streaming
                // decodes twice a token.
                let known: Vec<u32> = ids
                    .iter()
                    .copied()
                    .filter(|&i| t.id_to_token(i).is_some())
                    .collect();
                t.decode(&known, false).unwrap_or_default()
            }
        }
    }

    /// `true` for a character-level tokenizer (bits per character make sense for it).
    pub fn is_char(&self) -> bool {
        matches!(self, Tokenizer::Char(_))
    }

    /// A short description: "char (65 symbols)" or "bpe (512 tokens)".
    pub fn describe(&self) -> String {
        match self {
            Tokenizer::Char(t) => format!("char ({} symbols + unknown)", t.vocab_size() - 1),
            Tokenizer::Bpe(t) => format!("bpe ({} tokens)", t.get_vocab_size(true)),
        }
    }

    /// Saves into `dir` as `chars.json` or `tokenizer.json`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        match self {
            Tokenizer::Char(t) => t.save(&dir.join(CHAR_FILE)),
            Tokenizer::Bpe(t) => save_bpe(t, &dir.join(BPE_FILE)),
        }
    }

    /// The vocabulary, id by id (each token's text and a zero byte): what two tokenizers must
    /// share for the same ids to mean the same text.
    pub fn vocabulary_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::new();
        for id in 0..self.vocab_size() as u32 {
            let token = match self {
                Tokenizer::Char(t) => t.token(id),
                Tokenizer::Bpe(t) => t.id_to_token(id),
            };
            bytes.extend_from_slice(token.unwrap_or_default().as_bytes());
            bytes.push(0);
        }
        bytes
    }

    /// Loads the tokenizer saved in `dir` (either file name).
    pub fn load(dir: &Path) -> Result<Self> {
        let chars = dir.join(CHAR_FILE);
        if chars.exists() {
            return Ok(Tokenizer::Char(CharTokenizer::load(&chars)?));
        }
        let bpe = dir.join(BPE_FILE);
        if bpe.exists() {
            return Ok(Tokenizer::Bpe(Box::new(load_bpe(&bpe)?)));
        }
        Err(DataError::Invalid(format!(
            "no tokenizer in {}: expected {CHAR_FILE} or {BPE_FILE}",
            dir.display()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpe::train_bpe;

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ember-tok-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    const TEXT: &str =
        "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n";

    /// A prompt gets what the tokenizer's post-processor adds (here Llama's `<s>` template);
    /// a text to train on or score does not; ember's own BPE adds nothing to either.
    #[test]
    fn prompts_get_the_post_processor_s_special_tokens() {
        let dir = temp_dir("prompt");
        let corpus = dir.join("corpus.txt");
        std::fs::write(&corpus, TEXT.repeat(20)).unwrap();
        let ours = train_bpe(&[&corpus], 300, &["<s>"]).unwrap();
        let plain = Tokenizer::Bpe(Box::new(ours.clone()));
        assert_eq!(
            plain.encode_prompt("Speak").unwrap().ids,
            plain.encode("Speak").unwrap().ids
        );
        let bos = ours.token_to_id("<s>").unwrap();
        let template = tokenizers::processors::template::TemplateProcessing::builder()
            .try_single("<s> $A")
            .unwrap()
            .special_tokens(vec![("<s>", bos)])
            .build()
            .unwrap();
        let mut llama_like = ours;
        llama_like.with_post_processor(Some(template));
        let tok = Tokenizer::Bpe(Box::new(llama_like));
        let text = tok.encode("Speak").unwrap().ids;
        let prompt = tok.encode_prompt("Speak").unwrap().ids;
        assert_eq!(prompt[0], bos);
        assert_eq!(&prompt[1..], text.as_slice());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn bpe_trains_round_trips_and_reloads() {
        let dir = temp_dir("bpe");
        let corpus = dir.join("corpus.txt");
        std::fs::write(&corpus, TEXT.repeat(20)).unwrap();
        let tk = train_bpe(&[&corpus], 300, &["<pad>"]).unwrap();
        let tok = Tokenizer::Bpe(Box::new(tk));
        assert!(tok.vocab_size() <= 300 && tok.vocab_size() > 257);
        for text in [
            TEXT,
            "unseen words: zebra, ünïcødé ✓ 🦀",
            " leading space",
            "",
        ] {
            let enc = tok.encode(text).unwrap();
            assert_eq!(enc.unknown, 0);
            assert_eq!(tok.decode(&enc.ids), text, "round trip of {text:?}");
        }
        // Merges were learned: the corpus takes fewer tokens than bytes.
        assert!(tok.encode(TEXT).unwrap().ids.len() < TEXT.len() / 2);
        tok.save(&dir).unwrap();
        let again = Tokenizer::load(&dir).unwrap();
        assert_eq!(again.encode(TEXT).unwrap(), tok.encode(TEXT).unwrap());
        // Out-of-range ids never panic; added tokens are text like any other.
        assert_eq!(tok.decode(&[u32::MAX, 5_000_000]), "");
        let pad = tok.encode("<pad>").unwrap().ids;
        assert_eq!(pad.len(), 1);
        assert_eq!(tok.decode(&[pad[0], u32::MAX, pad[0]]), "<pad><pad>");
    }

    #[test]
    fn unknown_ids_are_counted_in_any_slice() {
        let tok = Tokenizer::Char(CharTokenizer::from_text(TEXT));
        let enc = tok.encode("Speak~ hear| me").unwrap();
        assert_eq!(enc.unknown, 2);
        assert_eq!(tok.unknown_count(&enc.ids), 2);
        assert_eq!(tok.unknown_count(&enc.ids[..6]), 1);
        assert_eq!(tok.unknown_count(&enc.ids[7..]), 1);
        assert_eq!(tok.unknown_count(&enc.ids[..5]), 0);
    }

    #[test]
    fn char_tokenizer_saves_and_loads_through_the_enum() {
        let dir = temp_dir("char");
        let tok = Tokenizer::Char(CharTokenizer::from_text(TEXT));
        tok.save(&dir).unwrap();
        let again = Tokenizer::load(&dir).unwrap();
        assert!(again.is_char());
        assert_eq!(again.encode("Speak").unwrap(), tok.encode("Speak").unwrap());
    }

    #[test]
    fn too_small_bpe_vocabulary_is_an_error() {
        let dir = temp_dir("small");
        let corpus = dir.join("corpus.txt");
        std::fs::write(&corpus, TEXT).unwrap();
        let err = train_bpe(&[&corpus], 100, &[]).unwrap_err().to_string();
        assert!(err.contains("vocab_size = 100"), "{err}");
    }
}
