//! Printing generated text as it comes, holding back only what might be the start of a stop
//! string or half of a multi-byte character.
//!
//! Each token is decoded together with the few tokens before it (Hugging Face's "prefix
//! offset" method), not with the whole text: a BPE token's text can depend on its neighbours
//! (a leading space, bytes of one character split over two tokens), and decoding everything
//! again per token made a long sample quadratic.

use std::io::Write;

use ember_data::Tokenizer;

/// Decodes generated ids incrementally and writes the new text to stdout.
pub struct Stream<'a> {
    tokenizer: &'a Tokenizer,
    stops: Vec<&'a str>,
    ids: Vec<u32>,
    /// `ids[prefix..read]` were decoded last time as context; `ids[read..]` are not text yet.
    prefix: usize,
    read: usize,
    printed: usize,
    /// Writes to stdout as text comes (off: the caller prints `text` at the end).
    printing: bool,
    /// The full text, cut at the first stop string if one appeared.
    pub text: String,
}

impl<'a> Stream<'a> {
    pub fn new(tokenizer: &'a Tokenizer, stops: &'a [String]) -> Self {
        Self {
            tokenizer,
            stops: stops
                .iter()
                .map(String::as_str)
                .filter(|s| !s.is_empty())
                .collect(),
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            printed: 0,
            printing: true,
            text: String::new(),
        }
    }

    /// A stream that only collects the text (a sample of a batch, printed whole at the end).
    pub fn silent(tokenizer: &'a Tokenizer, stops: &'a [String]) -> Self {
        Self {
            printing: false,
            ..Self::new(tokenizer, stops)
        }
    }

    /// The stream of a continuation of `prompt`: its last few tokens are the first decoding's
    /// context, so that the first generated token reads as it does after them (a SentencePiece
    /// decoder, Llama's, drops the leading space of a text's first word).
    pub fn after(mut self, prompt: &[u32]) -> Self {
        let context = &prompt[prompt.len().saturating_sub(4)..];
        self.ids = context.to_vec();
        self.read = context.len();
        self
    }

    /// Adds a token; returns `false` once a stop string has appeared.
    pub fn push(&mut self, id: u32) -> bool {
        self.ids.push(id);
        let searched_from = self.text.len();
        self.decode_new(false);
        if let Some(at) = self.first_stop(searched_from) {
            self.text.truncate(at);
            self.emit(at);
            return false;
        }
        let held = self
            .stops
            .iter()
            .map(|stop| held_back(&self.text, stop))
            .max()
            .unwrap_or(0);
        self.emit(self.text.len() - held);
        true
    }

    /// Prints whatever is still held back.
    pub fn finish(&mut self) {
        self.decode_new(true);
        self.emit(self.text.len());
    }

    /// Appends the text of the tokens not yet decoded, once it is whole (or anyway, at the end).
    fn decode_new(&mut self, last: bool) {
        let window = &self.ids[self.prefix..];
        let before = self.tokenizer.decode(&self.ids[self.prefix..self.read]);
        let now = self.tokenizer.decode(window);
        // A trailing U+FFFD may be the first bytes of a character the next token completes.
        let unfinished = now.ends_with('\u{FFFD}') && !self.tokenizer.is_char();
        if now.len() > before.len()
            && (last || !unfinished)
            && let Some(new) = now.get(before.len()..)
        {
            self.text.push_str(new);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
    }

    /// Where the earliest stop string starts, looking only at text that could hold one that
    /// was not there before `from`.
    fn first_stop(&self, from: usize) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|stop| {
                let mut start = from.saturating_sub(stop.len());
                while !self.text.is_char_boundary(start) {
                    start -= 1;
                }
                self.text[start..].find(stop).map(|at| start + at)
            })
            .min()
    }

    fn emit(&mut self, upto: usize) {
        if self.printing
            && upto > self.printed
            && self.text.is_char_boundary(upto)
            && self.text.is_char_boundary(self.printed)
        {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(&self.text.as_bytes()[self.printed..upto]);
            let _ = out.flush();
            self.printed = upto;
        }
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`.
fn held_back(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .find(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_a_possible_start_of_the_stop_string() {
        assert_eq!(held_back("hello\n\n", "\n\n\n"), 2);
        assert_eq!(held_back("hello", "\n\n"), 0);
        assert_eq!(held_back("ROMEO: I", "I say"), 1);
    }

    /// A byte-level BPE trained on a little text, so that tokens split words and characters.
    /// `test` names the folder: tests run in parallel threads of one process, and two of them
    /// writing one corpus file let one read it half-written.
    fn bpe(test: &str) -> Tokenizer {
        let dir = std::env::temp_dir().join(format!("ember-stream-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let corpus = dir.join("corpus.txt");
        std::fs::write(
            &corpus,
            "Grüße aus Köln, naïve café — the cat sat on the mat. ".repeat(40),
        )
        .unwrap();
        let tokenizer = ember_data::bpe::train_bpe(&[corpus.as_path()], 300, &[]).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        Tokenizer::Bpe(Box::new(tokenizer))
    }

    #[test]
    fn incremental_text_equals_decoding_everything_at_once() {
        let tokenizer = bpe("incremental");
        let text = "Grüße — the naïve cat sat on the mat in Köln.";
        let ids = tokenizer.encode(text).unwrap().ids;
        assert!(ids.len() > 10);
        let mut stream = Stream::new(&tokenizer, &[]);
        for &id in &ids {
            assert!(stream.push(id));
            assert!(
                tokenizer.decode(&ids).starts_with(&stream.text),
                "{:?} is not a prefix",
                stream.text
            );
        }
        stream.finish();
        assert_eq!(stream.text, tokenizer.decode(&ids));
        assert_eq!(stream.text, text);
    }

    /// Llama's SentencePiece decoding drops the leading space of a text's first word: a
    /// continuation decoded alone would glue its first word to the prompt.
    #[test]
    fn a_continuation_keeps_the_space_before_its_first_word() {
        let json = r#"{
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true},
            "post_processor": null,
            "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true},
            "model": {"type": "WordLevel", "vocab": {"▁the": 0, "▁cat": 1, "▁sat": 2, "<unk>": 3}, "unk_token": "<unk>"}
        }"#;
        let tokenizer = Tokenizer::Bpe(Box::new(json.parse().unwrap()));
        let ids = tokenizer.encode("the cat sat").unwrap().ids;
        assert_eq!(ids, [0, 1, 2]);
        assert_eq!(
            tokenizer.decode(&ids[2..]),
            "sat",
            "the decoder drops the space"
        );
        let mut stream = Stream::new(&tokenizer, &[]).after(&ids[..2]);
        assert!(stream.push(ids[2]));
        stream.finish();
        assert_eq!(stream.text, " sat");
    }

    #[test]
    fn the_first_of_several_stop_strings_ends_the_text() {
        let tokenizer = bpe("stops");
        let ids = tokenizer
            .encode("the cat sat on the mat. the cat")
            .unwrap()
            .ids;
        let stops = vec!["on the".to_string(), "sat".to_string()];
        let mut stream = Stream::new(&tokenizer, &stops);
        let pushed = ids.iter().take_while(|&&id| stream.push(id)).count();
        assert!(pushed < ids.len());
        assert_eq!(stream.text, "the cat ");
    }
}
