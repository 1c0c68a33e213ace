//! Property tests on arbitrary input: config parsing and checkpoint loading return an error
//! (or a valid result) for any text or bytes, never a panic. Bounded so CI stays fast.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use burn::tensor::Device;
use ember_train::{Launch, RunConfig, load_lm, train_lm};
use proptest::prelude::*;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A checkpoint folder of a two-step run, made once.
fn checkpoint() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let mut config = RunConfig::load(&repo().join("configs/tiny.toml")).unwrap();
        config.data.path = repo().join("data/tinyshakespeare.txt");
        config.training.max_steps = 2;
        config.training.eval_batches = 1;
        let out = std::env::temp_dir().join(format!("ember-fuzz-run-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        train_lm(config, &Launch::new(&out)).unwrap();
        ember_train::checkpoint::resolve(&out).unwrap()
    })
}

/// A copy of the checkpoint with `file` replaced by `bytes`, loaded. Must not panic.
fn load_with(file: &str, bytes: &[u8]) -> Result<(), String> {
    static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ember-fuzz-ckpt-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(checkpoint()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    std::fs::write(dir.join(file), bytes).unwrap();
    let result = load_lm(&dir, &Device::flex())
        .map(|_| ())
        .map_err(|e| e.to_string());
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Lines a config might plausibly hold, with values of every kind.
fn config_line() -> impl Strategy<Value = String> {
    let keys = prop::sample::select(vec![
        "d_model",
        "n_heads",
        "n_layers",
        "context_len",
        "max_positions",
        "dropout",
        "positional",
        "lr",
        "batch_size",
        "max_steps",
        "warmup_steps",
        "grad_clip",
        "schedule",
        "path",
        "tokenizer",
        "task",
    ]);
    let values = prop_oneof![
        any::<i64>().prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| format!("{v:?}")),
        Just("nan".to_string()),
        Just("-inf".to_string()),
        "[a-z\"]{0,8}".prop_map(|s| format!("\"{s}\"")),
        "\\PC{0,10}",
    ];
    (keys, values).prop_map(|(k, v)| format!("{k} = {v}"))
}

fn config_text() -> impl Strategy<Value = String> {
    let section = prop::sample::select(vec!["[model]", "[data]", "[training]", ""]);
    prop::collection::vec((section, config_line()), 0..6).prop_map(|lines| {
        lines
            .into_iter()
            .map(|(s, l)| format!("{s}\n{l}\n"))
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn config_parsing_takes_any_text(text in "\\PC{0,200}") {
        let _ = RunConfig::parse(&text);
    }

    #[test]
    fn config_parsing_takes_any_values(text in config_text()) {
        if let Ok(config) = RunConfig::parse(&text) {
            // Whatever parses has been validated: the schedule and model sizes are usable.
            prop_assert!(config.training.lr.is_finite() && config.training.lr > 0.0);
            prop_assert!(config.model.d_model % config.model.n_heads == 0);
            prop_assert!(config.model.context_len <= config.model.max_positions());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn weights_file_of_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..2000)) {
        prop_assert!(load_with("model.bpk", &bytes).is_err());
    }

    #[test]
    fn weights_file_damaged_anywhere(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = std::fs::read(checkpoint().join("model.bpk")).unwrap();
        // Most edits land in the header and metadata, where a damaged file is most dangerous.
        let head = bytes.len().min(2048);
        for (at, value) in edits {
            let i = at.index(head);
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        let _ = load_with("model.bpk", &bytes);
    }

    #[test]
    fn state_config_and_vocabulary_of_any_text(
        which in prop::sample::select(vec!["state.json", "config.toml", "chars.json"]),
        text in "\\PC{0,300}",
    ) {
        prop_assert!(load_with(which, text.as_bytes()).is_err());
    }
}
