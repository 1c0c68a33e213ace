//! Hugging Face GPT-2 interop against a fixture made by `scripts/make-gpt2-fixture.py` with
//! `transformers`: ember's logits and greedy tokens equal the ones transformers computed, and
//! export -> import gives back identical logits.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use ember_infer::{GenerateOptions, Sampling, generate};

use ember_train::{LoadedLm, load_lm};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-gpt2")
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-hf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

struct Expected {
    prompt: String,
    input_ids: Vec<u32>,
    logits: Vec<f32>,
    greedy_ids: Vec<u32>,
}

fn expected() -> Expected {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        json[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    Expected {
        prompt: json["prompt"].as_str().unwrap().to_string(),
        input_ids: ids("input_ids"),
        logits: json["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect(),
        greedy_ids: ids("greedy_ids"),
    }
}

/// Logits `[T * V]` of `ids` as one sequence.
fn logits(lm: &LoadedLm, ids: &[u32]) -> Vec<f32> {
    let device = Device::flex();
    let data = TensorData::new(
        ids.iter().map(|&i| i as i64).collect::<Vec<_>>(),
        [1, ids.len()],
    );
    let tokens = Tensor::<2, Int>::from_data(data, &device);
    lm.model.forward(tokens).try_into_vec_as::<f32>().unwrap()
}

fn greedy(lm: &LoadedLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let options = GenerateOptions {
        max_new_tokens: n,
        sampling: Sampling {
            greedy: true,
            ..Sampling::default()
        },
        seed: 0,
        use_cache: true,
        context_len: lm.config.model.context_len,
    };
    generate(&lm.model, prompt, &options, |_| true)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn transformers_logits_and_greedy_tokens_are_reproduced() {
    let want = expected();
    let lm = load_lm(&fixture(), &Device::flex()).unwrap();
    let ids = lm.tokenizer.encode(&want.prompt).unwrap().ids;
    assert_eq!(
        ids, want.input_ids,
        "the tokenizer.json encodes as in Python"
    );
    let diff = max_diff(&logits(&lm, &ids), &want.logits);
    eprintln!("largest logit difference from transformers: {diff:e}");
    assert!(diff < 1e-4, "logits differ from transformers. by {diff}");
    assert_eq!(greedy(&lm, &ids, want.greedy_ids.len()), want.greedy_ids);
}

#[test]
fn export_then_import_gives_identical_logits() {
    let want = expected();
    let lm = load_lm(&fixture(), &Device::flex()).unwrap();
    let out = temp("roundtrip");
    lm.export_hf(&out).unwrap();
    let again = load_lm(&out, &Device::flex()).unwrap();
    assert_eq!(
        logits(&lm, &want.input_ids),
        logits(&again, &want.input_ids)
    );
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn a_bias_free_char_model_exports_with_zero_biases_and_its_vocabulary() {
    let device = Device::flex();
    let config = ember_model::DecoderOnlyConfig {
        vocab_size: 12,
        d_model: 16,
        n_heads: 2,
        n_layers: 2,
        context_len: 16,
        bias: false,
        ..Default::default()
    };
    let chars = ember_data::CharTokenizer::from_text("abc def\nghi");
    assert_eq!(chars.vocab_size(), 12);
    let lm = LoadedLm {
        model: config.init(&device).unwrap(),
        tokenizer: ember_data::Tokenizer::Char(chars),
        config: ember_train::RunConfig {
            model: config,
            ..Default::default()
        },
        dir: PathBuf::from("in-memory"),
        step: 0,
    };
    let out = temp("char");
    lm.export_hf(&out).unwrap();
    let again = load_lm(&out, &device).unwrap();
    let text = "bad cab\nfig";
    let ids = lm.tokenizer.encode(text).unwrap().ids;
    assert_eq!(again.tokenizer.encode(text).unwrap().ids, ids);
    assert_eq!(again.tokenizer.decode(&ids), text);
    let diff = max_diff(&logits(&lm, &ids), &logits(&again, &ids));
    assert!(diff == 0.0, "logits differ by {diff}");
    let _ = std::fs::remove_dir_all(out);
}

/// A copy of the fixture with `config.json` edited.
fn with_config(name: &str, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let dir = temp(name);
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture().join(file), dir.join(file)).unwrap();
    }
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    dir
}

fn load_error(dir: &Path) -> String {
    match load_lm(dir, &Device::flex()) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_and_misshaped_tensors_are_named() {
    let deeper = with_config("deeper", |c| c["n_layer"] = 3.into());
    let err = load_error(&deeper);
    assert!(
        err.contains("`transformer.h.2.") && err.contains("missing"),
        "{err}"
    );
    let wider = with_config("wider", |c| c["n_embd"] = 64.into());
    let err = load_error(&wider);
    assert!(
        err.contains("`transformer.wte.weight`")
            && err.contains("[300, 32]")
            && err.contains("[300, 64]"),
        "{err}"
    );
    let other = with_config("other", |c| c["activation_function"] = "swish".into());
    let err = load_error(&other);
    assert!(
        err.contains("activation_function") && err.contains("swish"),
        "{err}"
    );
    for dir in [deeper, wider, other] {
        let _ = std::fs::remove_dir_all(dir);
    }
}
