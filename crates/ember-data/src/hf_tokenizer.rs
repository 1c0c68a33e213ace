//! A character vocabulary as a Hugging Face `tokenizer.json`, so that a char-level model
//! exported for `transformers` carries a tokenizer `AutoTokenizer` can load: a word-level model
//! over single characters (every character is its own pre-token), `<unk>` for the rest, and a
//! decoder that joins tokens without spaces.

use serde_json::{Map, Value, json};

use crate::char_tokenizer::CharTokenizer;

/// The unknown token's text in an exported char vocabulary.
pub const UNK_TOKEN: &str = "<unk>";

/// `tokenizer.json` text for `chars`: the same ids (`<unk>` is the last id), the same text.
pub fn char_tokenizer_json(chars: &CharTokenizer) -> String {
    let unk_id = chars.unknown_id();
    let mut vocab = Map::new();
    for id in 0..unk_id {
        let token = chars
            .token(id)
            .expect("ids below the unknown id are characters");
        vocab.insert(token, json!(id));
    }
    vocab.insert(UNK_TOKEN.into(), json!(unk_id));
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{
            "id": unk_id,
            "content": UNK_TOKEN,
            "single_word": false,
            "lstrip": false,
            "rstrip": false,
            "normalized": false,
            "special": true
        }],
        "normalizer": null,
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": "[\\s\\S]"},
            "behavior": "Isolated",
            "invert": false
        },
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": Value::Object(vocab), "unk_token": UNK_TOKEN}
    });
    serde_json::to_string_pretty(&tokenizer).expect("JSON values always serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hf_tokenizer_gives_the_char_ids_and_text() {
        let chars = CharTokenizer::from_text("First Citizen:\nBefore we proceed, hear me.");
        let hf: tokenizers::Tokenizer = char_tokenizer_json(&chars).parse().unwrap();
        assert_eq!(hf.get_vocab_size(true), chars.vocab_size());
        for text in ["First, hear me.\n\nBefore", "Zed \u{2603} we", " \n "] {
            let ours = chars.encode(text).ids;
            let theirs = hf.encode(text, false).unwrap().get_ids().to_vec();
            assert_eq!(theirs, ours, "{text:?}");
            let known: Vec<u32> = ours
                .iter()
                .copied()
                .filter(|&i| i != chars.unknown_id())
                .collect();
            assert_eq!(hf.decode(&known, true).unwrap(), chars.decode(&known));
        }
    }
}
