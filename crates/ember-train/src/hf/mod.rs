//! Hugging Face model folders in and out: `config.json`, `model.safetensors`, `tokenizer.json`,
//! of three layouts that are ember's decoder-only model: GPT-2 (`"gpt2"`, learned positions,
//! [`gpt2`]), GPT-NeoX (`"gpt_neox"`, rotary positions, [`neox`]) and Llama (`"llama"`, rotary
//! positions, RMSNorm, a gated MLP, grouped keys and values, [`llama`]). Here: which a folder
//! holds, and what they share (the tokenizer, the config's common keys, biases).

pub mod gpt2;
pub mod llama;
pub mod neox;
mod neox_layout;
mod shards;
mod tensors;
mod weights;

use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::tensor::Tensor;
use ember_data::Tokenizer;
use ember_data::hf_tokenizer::char_tokenizer_json;
use ember_model::{
    Activation, DecoderOnly, DecoderOnlyConfig, NormKind, PositionalKind, Rope, RopeScaling,
};

pub use gpt2::Gpt2Config;
pub use llama::LlamaConfig;
pub use neox::NeoxConfig;
pub use shards::HF_WEIGHTS_INDEX;

use crate::error::{Result, TrainError, write_err};

/// The model's hyper-parameters in a Hugging Face folder.
pub const HF_CONFIG: &str = "config.json";
/// The weights in a Hugging Face folder.
pub const HF_WEIGHTS: &str = "model.safetensors";
/// The tokenizer in a Hugging Face folder.
pub const HF_TOKENIZER: &str = "tokenizer.json";
/// How transformers should build the tokenizer.
pub const HF_TOKENIZER_CONFIG: &str = "tokenizer_config.json";

/// Does `dir` look like a Hugging Face model folder (rather than an ember run or checkpoint)?
/// Its weights are one `model.safetensors` or shards listed by `model.safetensors.index.json`.
pub fn is_hf_folder(dir: &Path) -> bool {
    dir.join(HF_CONFIG).is_file()
        && (dir.join(HF_WEIGHTS).is_file() || dir.join(HF_WEIGHTS_INDEX).is_file())
}

/// A Hugging Face folder whose weights are not in safetensors (PyTorch's pickle,
/// `pytorch_model.bin`, whole or in shards) is refused naming what it holds; any other folder
/// passes.
pub fn check_weights_format(dir: &Path) -> Result<()> {
    if !dir.join(HF_CONFIG).is_file() || is_hf_folder(dir) {
        return Ok(());
    }
    let holds = ["pytorch_model.bin", "pytorch_model.bin.index.json"]
        .into_iter()
        .find(|name| dir.join(name).exists());
    let Some(file) = holds else {
        return Ok(());
    };
    Err(TrainError::Checkpoint {
        path: dir.to_path_buf(),
        message: format!(
            "holds a Hugging Face model whose weights are in `{file}`; ember reads \
             safetensors, {HF_WEIGHTS} or shards listed by {HF_WEIGHTS_INDEX} (in Python: \
             `AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR)` writes them)"
        ),
    })
}

/// What of an ember run or checkpoint `dir` holds (`latest`, `checkpoints/`, `state.json`,
/// `model.bpk`), if any: such a folder and a Hugging Face model in one place leave unclear which
/// model `--checkpoint DIR` means.
pub fn ember_files(dir: &Path) -> Option<&'static str> {
    use crate::checkpoint::{CHECKPOINTS, LATEST, MODEL_FILE, STATE_FILE};
    [LATEST, CHECKPOINTS, STATE_FILE, MODEL_FILE]
        .into_iter()
        .find(|name| dir.join(name).exists())
}

/// transformers' LayerNorm epsilon where a config leaves it out (GPT-2's and GPT-NeoX's).
fn layer_norm_eps() -> f64 {
    1e-5
}

/// `true`, for a config key whose absence means yes.
fn yes() -> bool {
    true
}

/// The activation a Hugging Face config names under `key` (of the config file `path`).
fn activation(name: &str, key: &str, path: &Path) -> Result<Activation> {
    match name {
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Activation::GeluTanh),
        "gelu" => Ok(Activation::Gelu),
        "relu" => Ok(Activation::Relu),
        "silu" | "swish" => Ok(Activation::Silu),
        other => Err(TrainError::ConfigFile {
            path: path.to_path_buf(),
            message: format!("`{key}` is {other:?}; ember supports gelu_new, gelu, relu and silu"),
        }),
    }
}

/// The Hugging Face name of `activation`.
fn activation_name(activation: Activation) -> &'static str {
    match activation {
        Activation::GeluTanh => "gelu_new",
        Activation::Gelu => "gelu",
        Activation::Relu => "relu",
        Activation::Silu => "silu",
    }
}

/// GPT-2's and GPT-NeoX's block: LayerNorm, a plain MLP, a key and value per head. A model with
/// Llama's parts (RMSNorm, a gated MLP, grouped keys and values) would be written as another
/// model, and is refused naming the part.
fn classic_block(config: &DecoderOnlyConfig, layout: &str) -> std::result::Result<(), String> {
    let part = if config.norm != NormKind::LayerNorm {
        Some("RMSNorm (norm = \"rms_norm\")")
    } else if config.gated_mlp {
        Some("a gated MLP (gated_mlp = true)")
    } else if config.n_kv_heads() != config.n_heads {
        Some("grouped keys and values (n_kv_heads)")
    } else {
        None
    };
    match part {
        Some(part) => Err(format!(
            "{layout} has none of Llama's parts, and this model has {part}{}",
            match config.positional {
                PositionalKind::Rotary => "",
                _ => "; Llama's layout takes rotary positions",
            }
        )),
        None => Ok(()),
    }
}

/// The rotation from either generation of transformers' keys: newer ones hold everything in
/// `rope_parameters` (`rope_type`, `rope_theta`, the scaling's settings), older ones the base in
/// `older_base` and a scaling in `older_scaling` (`rope_type` or `type`, its settings); the base
/// is 10000 where neither has one. Of the scalings, `linear` and Llama 3.1's `llama3` are read;
/// any other is refused naming the config file `path`.
fn rotation(
    parameters: Option<&serde_json::Value>,
    older_base: Option<f64>,
    older_scaling: Option<&serde_json::Value>,
    path: &Path,
) -> Result<Rope> {
    use serde_json::Value;
    let older = older_scaling.filter(|v| !v.is_null());
    let key = if parameters.is_some_and(|p| p.get("rope_type").is_some()) {
        "rope_parameters"
    } else {
        "rope_scaling"
    };
    let setting = |name: &str| {
        parameters
            .and_then(|p| p.get(name))
            .or_else(|| older.and_then(|v| v.get(name)))
    };
    let bad = |message: String| TrainError::ConfigFile {
        path: path.to_path_buf(),
        message: format!("`{key}` {message}"),
    };
    let base = parameters
        .and_then(|p| p.get("rope_theta"))
        .and_then(Value::as_f64)
        .or(older_base)
        .unwrap_or(10000.0);
    let kind = setting("rope_type")
        .or_else(|| setting("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let number = |name: &str| {
        setting(name)
            .and_then(Value::as_f64)
            .ok_or_else(|| bad(format!("asks for {kind:?} rotary scaling without `{name}`")))
    };
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: number("factor")?,
        }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_positions: number("original_max_position_embeddings")? as usize,
        }),
        other => {
            return Err(bad(format!(
                "asks for {other:?} rotary scaling; ember reads \"default\", \"linear\" and \
                 \"llama3\""
            )));
        }
    };
    if let Some(message) = scaling.and_then(RopeScaling::invalid) {
        return Err(bad(message));
    }
    Ok(Rope { base, scaling })
}

/// The dimensions of each `head`-wide head a rotation over the share `share` turns, as
/// transformers sizes them (`int(head_size * share)`); refused, naming the config's `key` in the
/// config file `path`, unless even and at least 2 (what ember's partial rotation turns).
fn turned_dims(share: f64, head: usize, key: &str, path: &Path) -> Result<usize> {
    let turned = (head as f64 * share) as usize;
    if !(share > 0.0 && share <= 1.0) || turned == 0 || !turned.is_multiple_of(2) {
        return Err(TrainError::ConfigFile {
            path: path.to_path_buf(),
            message: format!(
                "`{key}` is {share}: {turned} of each head's {head} dimensions, where ember turns \
                 an even number of them, at least 2"
            ),
        });
    }
    Ok(turned)
}

/// A rotation in both generations of transformers' keys, so that either reads it: newer ones'
/// `rope_parameters` (with `extra`'s entries, GPT-NeoX's `partial_rotary_factor`), and older
/// ones' `rope_scaling` (`None` for RoPE's own; the base is the caller's older key).
fn rotation_keys(
    rope: Rope,
    extra: &[(&str, serde_json::Value)],
) -> (serde_json::Value, Option<serde_json::Value>) {
    use serde_json::{Map, Value, json};
    let mut scaling = Map::new();
    let kind = match rope.scaling {
        None => "default",
        Some(RopeScaling::Linear { factor }) => {
            scaling.insert("factor".into(), json!(factor));
            "linear"
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_positions,
        }) => {
            scaling.insert("factor".into(), json!(factor));
            scaling.insert("low_freq_factor".into(), json!(low_freq_factor));
            scaling.insert("high_freq_factor".into(), json!(high_freq_factor));
            scaling.insert(
                "original_max_position_embeddings".into(),
                json!(original_max_positions),
            );
            "llama3"
        }
    };
    scaling.insert("rope_type".into(), json!(kind));
    let mut parameters = scaling.clone();
    parameters.insert("rope_theta".into(), json!(rope.base));
    for (name, value) in extra {
        parameters.insert((*name).into(), value.clone());
    }
    let older = rope.scaling.map(|_| Value::Object(scaling));
    (Value::Object(parameters), older)
}

/// `config`, read from the config file `path`, if it describes a valid model.
fn validated(config: DecoderOnlyConfig, path: &Path) -> Result<DecoderOnlyConfig> {
    config.validate().map_err(|e| TrainError::ConfigFile {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    Ok(config)
}

/// A folder's `config.json`, by its `model_type`.
#[derive(Debug, Clone)]
pub enum HfConfig {
    /// `"gpt2"` (or no `model_type`).
    Gpt2(Gpt2Config),
    /// `"gpt_neox"`.
    Neox(NeoxConfig),
    /// `"llama"`, `"mistral"`, `"qwen2"` or `"phi3"`.
    Llama(LlamaConfig),
}

fn read_config(dir: &Path) -> Result<HfConfig> {
    let path = dir.join(HF_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|e| TrainError::ConfigFile {
        path: path.clone(),
        message: format!("cannot read: {e}"),
    })?;
    let bad = |what: &str, e: serde_json::Error| TrainError::ConfigFile {
        path: path.clone(),
        message: format!("not a {what} config: {e}"),
    };
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad("JSON", e))?;
    match json.get("model_type").and_then(|t| t.as_str()) {
        Some(neox::MODEL_TYPE) => serde_json::from_value(json)
            .map(HfConfig::Neox)
            .map_err(|e| bad("GPT-NeoX", e)),
        Some(llama::MODEL_TYPE | llama::MISTRAL | llama::QWEN2 | llama::PHI3) => {
            serde_json::from_value(json)
                .map(HfConfig::Llama)
                .map_err(|e| bad("Llama", e))
        }
        Some("gpt2") | None => serde_json::from_value(json)
            .map(HfConfig::Gpt2)
            .map_err(|e| bad("GPT-2", e)),
        Some(other) => Err(TrainError::ConfigFile {
            path: path.clone(),
            message: format!(
                "`model_type` is {other:?}; ember reads GPT-2 (\"gpt2\"), GPT-NeoX \
                 (\"{}\"), Llama (\"{}\"), Mistral (\"{}\"), Qwen2 (\"{}\") and Phi-3 \
                 (\"{}\") models",
                neox::MODEL_TYPE,
                llama::MODEL_TYPE,
                llama::MISTRAL,
                llama::QWEN2,
                llama::PHI3
            ),
        }),
    }
}

impl HfConfig {
    fn to_ember(&self, path: &Path) -> Result<DecoderOnlyConfig> {
        match self {
            HfConfig::Gpt2(gpt2) => gpt2.to_ember(path),
            HfConfig::Neox(neox) => neox.to_ember(path),
            HfConfig::Llama(llama) => llama.to_ember(path),
        }
    }
}

/// The ids a Hugging Face folder `dir` ends its texts with: `eos_token_id` of its
/// `generation_config.json` and `config.json`, a number or a list (an instruction-tuned Llama
/// 3 ends a reply with `<|eot_id|>`, its text with `<|end_of_text|>`); none where the files
/// say none, or are not there (an ember checkpoint).
pub fn end_ids(dir: &Path) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for file in ["generation_config.json", HF_CONFIG] {
        let path = dir.join(file);
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| TrainError::ConfigFile {
                path: path.clone(),
                message: format!("not JSON: {e}"),
            })?;
        let listed = match &json["eos_token_id"] {
            serde_json::Value::Array(all) => all.clone(),
            one => vec![one.clone()],
        };
        let found = listed.iter().filter_map(|v| v.as_u64()).map(|id| id as u32);
        for id in found {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

/// The config, architecture and tokenizer of a GPT-2, GPT-NeoX or Llama folder.
pub fn open_hf(dir: &Path) -> Result<(HfConfig, DecoderOnlyConfig, Tokenizer)> {
    let hf_config = read_config(dir)?;
    let model_config = hf_config.to_ember(&dir.join(HF_CONFIG))?;
    let tokenizer_path = dir.join(HF_TOKENIZER);
    if !tokenizer_path.is_file() {
        return Err(TrainError::Checkpoint {
            path: dir.to_path_buf(),
            message: format!("has no {HF_TOKENIZER}"),
        });
    }
    let tokenizer = Tokenizer::Bpe(Box::new(ember_data::bpe::load_bpe(&tokenizer_path)?));
    Ok((hf_config, model_config, tokenizer))
}

/// Reads the weights of Hugging Face folder `dir` (whose config is `hf_config`) into `model`,
/// built from `config`: the folder's architecture, perhaps with another context or dropout.
/// Every tensor of the model must be there, with its shape.
pub(crate) fn load_weights(
    model: DecoderOnly,
    config: &DecoderOnlyConfig,
    hf_config: &HfConfig,
    dir: &Path,
) -> Result<DecoderOnly> {
    match hf_config {
        HfConfig::Gpt2(_) => {
            let path = dir.join(HF_WEIGHTS);
            if !path.is_file() {
                return Err(TrainError::Checkpoint {
                    path: dir.join(HF_WEIGHTS_INDEX),
                    message: format!(
                        "holds GPT-2's weights in shards; ember reads GPT-2's from one \
                         {HF_WEIGHTS} (in Python: `AutoModelForCausalLM.from_pretrained(DIR)\
                         .save_pretrained(DIR, max_shard_size=\"100GB\")` writes it)"
                    ),
                });
            }
            gpt2::load_weights(model, &path)
        }
        HfConfig::Neox(neox) => {
            neox::load_weights(model, config, neox, &shards::WeightFiles::open(dir)?)
        }
        HfConfig::Llama(llama) => {
            llama::load_weights(model, config, llama, &shards::WeightFiles::open(dir)?)
        }
    }
}

/// Writes `model` (of architecture `config`, with `tokenizer`, read from checkpoint `source`) as
/// a Hugging Face folder in `out`, GPT-2 for learned positions, GPT-NeoX for rotary ones, Llama
/// for rotary ones with any of Llama's parts (RMSNorm, a gated MLP, grouped keys and values):
/// `config.json`, `model.safetensors` (biases of a bias-free model written as zeros),
/// `tokenizer.json` (a char vocabulary becomes a word-level tokenizer over single characters)
/// and `tokenizer_config.json`. [`LoadedLm::export_hf`] is the usual door.
///
/// [`LoadedLm::export_hf`]: crate::LoadedLm::export_hf
pub fn export_hf(
    model: &DecoderOnly,
    config: &DecoderOnlyConfig,
    tokenizer: &Tokenizer,
    source: &Path,
    out: &Path,
) -> Result<PathBuf> {
    let unsupported = |layout: &str, message: String| TrainError::Checkpoint {
        path: source.to_path_buf(),
        message: format!("cannot be exported as {layout}: {message}"),
    };
    let llama = config.positional == PositionalKind::Rotary
        && (config.norm != NormKind::LayerNorm
            || config.gated_mlp
            || config.n_kv_heads() != config.n_heads);
    let (hf_config, architecture) = match config.positional {
        PositionalKind::Rotary if llama => (
            LlamaConfig::from_ember(config)
                .map(|c| serde_json::to_value(c).expect("the config serializes"))
                .map_err(|m| unsupported("Llama", m))?,
            "LlamaForCausalLM",
        ),
        PositionalKind::Rotary => (
            NeoxConfig::from_ember(config)
                .map(|c| serde_json::to_value(c).expect("the config serializes"))
                .map_err(|m| unsupported("GPT-NeoX", m))?,
            "GPTNeoXForCausalLM",
        ),
        PositionalKind::Learned => (
            Gpt2Config::from_ember(config)
                .map(|c| serde_json::to_value(c).expect("the config serializes"))
                .map_err(|m| unsupported("GPT-2", m))?,
            "GPT2LMHeadModel",
        ),
        other => {
            return Err(unsupported(
                "a Hugging Face model",
                format!(
                    "its positions are {other:?}; GPT-2 has learned ones and GPT-NeoX rotary \
                     ones (positional = \"learned\" or \"rotary\")"
                ),
            ));
        }
    };
    if let Some(file) = ember_files(out) {
        return Err(write_err(
            out,
            format!(
                "holds an ember run or checkpoint (`{file}`); the Hugging Face files written there \
                 would be what --checkpoint loads from it instead: export to a folder of its own"
            ),
        ));
    }
    std::fs::create_dir_all(out).map_err(|e| write_err(out, e))?;

    let weights = out.join(HF_WEIGHTS);
    match config.positional {
        // Llama's biases are all there or all absent, as ember's are.
        PositionalKind::Rotary if llama => llama::write_weights(model, config, &weights)?,
        PositionalKind::Rotary => {
            neox::write_weights(&with_biases(model.clone()), config, &weights)?
        }
        _ => gpt2::write_weights(&with_biases(model.clone()), &weights)?,
    }

    // GPT2Config's defaults name token 50256 as BOS/EOS; say which token is, if any.
    let eos = match tokenizer {
        Tokenizer::Char(_) => None,
        Tokenizer::Bpe(bpe) => ["<|endoftext|>", "<eos>", "</s>"]
            .iter()
            .find_map(|t| bpe.token_to_id(t)),
    };
    let mut config = hf_config;
    config["bos_token_id"] = serde_json::json!(eos);
    config["eos_token_id"] = serde_json::json!(eos);
    config["architectures"] = serde_json::json!([architecture]);
    config["torch_dtype"] = "float32".into();
    config["exported_by"] = format!("ember {}", env!("CARGO_PKG_VERSION")).into();
    let config_path = out.join(HF_CONFIG);
    let text = serde_json::to_string_pretty(&config).expect("JSON serializes");
    std::fs::write(&config_path, text).map_err(|e| write_err(&config_path, e))?;

    let tokenizer_path = out.join(HF_TOKENIZER);
    match tokenizer {
        Tokenizer::Char(chars) => std::fs::write(&tokenizer_path, char_tokenizer_json(chars))
            .map_err(|e| write_err(&tokenizer_path, e))?,
        Tokenizer::Bpe(bpe) => ember_data::bpe::save_bpe(bpe, &tokenizer_path)?,
    }
    // Without this, transformers rebuilds a GPT-2 byte-level tokenizer from the model type
    // instead of using tokenizer.json as it is.
    let mut settings = serde_json::json!({"tokenizer_class": "PreTrainedTokenizerFast"});
    if let Tokenizer::Char(_) = tokenizer {
        settings["unk_token"] = ember_data::hf_tokenizer::UNK_TOKEN.into();
    }
    // With an instruction-tuned model's chat template and end ids, where the source has them.
    crate::conversation::Conversation::of_folder(source)?.save_with(out, settings)?;
    Ok(out.to_path_buf())
}

/// `model` with every linear layer given a bias (zeros where it had none): GPT-2 has them all.
fn with_biases(mut model: DecoderOnly) -> DecoderOnly {
    fn fill(linear: &mut burn::nn::Linear) {
        if linear.bias.is_none() {
            let [_, out] = linear.weight.val().dims();
            let device = linear.weight.val().device();
            linear.bias = Some(Param::from_tensor(Tensor::zeros([out], &device)));
        }
    }
    for block in &mut model.blocks {
        fill(&mut block.attn.c_attn);
        fill(&mut block.attn.c_proj);
        fill(&mut block.mlp.c_fc);
        fill(&mut block.mlp.c_proj);
    }
    model
}
