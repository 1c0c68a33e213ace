//! Hugging Face model folders in and out: `config.json`, `model.safetensors`, `tokenizer.json`.
//! GPT-2 (`"gpt2"`, learned positions) here, GPT-NeoX (`"gpt_neox"`, rotary positions) in
//! [`neox`].
//!
//! GPT-2 and ember's decoder-only model share one layout: a fused `c_attn` for Q, K and V,
//! learned positions, pre-norm blocks, a head tied to the token embedding. GPT-2's projections
//! are `Conv1D` layers whose weights are stored `[in, out]`, which is exactly how Burn's `Linear`
//! stores them, so weights move across by name alone, with no transposition.

pub mod neox;

use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::store::{ApplyError, ModuleSnapshot, SafetensorsStore};
use burn::tensor::Tensor;
use ember_data::Tokenizer;
use ember_data::hf_tokenizer::char_tokenizer_json;
use ember_model::{Activation, DecoderOnly, DecoderOnlyConfig, PositionalKind};
use serde::{Deserialize, Serialize};

pub use neox::NeoxConfig;

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
pub fn is_hf_folder(dir: &Path) -> bool {
    dir.join(HF_CONFIG).is_file() && dir.join(HF_WEIGHTS).is_file()
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

/// The fields of a GPT-2 `config.json` that ember reads and writes; others are ignored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Gpt2Config {
    /// `"gpt2"`.
    #[serde(default)]
    pub model_type: Option<String>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Positional table size (the longest context).
    pub n_positions: usize,
    /// Width.
    pub n_embd: usize,
    /// Blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// MLP width; `null` means `4 * n_embd`.
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// `gelu_new` (tanh approximation), `gelu` (exact) or `relu`.
    #[serde(default = "default_activation")]
    pub activation_function: String,
    /// LayerNorm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    /// GPT-2 ties the head to the token embedding.
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    /// Scores divided by sqrt(head width), as in every GPT-2.
    #[serde(default = "yes")]
    pub scale_attn_weights: bool,
    /// A variant ember does not implement.
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// A variant ember does not implement.
    #[serde(default)]
    pub add_cross_attention: bool,
    /// Dropout rates (training only).
    #[serde(default)]
    pub resid_pdrop: f64,
    /// Embedding dropout (training only).
    #[serde(default)]
    pub embd_pdrop: f64,
    /// Attention dropout (training only).
    #[serde(default)]
    pub attn_pdrop: f64,
}

fn default_activation() -> String {
    "gelu_new".into()
}

fn default_eps() -> f64 {
    1e-5
}

fn yes() -> bool {
    true
}

impl Gpt2Config {
    /// The matching ember model: learned positions, pre-norm, biases, tied head.
    pub fn to_ember(&self, path: &Path) -> Result<DecoderOnlyConfig> {
        let bad = |key: &str, message: String| TrainError::ConfigFile {
            path: path.to_path_buf(),
            message: format!("`{key}` {message}"),
        };
        if let Some(kind) = &self.model_type
            && kind != "gpt2"
        {
            return Err(bad(
                "model_type",
                format!("is {kind:?}; ember reads GPT-2 models (\"gpt2\")"),
            ));
        }
        let activation = match self.activation_function.as_str() {
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Activation::GeluTanh,
            "gelu" => Activation::Gelu,
            "relu" => Activation::Relu,
            other => {
                return Err(bad(
                    "activation_function",
                    format!("is {other:?}; ember supports gelu_new, gelu and relu"),
                ));
            }
        };
        for (key, unsupported) in [
            ("tie_word_embeddings", !self.tie_word_embeddings),
            ("scale_attn_weights", !self.scale_attn_weights),
            (
                "scale_attn_by_inverse_layer_idx",
                self.scale_attn_by_inverse_layer_idx,
            ),
            ("add_cross_attention", self.add_cross_attention),
        ] {
            if unsupported {
                return Err(bad(key, "has a value ember does not support".into()));
            }
        }
        let config = DecoderOnlyConfig {
            vocab_size: self.vocab_size,
            d_model: self.n_embd,
            n_heads: self.n_head,
            n_layers: self.n_layer,
            d_ff: self.n_inner,
            context_len: self.n_positions,
            max_positions: Some(self.n_positions),
            positional: PositionalKind::Learned,
            norm_first: true,
            activation,
            dropout: 0.0,
            bias: true,
            tie_weights: true,
            layer_norm_eps: self.layer_norm_epsilon,
            ..DecoderOnlyConfig::default()
        };
        config.validate().map_err(|e| TrainError::ConfigFile {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(config)
    }

    /// The GPT-2 config of an ember model, or why it has none.
    pub fn from_ember(config: &DecoderOnlyConfig) -> std::result::Result<Self, String> {
        if config.positional != PositionalKind::Learned {
            return Err(format!(
                "GPT-2 has learned positions; this model's are {:?}",
                config.positional
            ));
        }
        if !config.norm_first {
            return Err("GPT-2 is pre-norm; this model is post-norm (norm_first = false)".into());
        }
        if !config.tie_weights {
            return Err("GPT-2 ties its head to the embedding; this model does not".into());
        }
        let activation_function = match config.activation {
            Activation::GeluTanh => "gelu_new",
            Activation::Gelu => "gelu",
            Activation::Relu => "relu",
        };
        Ok(Self {
            model_type: Some("gpt2".into()),
            vocab_size: config.vocab_size,
            n_positions: config.max_positions(),
            n_embd: config.d_model,
            n_layer: config.n_layers,
            n_head: config.n_heads,
            n_inner: Some(config.d_ff()),
            activation_function: activation_function.into(),
            layer_norm_epsilon: config.layer_norm_eps,
            tie_word_embeddings: true,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            add_cross_attention: false,
            resid_pdrop: config.dropout,
            embd_pdrop: config.dropout,
            attn_pdrop: config.dropout,
        })
    }
}

/// Hugging Face name -> ember name, applied in order (the `transformer.` prefix is optional).
const HF_TO_EMBER: &[(&str, &str)] = &[
    (r"^transformer\.", ""),
    (r"^wpe\.weight$", "wpe.wpe.weight"),
    (
        r"^h\.(\d+)\.(ln_1|ln_2)\.weight$",
        "blocks.$1.$2.norm.gamma",
    ),
    (r"^h\.(\d+)\.(ln_1|ln_2)\.bias$", "blocks.$1.$2.norm.beta"),
    (r"^h\.(\d+)\.", "blocks.$1."),
    (r"^ln_f\.weight$", "ln_f.gamma"),
    (r"^ln_f\.bias$", "ln_f.beta"),
];

/// Ember name -> Hugging Face name, as `GPT2LMHeadModel.save_pretrained` writes them.
const EMBER_TO_HF: &[(&str, &str)] = &[
    (r"^wpe\.wpe\.weight$", "wpe.weight"),
    (
        r"^blocks\.(\d+)\.(ln_1|ln_2)\.norm\.gamma$",
        "h.$1.$2.weight",
    ),
    (r"^blocks\.(\d+)\.(ln_1|ln_2)\.norm\.beta$", "h.$1.$2.bias"),
    (r"^blocks\.(\d+)\.", "h.$1."),
    (r"^ln_f\.gamma$", "ln_f.weight"),
    (r"^ln_f\.beta$", "ln_f.bias"),
    (r"^", "transformer."),
];

/// The Hugging Face name of ember tensor `path`, for messages.
fn hf_name(path: &str) -> String {
    let mut name = path.to_string();
    for (from, to) in EMBER_TO_HF {
        let re = regex::Regex::new(from).expect("the patterns are valid");
        name = re.replace(&name, *to).into_owned();
    }
    name
}

/// A folder's `config.json`, by its `model_type`.
enum HfConfig {
    Gpt2(Gpt2Config),
    Neox(NeoxConfig),
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
        Some("gpt2") | None => serde_json::from_value(json)
            .map(HfConfig::Gpt2)
            .map_err(|e| bad("GPT-2", e)),
        Some(other) => Err(TrainError::ConfigFile {
            path: path.clone(),
            message: format!(
                "`model_type` is {other:?}; ember reads GPT-2 (\"gpt2\") and GPT-NeoX \
                 (\"{}\") models",
                neox::MODEL_TYPE
            ),
        }),
    }
}

impl HfConfig {
    fn to_ember(&self, path: &Path) -> Result<DecoderOnlyConfig> {
        match self {
            HfConfig::Gpt2(gpt2) => gpt2.to_ember(path),
            HfConfig::Neox(neox) => neox.to_ember(path),
        }
    }
}

/// The architecture and tokenizer of a GPT-2 or GPT-NeoX folder.
pub fn open_hf(dir: &Path) -> Result<(DecoderOnlyConfig, Tokenizer)> {
    let model_config = read_config(dir)?.to_ember(&dir.join(HF_CONFIG))?;
    let tokenizer_path = dir.join(HF_TOKENIZER);
    if !tokenizer_path.is_file() {
        return Err(TrainError::Checkpoint {
            path: dir.to_path_buf(),
            message: format!("has no {HF_TOKENIZER}"),
        });
    }
    let tokenizer = Tokenizer::Bpe(Box::new(ember_data::bpe::load_bpe(&tokenizer_path)?));
    Ok((model_config, tokenizer))
}

/// Reads the weights of Hugging Face folder `dir` into `model` (built from the folder's
/// architecture, perhaps with another context or dropout); every tensor of the model must be
/// there, with its shape.
pub(crate) fn load_weights(model: DecoderOnly, dir: &Path) -> Result<DecoderOnly> {
    let path = dir.join(HF_WEIGHTS);
    match read_config(dir)? {
        HfConfig::Gpt2(_) => load_gpt2_weights(model, &path),
        HfConfig::Neox(config) => {
            let ember = config.to_ember(&dir.join(HF_CONFIG))?;
            neox::load_weights(model, &ember, &config, &path)
        }
    }
}

/// Reads GPT-2 weights into `model`; every tensor of the model must be there, with its shape.
fn load_gpt2_weights(mut model: DecoderOnly, path: &Path) -> Result<DecoderOnly> {
    let bad = |message: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message,
    };
    let mut store = HF_TO_EMBER
        .iter()
        .fold(SafetensorsStore::from_file(path), |store, (from, to)| {
            store.with_key_remapping(*from, *to)
        })
        .allow_partial(true)
        .validate(false);
    let result = model
        .load_from(&mut store)
        .map_err(|e| bad(format!("cannot read: {e}")))?;
    if let Some(error) = result.errors.first() {
        let message = match error {
            ApplyError::ShapeMismatch {
                path,
                expected,
                found,
            } => format!(
                "tensor `{}` has shape {:?}, but config.json asks for {:?}",
                hf_name(path),
                found.as_slice(),
                expected.as_slice()
            ),
            other => other.to_string(),
        };
        return Err(bad(message));
    }
    if let Some((path, _)) = result.missing.first() {
        return Err(bad(format!(
            "tensor `{}` is missing ({} missing in all)",
            hf_name(path),
            result.missing.len()
        )));
    }
    Ok(model)
}

/// Writes `model` (of architecture `config`, with `tokenizer`, read from checkpoint `source`) as
/// a Hugging Face folder in `out`, GPT-2 for learned positions and GPT-NeoX for rotary ones:
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
    let (hf_config, architecture) = match config.positional {
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

    let model = with_biases(model.clone());
    let weights = out.join(HF_WEIGHTS);
    if config.positional == PositionalKind::Rotary {
        neox::write_weights(&model, config, &weights)?;
    } else {
        let mut store = EMBER_TO_HF
            .iter()
            .fold(
                SafetensorsStore::from_file(&weights),
                |store, (from, to)| store.with_key_remapping(*from, *to),
            )
            .metadata("format", "pt")
            .overwrite(true);
        model
            .save_into(&mut store)
            .map_err(|e| write_err(&weights, e))?;
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
    let tokenizer_config = out.join(HF_TOKENIZER_CONFIG);
    let mut settings = serde_json::json!({"tokenizer_class": "PreTrainedTokenizerFast"});
    if let Tokenizer::Char(_) = tokenizer {
        settings["unk_token"] = ember_data::hf_tokenizer::UNK_TOKEN.into();
    }
    std::fs::write(&tokenizer_config, settings.to_string())
        .map_err(|e| write_err(&tokenizer_config, e))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        for (ember, hf) in [
            ("wte.weight", "transformer.wte.weight"),
            ("wpe.wpe.weight", "transformer.wpe.weight"),
            ("blocks.3.ln_1.norm.gamma", "transformer.h.3.ln_1.weight"),
            ("blocks.0.ln_2.norm.beta", "transformer.h.0.ln_2.bias"),
            (
                "blocks.11.attn.c_attn.weight",
                "transformer.h.11.attn.c_attn.weight",
            ),
            (
                "blocks.1.mlp.c_proj.bias",
                "transformer.h.1.mlp.c_proj.bias",
            ),
            ("ln_f.gamma", "transformer.ln_f.weight"),
        ] {
            assert_eq!(hf_name(ember), hf);
            let mut back = hf.to_string();
            for (from, to) in HF_TO_EMBER {
                back = regex::Regex::new(from)
                    .unwrap()
                    .replace(&back, *to)
                    .into_owned();
            }
            assert_eq!(back, ember, "{hf}");
        }
    }
}
