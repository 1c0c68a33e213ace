//! Property tests on arbitrary input: tokenizers and the corpus reader never panic, whatever
//! the bytes, ids or text; what they accept round-trips. Bounded so CI stays fast.

use std::path::PathBuf;
use std::sync::OnceLock;

use ember_data::bpe::train_bpe;
use ember_data::corpus::read_text;
use ember_data::{CharTokenizer, Tokenizer};
use proptest::prelude::*;

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-fuzz-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A byte-level BPE trained once on a little Shakespeare.
fn bpe() -> &'static Tokenizer {
    static BPE: OnceLock<Tokenizer> = OnceLock::new();
    BPE.get_or_init(|| {
        let corpus =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/tinyshakespeare.txt");
        let text: String = std::fs::read_to_string(corpus)
            .unwrap()
            .chars()
            .take(20_000)
            .collect();
        let path = temp("bpe").join("corpus.txt");
        std::fs::write(&path, text).unwrap();
        Tokenizer::Bpe(Box::new(train_bpe(&[&path], 300, &["<unk>"]).unwrap()))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn char_tokenizer_round_trips_its_own_text(vocab in ".{1,40}", text in ".{0,60}") {
        let tokenizer = CharTokenizer::from_text(&vocab);
        let encoded = tokenizer.encode(&text);
        prop_assert_eq!(encoded.ids.len(), text.chars().count());
        let outside = text.chars().filter(|c| !vocab.contains(*c)).count();
        prop_assert_eq!(encoded.unknown, outside);
        if outside == 0 {
            prop_assert_eq!(tokenizer.decode(&encoded.ids), text);
        }
    }

    #[test]
    fn char_decode_takes_any_ids(vocab in ".{1,20}", ids in prop::collection::vec(any::<u32>(), 0..50)) {
        let tokenizer = CharTokenizer::from_text(&vocab);
        prop_assert_eq!(tokenizer.decode(&ids).chars().count(), ids.len());
    }

    #[test]
    fn bpe_round_trips_any_text(text in "\\PC{0,80}") {
        let encoded = bpe().encode(&text).unwrap();
        prop_assert_eq!(bpe().decode(&encoded.ids), text);
    }

    #[test]
    fn bpe_decode_takes_any_ids(ids in prop::collection::vec(any::<u32>(), 0..50)) {
        let _ = bpe().decode(&ids);
    }

    #[test]
    fn corpus_reader_takes_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let path = temp("corpus").join(format!("{}.txt", bytes.len()));
        std::fs::write(&path, &bytes).unwrap();
        match (read_text(&path), std::str::from_utf8(&bytes)) {
            (Ok(text), Ok(expected)) => prop_assert_eq!(text, expected),
            (Err(e), Err(utf8)) => {
                let message = e.to_string();
                let offset = format!("offset {}", utf8.valid_up_to());
                prop_assert!(message.contains(&offset), "{}", message);
            }
            (Err(e), Ok(text)) => prop_assert!(text.is_empty(), "{}", e),
            (Ok(_), Err(_)) => prop_assert!(false, "invalid UTF-8 accepted"),
        }
    }
}
