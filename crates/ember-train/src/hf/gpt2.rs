//! Hugging Face GPT-2 folders: ember's decoder-only model with learned positions.
//!
//! GPT-2 and ember's decoder-only model share one layout: a fused `c_attn` for Q, K and V,
//! learned positions, pre-norm blocks, a head tied to the token embedding. GPT-2's projections
//! are `Conv1D` layers whose weights are stored `[in, out]`, which is exactly how Burn's `Linear`
//! stores them, so weights move across by name alone, with no transposition.

use std::path::Path;

use burn::store::{ApplyError, ModuleSnapshot, SafetensorsStore};
use ember_model::{DecoderOnly, DecoderOnlyConfig, PositionalKind};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError, write_err};

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
    #[serde(default = "super::layer_norm_eps")]
    pub layer_norm_epsilon: f64,
    /// GPT-2 ties the head to the token embedding.
    #[serde(default = "super::yes")]
    pub tie_word_embeddings: bool,
    /// Scores divided by sqrt(head width), as in every GPT-2.
    #[serde(default = "super::yes")]
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
        let activation = super::activation(&self.activation_function, "activation_function", path)?;
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
        super::validated(config, path)
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
        super::classic_block(config, "GPT-2")?;
        if !config.tie_weights {
            return Err("GPT-2 ties its head to the embedding; this model does not".into());
        }
        if config.parallel_blocks {
            return Err(
                "GPT-2's blocks apply attention then MLP; this model's take them side by side \
                 (parallel_blocks = true; GPT-NeoX has such blocks, with rotary positions)"
                    .into(),
            );
        }
        let activation_function = super::activation_name(config.activation);
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

/// Reads GPT-2 weights into `model`, as `f32` whatever they are stored in; every tensor of the
/// model must be there, with its shape.
pub(super) fn load_weights(mut model: DecoderOnly, path: &Path) -> Result<DecoderOnly> {
    let bad = |message: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message,
    };
    // Weights stored in half precision are read as `f32` (the model's LayerNorms and products
    // take `f32`); `f32` files are read as they are.
    let mapped = super::tensors::map(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let converted =
        super::tensors::in_f32(&mapped).map_err(|e| bad(format!("cannot read: {e}")))?;
    drop(mapped);
    let store = match converted {
        Some(converted) => SafetensorsStore::from_bytes(Some(converted)),
        None => SafetensorsStore::from_file(path),
    };
    let mut store = HF_TO_EMBER
        .iter()
        .fold(store, |store, (from, to)| {
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

/// Writes `model` (whose every linear layer has a bias) under GPT-2's names to `path`.
pub(super) fn write_weights(model: &DecoderOnly, path: &Path) -> Result<()> {
    let mut store = EMBER_TO_HF
        .iter()
        .fold(SafetensorsStore::from_file(path), |store, (from, to)| {
            store.with_key_remapping(*from, *to)
        })
        .metadata("format", "pt")
        .overwrite(true);
    model.save_into(&mut store).map_err(|e| write_err(path, e))
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
