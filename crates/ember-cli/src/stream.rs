//! Printing generated text as it comes, holding back only what might be the start of the stop
//! string or half of a multi-byte character.

use std::io::Write;

use ember_data::Tokenizer;

/// Decodes generated ids incrementally and writes the new text to stdout.
pub struct Stream<'a> {
    tokenizer: &'a Tokenizer,
    stop: Option<&'a str>,
    ids: Vec<u32>,
    printed: usize,
    /// The full text, cut at the stop string if it appeared.
    pub text: String,
}

impl<'a> Stream<'a> {
    pub fn new(tokenizer: &'a Tokenizer, stop: Option<&'a str>) -> Self {
        Self {
            tokenizer,
            stop: stop.filter(|s| !s.is_empty()),
            ids: Vec::new(),
            printed: 0,
            text: String::new(),
        }
    }

    /// Adds a token; returns `false` once the stop string has appeared.
    pub fn push(&mut self, id: u32) -> bool {
        self.ids.push(id);
        self.text = self.tokenizer.decode(&self.ids);
        if let Some(stop) = self.stop
            && let Some(at) = self.text.find(stop)
        {
            self.text.truncate(at);
            self.emit(at);
            return false;
        }
        let mut safe = self.text.len();
        if self.text.ends_with('\u{FFFD}') && !self.tokenizer.is_char() {
            // Possibly the first bytes of a character the next token completes.
            safe -= '\u{FFFD}'.len_utf8();
        }
        if let Some(stop) = self.stop {
            safe = safe.min(self.text.len() - held_back(&self.text, stop));
        }
        self.emit(safe);
        true
    }

    /// Prints whatever is still held back.
    pub fn finish(&mut self) {
        self.emit(self.text.len());
    }

    fn emit(&mut self, upto: usize) {
        if upto > self.printed
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
    use super::held_back;

    #[test]
    fn holds_back_a_possible_start_of_the_stop_string() {
        assert_eq!(held_back("hello\n\n", "\n\n\n"), 2);
        assert_eq!(held_back("hello", "\n\n"), 0);
        assert_eq!(held_back("ROMEO: I", "I say"), 1);
    }
}
