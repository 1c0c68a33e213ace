//! Hugging Face GPT-2 and GPT-NeoX interop against fixtures made by
//! `scripts/make-gpt2-fixture.py` with `transformers`: ember's logits and greedy tokens equal the
//! ones transformers computed, and export -> import gives back identical logits.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use ember_infer::{GenerateOptions, Sampling, generate};

use ember_train::{LoadedLm, load_lm};

fn fixture() -> PathBuf {
    fixture_named("tiny-gpt2")
}

/// The GPT-NeoX fixture: rotary positions (base 500), an untied head.
fn neox() -> PathBuf {
    fixture_named("tiny-neox")
}

/// A GPT-NeoX as Pythia's models are: attention and MLP side by side, 4 of each head's 16
/// dimensions rotated.
fn pythia() -> PathBuf {
    fixture_named("tiny-pythia")
}

/// A Llama made by transformers: RMSNorm, a gated SiLU MLP, 4 query heads sharing 2 key/value
/// heads, an untied head, no biases.
fn llama() -> PathBuf {
    fixture_named("tiny-llama")
}

/// A Qwen2 made by transformers: Llama's layout with biases on Q, K and V alone, a tied head.
fn qwen2() -> PathBuf {
    fixture_named("tiny-qwen2")
}

/// A Llama as Llama 3.2's are, made by transformers: a tied head, one key/value head for 4
/// query heads, base 500000 and the `llama3` stretch of the rotary frequencies.
fn llama3() -> PathBuf {
    fixture_named("tiny-llama3")
}

/// A Phi-3 made by transformers: Q, K and V in one matrix, gate and up in another, 4 query
/// heads sharing 2 key/value heads, half of each head rotated, an untied head.
fn phi3() -> PathBuf {
    fixture_named("tiny-phi3")
}

fn fixture_named(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
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

fn expected_of(fixture: &Path) -> Expected {
    let text = std::fs::read_to_string(fixture.join("expected.json")).unwrap();
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

/// The fixture's logits and greedy tokens, as transformers computed them, from ember.
fn reproduces_transformers(fixture: &Path) {
    let want = expected_of(fixture);
    let lm = load_lm(fixture, &Device::flex()).unwrap();
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
fn transformers_logits_and_greedy_tokens_are_reproduced() {
    reproduces_transformers(&fixture());
}

#[test]
fn transformers_gpt_neox_logits_and_greedy_tokens_are_reproduced() {
    reproduces_transformers(&neox());
    let lm = load_lm(&neox(), &Device::flex()).unwrap();
    let model = &lm.config.model;
    assert_eq!(model.positional, ember_model::PositionalKind::Rotary);
    assert_eq!((model.rotary_base, model.tie_weights), (500.0, false));
    assert_eq!((model.rotary_dims, model.parallel_blocks), (None, false));
}

#[test]
fn transformers_pythia_logits_and_greedy_tokens_are_reproduced() {
    reproduces_transformers(&pythia());
    let lm = load_lm(&pythia(), &Device::flex()).unwrap();
    let model = &lm.config.model;
    assert_eq!((model.rotary_dims, model.parallel_blocks), (Some(4), true));
}

#[test]
fn transformers_llama_logits_and_greedy_tokens_are_reproduced() {
    reproduces_transformers(&llama());
    let lm = load_lm(&llama(), &Device::flex()).unwrap();
    let model = &lm.config.model;
    assert_eq!(model.n_kv_heads, Some(2));
    assert_eq!(model.norm, ember_model::NormKind::RmsNorm);
    assert_eq!(model.activation, ember_model::Activation::Silu);
    assert!(model.gated_mlp && !model.tie_weights && !model.bias);
    assert_eq!((model.rotary_base, model.layer_norm_eps), (500.0, 1e-5));
}

#[test]
fn transformers_llama3_logits_and_greedy_tokens_are_reproduced() {
    use ember_model::RopeScaling;
    reproduces_transformers(&llama3());
    let lm = load_lm(&llama3(), &Device::flex()).unwrap();
    let model = &lm.config.model;
    let stretch = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_positions: 256,
    };
    assert_eq!(model.rotary_scaling, Some(stretch));
    assert_eq!((model.rotary_base, model.max_positions()), (500000.0, 2048));
    assert_eq!(model.n_kv_heads, Some(1));
    let want = expected_of(&llama3());
    // The hub's Llama 3 configs say it in transformers 4's keys: the same model.
    let older = with_config_of(&llama3(), "llama3-older", |c| {
        let mut scaling = c["rope_parameters"].clone();
        scaling.as_object_mut().unwrap().remove("rope_theta");
        c["rope_scaling"] = scaling;
        c["rope_theta"] = 500000.0.into();
        c.as_object_mut().unwrap().remove("rope_parameters");
    });
    let lm = load_lm(&older, &Device::flex()).unwrap();
    assert_eq!(lm.config.model.rotary_scaling, Some(stretch));
    assert!(max_diff(&logits(&lm, &want.input_ids), &want.logits) < 1e-4);
    let _ = std::fs::remove_dir_all(older);
    // Without the stretch the logits are another model's: the fixture tells them apart.
    let plain = with_config_of(&llama3(), "llama3-plain", |c| {
        c["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 500000.0});
    });
    let lm = load_lm(&plain, &Device::flex()).unwrap();
    let diff = max_diff(&logits(&lm, &want.input_ids), &want.logits);
    assert!(
        diff > 1e-2,
        "unstretched logits within {diff} of the stretched"
    );
    let _ = std::fs::remove_dir_all(plain);
}

#[test]
fn transformers_phi3_logits_and_greedy_tokens_are_reproduced() {
    reproduces_transformers(&phi3());
    let lm = load_lm(&phi3(), &Device::flex()).unwrap();
    let model = &lm.config.model;
    // Heads of 8, half of each turned; the fused matrices read as ember's own.
    assert_eq!((model.rotary_dims, model.n_kv_heads), (Some(4), Some(2)));
    assert!(model.gated_mlp && !model.tie_weights && !model.bias);
    // The older key of the share (transformers 4) says the same.
    let older = with_config_of(&phi3(), "phi3-older", |c| {
        let share = c["rope_parameters"]["partial_rotary_factor"].clone();
        c["rope_parameters"]
            .as_object_mut()
            .unwrap()
            .remove("partial_rotary_factor");
        c["partial_rotary_factor"] = share;
    });
    let want = expected_of(&phi3());
    let lm = load_lm(&older, &Device::flex()).unwrap();
    assert!(max_diff(&logits(&lm, &want.input_ids), &want.logits) < 1e-4);
    let _ = std::fs::remove_dir_all(older);
    // Llama's layout rotates whole heads: the export says so.
    let out = temp("phi3-export");
    let err = lm.export_hf(&out).unwrap_err().to_string();
    assert!(err.contains("rotary_dims"), "{err}");
    let _ = std::fs::remove_dir_all(out);
    let odd = with_config_of(&phi3(), "phi3-odd", |c| {
        c["rope_parameters"]["partial_rotary_factor"] = 0.375.into();
    });
    let err = load_error(&odd);
    assert!(
        err.contains("partial_rotary_factor") && err.contains("3 of each"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(odd);
}

#[test]
fn transformers_qwen2_logits_and_greedy_tokens_are_reproduced() {
    reproduces_transformers(&qwen2());
    let lm = load_lm(&qwen2(), &Device::flex()).unwrap();
    let model = &lm.config.model;
    // Every layer gets a bias (zeros where Qwen2 has none); the unused window bounds nothing.
    assert!(model.bias && model.tie_weights && model.gated_mlp);
    assert_eq!((model.n_kv_heads, model.max_positions()), (Some(2), 64));
}

/// Export, then import: the same logits, and the layout the fixture came in (Qwen2's exports as
/// Llama's, with every bias).
fn round_trip(fixture: &Path, architecture: &str, same_tensors: bool) {
    let want = expected_of(fixture);
    let lm = load_lm(fixture, &Device::flex()).unwrap();
    let out = temp(&format!("roundtrip-{architecture}"));
    lm.export_hf(&out).unwrap();
    let again = load_lm(&out, &Device::flex()).unwrap();
    assert_eq!(
        logits(&lm, &want.input_ids),
        logits(&again, &want.input_ids)
    );
    let config = std::fs::read_to_string(out.join("config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(config["architectures"][0], architecture);
    // The tensors' names and shapes are the fixture's (transformers' own files).
    let names = |dir: &Path| {
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<(String, Vec<usize>)> = file
            .tensors()
            .into_iter()
            .map(|(name, view)| (name, view.shape().to_vec()))
            .collect();
        names.sort();
        names
    };
    if same_tensors {
        assert_eq!(names(&out), names(fixture));
    }
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn export_then_import_gives_identical_logits() {
    round_trip(&fixture(), "GPT2LMHeadModel", false);
    round_trip(&neox(), "GPTNeoXForCausalLM", true);
    round_trip(&pythia(), "GPTNeoXForCausalLM", true);
    round_trip(&llama(), "LlamaForCausalLM", true);
    round_trip(&llama3(), "LlamaForCausalLM", true);
    round_trip(&qwen2(), "LlamaForCausalLM", false);
}

/// An ember model with no biases and a character vocabulary, the given positions, exported
/// and read back: the same tokens and logits.
fn bias_free_char_model_round_trip(positional: ember_model::PositionalKind) {
    char_model_round_trip(ember_model::DecoderOnlyConfig {
        bias: false,
        positional,
        ..char_model_config()
    });
}

/// The model of the character round trips: 2 blocks of width 16, 2 heads, 12 characters.
fn char_model_config() -> ember_model::DecoderOnlyConfig {
    ember_model::DecoderOnlyConfig {
        vocab_size: 12,
        d_model: 16,
        n_heads: 2,
        n_layers: 2,
        context_len: 16,
        ..Default::default()
    }
}

/// An ember model of `config` with a character vocabulary, exported and read back: the same
/// tokens, logits and config.
fn char_model_round_trip(config: ember_model::DecoderOnlyConfig) {
    let device = Device::flex();
    let positional = config.positional;
    let name = format!("char-{positional:?}-{:?}-{}", config.norm, config.bias);
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
    let out = temp(&name);
    lm.export_hf(&out).unwrap();
    let again = load_lm(&out, &device).unwrap();
    let text = "bad cab\nfig";
    let ids = lm.tokenizer.encode(text).unwrap().ids;
    assert_eq!(again.tokenizer.encode(text).unwrap().ids, ids);
    assert_eq!(again.tokenizer.decode(&ids), text);
    let diff = max_diff(&logits(&lm, &ids), &logits(&again, &ids));
    assert!(diff == 0.0, "logits differ by {diff}");
    assert_eq!(again.config.model.positional, positional);
    let (a, b) = (&lm.config.model, &again.config.model);
    assert_eq!(
        (a.norm, a.gated_mlp, a.n_kv_heads(), a.tie_weights),
        (b.norm, b.gated_mlp, b.n_kv_heads(), b.tie_weights)
    );
    // GPT-2 and GPT-NeoX have every bias (zeros where ember has none); Llama none or all.
    if a.norm == ember_model::NormKind::RmsNorm {
        assert_eq!(a.bias, b.bias);
    }
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn llama_shaped_char_models_export_as_llama_and_back() {
    // SmolLM's: a tied head; with biases everywhere; and grouped keys and values.
    for (bias, tie_weights, n_kv_heads) in [(false, true, None), (true, false, Some(1))] {
        char_model_round_trip(ember_model::DecoderOnlyConfig {
            positional: ember_model::PositionalKind::Rotary,
            norm: ember_model::NormKind::RmsNorm,
            gated_mlp: true,
            activation: ember_model::Activation::Silu,
            bias,
            tie_weights,
            n_kv_heads,
            ..char_model_config()
        });
    }
}

#[test]
fn a_bias_free_char_model_exports_with_zero_biases_and_its_vocabulary() {
    // GPT-2 for learned positions, GPT-NeoX (here with a tied head) for rotary ones, as the
    // default config's model is.
    bias_free_char_model_round_trip(ember_model::PositionalKind::Learned);
    bias_free_char_model_round_trip(ember_model::PositionalKind::Rotary);
}

/// A copy of the fixture with `config.json` edited.
fn with_config(name: &str, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    with_config_of(&fixture(), name, edit)
}

/// A copy of `fixture` with `config.json` edited.
fn with_config_of(fixture: &Path, name: &str, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let dir = temp(name);
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture.join(file), dir.join(file)).unwrap();
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
    let other = with_config("other", |c| c["activation_function"] = "mish".into());
    let err = load_error(&other);
    assert!(
        err.contains("activation_function") && err.contains("mish"),
        "{err}"
    );
    for dir in [deeper, wider, other] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A name, an edit of config.json, and what the error must say.
type Case = (
    &'static str,
    fn(&mut serde_json::Value),
    &'static [&'static str],
);

/// Each case's edit of `fixture`'s config.json fails to load, its message holding the needles.
fn each_is_refused(fixture: &Path, cases: &[Case]) {
    // The fixture's folder in the name: tests run in parallel threads of one process.
    let of = fixture.file_name().unwrap().to_string_lossy();
    for (name, edit, needles) in cases {
        let dir = with_config_of(fixture, &format!("refused-{of}-{name}"), edit);
        let err = load_error(&dir);
        for needle in needles.iter() {
            assert!(
                err.contains(needle),
                "{name}: {needle:?} missing from {err}"
            );
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn gpt_neox_variants_ember_lacks_are_named() {
    let cases: [Case; 6] = [
        (
            "odd",
            // 8 * 0.375: 3 dimensions of each head.
            |c| c["rope_parameters"]["partial_rotary_factor"] = 0.375.into(),
            &["rotary_pct", "0.375", "3 of each head's 8"],
        ),
        (
            "none",
            |c| c["rope_parameters"]["partial_rotary_factor"] = 0.1.into(),
            &["rotary_pct", "0 of each head's 8"],
        ),
        (
            "scaled",
            |c| c["rope_parameters"]["rope_type"] = "linear".into(),
            &["rope_parameters", "linear"],
        ),
        (
            "falcon",
            |c| c["model_type"] = "falcon".into(),
            &["model_type", "falcon", "mistral"],
        ),
        (
            "deeper",
            |c| c["num_hidden_layers"] = 3.into(),
            &["`gpt_neox.layers.2.", "missing"],
        ),
        (
            "wider-mlp",
            |c| c["intermediate_size"] = 128.into(),
            &["dense_h_to_4h.weight", "[96, 32]", "[128, 32]"],
        ),
    ];
    each_is_refused(&neox(), &cases);
    // The older keys (transformers 4) are read too.
    let older = with_config_of(&neox(), "neox-older", |c| {
        let base = c["rope_parameters"]["rope_theta"].clone();
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rotary_pct"] = 1.0.into();
        c["rotary_emb_base"] = base;
    });
    let want = expected_of(&neox());
    let lm = load_lm(&older, &Device::flex()).unwrap();
    assert!(max_diff(&logits(&lm, &want.input_ids), &want.logits) < 1e-4);
    let _ = std::fs::remove_dir_all(older);
}

#[test]
fn llama_variants_ember_lacks_are_named() {
    let cases: [Case; 7] = [
        (
            "yarn",
            |c| c["rope_parameters"]["rope_type"] = "yarn".into(),
            &["`rope_parameters`", "\"yarn\"", "\"llama3\""],
        ),
        (
            "llama3-unsaid",
            |c| c["rope_parameters"]["rope_type"] = "llama3".into(),
            &["`rope_parameters`", "llama3", "without `factor`"],
        ),
        (
            "older-stretch-backwards",
            |c| {
                c.as_object_mut().unwrap().remove("rope_parameters");
                c["rope_scaling"] = serde_json::json!({
                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0, "original_max_position_embeddings": 64
                });
            },
            &[
                "`rope_scaling`",
                "`high_freq_factor` (1)",
                "`low_freq_factor` (4)",
            ],
        ),
        (
            "head-dim",
            |c| c["head_dim"] = 16.into(),
            &["head_dim", "16", "8 wide"],
        ),
        (
            "attention-bias",
            |c| c["attention_bias"] = true.into(),
            &["`model.layers.0.self_attn.q_proj.bias`", "missing"],
        ),
        (
            "groups",
            |c| c["num_key_value_heads"] = 3.into(),
            &["n_kv_heads", "3"],
        ),
        (
            "fewer-groups",
            |c| c["num_key_value_heads"] = 1.into(),
            &["self_attn.k_proj.weight", "[16, 32]", "[8, 32]"],
        ),
    ];
    each_is_refused(&llama(), &cases);
    // Mistral's layout is Llama's; its sliding window bounds the positions the model takes,
    // within which the logits are transformers'.
    let mistral = with_config_of(&llama(), "mistral", |c| {
        c["model_type"] = "mistral".into();
        c["sliding_window"] = 16.into();
    });
    let lm = load_lm(&mistral, &Device::flex()).unwrap();
    assert_eq!(lm.config.model.max_positions(), 16);
    let want = expected_of(&llama());
    let vocab = want.logits.len() / want.input_ids.len();
    let first = logits(&lm, &want.input_ids[..16]);
    assert!(max_diff(&first, &want.logits[..16 * vocab]) < 1e-4);
    let _ = std::fs::remove_dir_all(mistral);
    // The older key of the rotation's base (transformers 4).
    let older = with_config_of(&llama(), "llama-older", |c| {
        c.as_object_mut().unwrap().remove("rope_parameters");
        c["rope_theta"] = 500.0.into();
    });
    let lm = load_lm(&older, &Device::flex()).unwrap();
    assert!(max_diff(&logits(&lm, &want.input_ids), &want.logits) < 1e-4);
    let _ = std::fs::remove_dir_all(older);
}

#[test]
fn models_without_a_hugging_face_layout_are_refused() {
    let base = ember_model::DecoderOnlyConfig {
        vocab_size: 12,
        d_model: 16,
        n_heads: 2,
        n_layers: 1,
        context_len: 8,
        ..Default::default()
    };
    let sinusoidal = ember_model::DecoderOnlyConfig {
        positional: ember_model::PositionalKind::Sinusoidal,
        ..base.clone()
    };
    refused(sinusoidal, &["Sinusoidal", "rotary"]);
    // Learned positions are GPT-2's, whose blocks are sequential.
    let parallel = ember_model::DecoderOnlyConfig {
        parallel_blocks: true,
        ..base.clone()
    };
    refused(parallel, &["GPT-2", "parallel_blocks"]);
    // Llama's parts go with rotary positions, and all of them together.
    let rms_learned = ember_model::DecoderOnlyConfig {
        norm: ember_model::NormKind::RmsNorm,
        ..base.clone()
    };
    refused(rms_learned, &["GPT-2", "RMSNorm", "rotary"]);
    let rms_rotary_plain_mlp = ember_model::DecoderOnlyConfig {
        norm: ember_model::NormKind::RmsNorm,
        positional: ember_model::PositionalKind::Rotary,
        ..base.clone()
    };
    refused(rms_rotary_plain_mlp, &["Llama", "gated_mlp"]);
    let partial = ember_model::DecoderOnlyConfig {
        norm: ember_model::NormKind::RmsNorm,
        gated_mlp: true,
        positional: ember_model::PositionalKind::Rotary,
        rotary_dims: Some(4),
        ..base
    };
    refused(partial, &["Llama", "rotary_dims"]);
}

/// The export of a model of `config` fails, its message holding `needles`.
fn refused(config: ember_model::DecoderOnlyConfig, needles: &[&str]) {
    let lm = LoadedLm {
        model: config.init(&Device::flex()).unwrap(),
        tokenizer: ember_data::Tokenizer::Char(ember_data::CharTokenizer::from_text(
            "abc def\nghi",
        )),
        config: ember_train::RunConfig {
            model: config,
            ..Default::default()
        },
        dir: PathBuf::from("in-memory"),
        step: 0,
    };
    let out = temp(&format!("refused-{}", needles[0]));
    let err = lm.export_hf(&out).unwrap_err().to_string();
    for needle in needles {
        assert!(err.contains(needle), "{needle:?} missing from {err}");
    }
    assert!(!out.join("model.safetensors").exists(), "nothing written");
    let _ = std::fs::remove_dir_all(out);
}

/// A copy of `fixture` with its weights stored in `dtype` (`f16` or `bf16`), as models on the
/// Hugging Face hub often are.
fn in_half_precision(fixture: &Path, dtype: burn::tensor::DType) -> PathBuf {
    let (stored, name) = match dtype {
        burn::tensor::DType::F16 => (safetensors::Dtype::F16, "f16"),
        _ => (safetensors::Dtype::BF16, "bf16"),
    };
    let dir = temp(&format!(
        "{}-{name}",
        fixture.file_name().unwrap().to_str().unwrap()
    ));
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(fixture.join(file), dir.join(file)).unwrap();
    }
    let bytes = std::fs::read(fixture.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let halves: Vec<(String, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = TensorData::from_bytes_vec(
                view.data().to_vec(),
                view.shape().to_vec(),
                burn::tensor::DType::F32,
            );
            let half = data.convert_dtype(dtype);
            (name, view.shape().to_vec(), half.as_bytes().to_vec())
        })
        .collect();
    let views = halves.iter().map(|(name, shape, raw)| {
        let view = safetensors::tensor::TensorView::new(stored, shape.clone(), raw).unwrap();
        (name.as_str(), view)
    });
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

/// Weights stored in `f16` or `bf16` load as `f32` (they ended in an internal error in a GPT-2
/// folder): the logits are the `f32` model's but for the stored values' rounding.
#[test]
fn half_precision_weights_load_as_f32() {
    for fixture in [fixture(), neox(), pythia(), llama()] {
        let want = expected_of(&fixture);
        for dtype in [burn::tensor::DType::F16, burn::tensor::DType::BF16] {
            let dir = in_half_precision(&fixture, dtype);
            let lm = load_lm(&dir, &Device::flex()).unwrap();
            let diff = max_diff(&logits(&lm, &want.input_ids), &want.logits);
            // Measured: about 5e-3 from f16's rounding, 4e-2 from bf16's.
            let tolerance = if dtype == burn::tensor::DType::F16 {
                0.02
            } else {
                0.2
            };
            eprintln!("{} in {dtype:?}: logits within {diff:e}", fixture.display());
            // (Not zero: the weights were rounded.)
            assert!(
                diff > 0.0 && diff < tolerance,
                "{} in {dtype:?}: {diff}",
                fixture.display()
            );
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A copy of `fixture` with its weights split as transformers splits a large model: the
/// tensors of layer 0 and the embedding in one shard, the rest in another, and
/// `model.safetensors.index.json` naming each tensor's shard.
fn in_shards(fixture: &Path, name: &str) -> PathBuf {
    let dir = temp(name);
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(fixture.join(file), dir.join(file)).unwrap();
    }
    let bytes = std::fs::read(fixture.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let shard_of = |tensor: &str| match tensor.contains("layers.0.") || tensor.contains("embed") {
        true => "model-00001-of-00002.safetensors",
        false => "model-00002-of-00002.safetensors",
    };
    let mut map = serde_json::Map::new();
    for shard in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        let views: Vec<_> = file
            .tensors()
            .into_iter()
            .filter(|(tensor, _)| shard_of(tensor) == shard)
            .collect();
        for (tensor, _) in &views {
            map.insert(tensor.clone(), shard.into());
        }
        safetensors::serialize_to_file(views, None, &dir.join(shard)).unwrap();
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    dir
}

/// Weights in shards load as from one file; a shard the index names but the folder lacks is
/// named.
#[test]
fn weights_in_shards_load() {
    for fixture in [llama(), neox()] {
        let of = fixture.file_name().unwrap().to_string_lossy().to_string();
        let dir = in_shards(&fixture, &format!("{of}-shards"));
        let want = expected_of(&fixture);
        let lm = load_lm(&dir, &Device::flex()).unwrap();
        let diff = max_diff(&logits(&lm, &want.input_ids), &want.logits);
        assert!(diff < 1e-4, "{of} in shards: logits differ by {diff}");
        std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
        let err = load_error(&dir);
        for needle in [
            "model.safetensors.index.json",
            "`model-00002-of-00002.safetensors`",
            "missing",
        ] {
            assert!(err.contains(needle), "{needle:?} missing from {err}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
    // GPT-2's are read from one file, and said so.
    let dir = in_shards(&fixture(), "gpt2-shards");
    let err = load_error(&dir);
    assert!(
        err.contains("in shards") && err.contains("model.safetensors"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
