//! A prepared corpus (`ember prepare`) trains exactly as its text does: the same ids, the same
//! batches, the same parameters; a run on it resumes bit for bit, and `eval --split` reads it.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use ember_data::prepare::{PIECE_BYTES, PrepareOptions, TokenizerChoice, prepare};
use ember_train::task::Split;
use ember_train::{Launch, RunConfig, load_lm, train_lm};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-prepared-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Weight init and dropout draw from Burn's process-wide RNG (see tests/train.rs).
fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn tiny(corpus: &Path) -> RunConfig {
    let mut config = RunConfig::load(&repo().join("configs/tiny.toml")).unwrap();
    config.data.path = corpus.to_path_buf();
    config.training.max_steps = 30;
    config.training.checkpoint_interval = 10;
    config.training.eval_interval = 30;
    config.model.dropout = 0.1;
    config
}

fn params(dir: &Path) -> Vec<f32> {
    let lm = load_lm(dir, &Device::flex()).unwrap();
    let mut out = Vec::new();
    struct Collect<'a>(&'a mut Vec<f32>);
    impl burn::module::ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            self.0.extend(p.val().try_into_vec_as::<f32>().unwrap());
        }
    }
    lm.model.visit(&mut Collect(&mut out));
    out
}

fn prepared(name: &str, tokenizer: TokenizerChoice) -> PathBuf {
    let out = out_dir(name);
    let options = PrepareOptions {
        inputs: vec![repo().join("data/tinyshakespeare.txt")],
        out: out.clone(),
        tokenizer,
        threads: 2,
        piece_bytes: PIECE_BYTES,
        bpe_sample_bytes: ember_data::prepare::BPE_SAMPLE_BYTES,
    };
    prepare(&options, &mut |_| {}).unwrap();
    out
}

#[test]
fn a_prepared_corpus_trains_and_resumes_as_its_text() {
    let _rng = rng_lock();
    let folder = prepared("char", TokenizerChoice::Char);
    let text = repo().join("data/tinyshakespeare.txt");

    let from_text = out_dir("from-text");
    let a = train_lm(tiny(&text), &Launch::new(&from_text)).unwrap();
    let from_tokens = out_dir("from-tokens");
    let b = train_lm(tiny(&folder), &Launch::new(&from_tokens)).unwrap();
    assert_eq!(a.val_loss, b.val_loss);
    assert_eq!(params(&from_text), params(&from_tokens), "other parameters");

    // Stopped at step 10 and 20, resumed: the same parameters as the whole run.
    let split = out_dir("resumed");
    for stop_after in [Some(10), Some(20), None] {
        let launch = Launch {
            resume: stop_after != Some(10),
            stop_after,
            ..Launch::new(&split)
        };
        train_lm(tiny(&folder), &launch).unwrap();
    }
    assert_eq!(
        params(&split),
        params(&from_tokens),
        "resumed parameters differ"
    );

    // `eval --split val` scores the prepared corpus's validation split as it does the text's.
    let lm = load_lm(&from_tokens, &Device::flex()).unwrap();
    let on_tokens = ember_train::eval::evaluate_split(&lm, Split::Val).unwrap();
    let lm = load_lm(&from_text, &Device::flex()).unwrap();
    let on_text = ember_train::eval::evaluate_split(&lm, Split::Val).unwrap();
    assert_eq!(on_tokens.tokens, on_text.tokens);
    assert!((on_tokens.loss - on_text.loss).abs() < 1e-9);
    for dir in [folder, from_text, from_tokens, split] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn a_bpe_run_on_its_prepared_corpus_matches_its_text() {
    let _rng = rng_lock();
    let folder = prepared("bpe", TokenizerChoice::Bpe(512));
    let text = repo().join("data/tinyshakespeare.txt");
    let bpe = |corpus: &Path| {
        let mut config = tiny(corpus);
        config.data.tokenizer = ember_train::config::TokenizerKind::Bpe;
        config.training.max_steps = 10;
        config.training.eval_interval = 10;
        config
    };
    let from_text = out_dir("bpe-text");
    let a = train_lm(bpe(&text), &Launch::new(&from_text)).unwrap();
    let from_tokens = out_dir("bpe-tokens");
    let b = train_lm(bpe(&folder), &Launch::new(&from_tokens)).unwrap();
    assert_eq!(a.val_loss, b.val_loss);
    assert_eq!(params(&from_text), params(&from_tokens), "other parameters");
    for dir in [folder, from_text, from_tokens] {
        let _ = std::fs::remove_dir_all(dir);
    }
}
