//! Hugging Face GPT-NeoX folders: ember's decoder-only model with rotary positions.
//!
//! GPT-NeoX (`GPTNeoXForCausalLM`, the layout of EleutherAI's models) is the GPT-2 block with
//! rotary positions in place of a learned table: a fused Q/K/V projection, pre-norm LayerNorms,
//! an MLP with biases, rotary angles `pos * base^(-2i/K)` applied to dimension pairs `(i, i +
//! K/2)` ("rotate half", as ember's rotary positions are), over the leading `rotary_pct` of each
//! head (ember's `rotary_dims`), attention and MLP in sequence or side by side
//! (`use_parallel_residual`, ember's `parallel_blocks`): Pythia's models are GPT-NeoX's. Three
//! things differ in the files: names, PyTorch's `nn.Linear` storing weights `[out, in]` where
//! Burn's `Linear` stores `[in, out]` (transposed here), and the fused projection's outputs,
//! grouped by head (`[q_h | k_h | v_h]` for each head `h`) where ember's are `[Q | K | V]` (rows
//! reordered; `neox_layout` says where each tensor goes).

use std::path::Path;

use ember_model::{DecoderOnly, DecoderOnlyConfig, PositionalKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::neox_layout::{Entry, entries, from_neox, to_neox};
use super::shards::WeightFiles;
use super::tensors::{Array, read_array};
use super::weights::{Lazy, ModelTensors};
use crate::error::{Result, TrainError};

/// `config.json`'s `model_type` of a GPT-NeoX folder.
pub const MODEL_TYPE: &str = "gpt_neox";

/// The fields of a GPT-NeoX `config.json` that ember reads and writes; others are ignored.
/// Defaults are transformers' `GPTNeoXConfig`'s.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NeoxConfig {
    /// `"gpt_neox"`.
    pub model_type: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Width.
    pub hidden_size: usize,
    /// Blocks.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// `gelu` (exact), `gelu_new` / `gelu_pytorch_tanh` / `gelu_fast` (tanh approximation) or
    /// `relu`.
    #[serde(default = "gelu")]
    pub hidden_act: String,
    /// The longest context.
    #[serde(default = "positions")]
    pub max_position_embeddings: usize,
    /// LayerNorm epsilon.
    #[serde(default = "super::layer_norm_eps")]
    pub layer_norm_eps: f64,
    /// Attention and MLP side by side (`x + attn(ln1(x)) + mlp(ln2(x))`, Pythia's) instead of one
    /// after the other; ember has only the latter.
    #[serde(default = "super::yes")]
    pub use_parallel_residual: bool,
    /// The head shares the token embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// The attention's projections have biases (the MLP's always do).
    #[serde(default = "super::yes")]
    pub attention_bias: bool,
    /// The share of each head the rotation covers (older transformers' key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotary_pct: Option<f64>,
    /// The rotation's base (older transformers' key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotary_emb_base: Option<f64>,
    /// Newer transformers' rotary settings: `rope_type`, `rope_theta`, `partial_rotary_factor`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<Value>,
    /// Older transformers' scaled rotations (`linear`, Llama 3.1's `llama3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Value>,
    /// Dropout after attention, after the MLP and on the embedding (training only).
    #[serde(default)]
    pub hidden_dropout: f64,
    /// Dropout on the attention weights (training only).
    #[serde(default)]
    pub attention_dropout: f64,
}

fn gelu() -> String {
    "gelu".into()
}

fn positions() -> usize {
    2048
}

impl NeoxConfig {
    /// The share of each head the rotation turns, from either generation of keys.
    fn turned_share(&self) -> f64 {
        let newer = self.rope_parameters.as_ref();
        newer
            .and_then(|p| p.get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            .or(self.rotary_pct)
            .unwrap_or(0.25)
    }

    /// The matching ember model: rotary positions (over the share of each head the config
    /// says), pre-norm, biases, blocks in sequence or side by side.
    pub fn to_ember(&self, path: &Path) -> Result<DecoderOnlyConfig> {
        let activation = super::activation(&self.hidden_act, "hidden_act", path)?;
        let head = self.hidden_size / self.num_attention_heads.max(1);
        let turned = super::turned_dims(self.turned_share(), head, "rotary_pct", path)?;
        let rope = super::rotation(
            self.rope_parameters.as_ref(),
            self.rotary_emb_base,
            self.rope_scaling.as_ref(),
            path,
        )?;
        let config = DecoderOnlyConfig {
            vocab_size: self.vocab_size,
            d_model: self.hidden_size,
            n_heads: self.num_attention_heads,
            n_layers: self.num_hidden_layers,
            d_ff: Some(self.intermediate_size),
            context_len: self.max_position_embeddings,
            max_positions: Some(self.max_position_embeddings),
            positional: PositionalKind::Rotary,
            rotary_base: rope.base,
            rotary_scaling: rope.scaling,
            rotary_dims: (turned < head).then_some(turned),
            norm_first: true,
            parallel_blocks: self.use_parallel_residual,
            activation,
            dropout: 0.0,
            bias: true,
            tie_weights: self.tie_word_embeddings,
            layer_norm_eps: self.layer_norm_eps,
            ..DecoderOnlyConfig::default()
        };
        super::validated(config, path)
    }

    /// The GPT-NeoX config of an ember model with rotary positions (the caller checks that).
    pub fn from_ember(config: &DecoderOnlyConfig) -> std::result::Result<Self, String> {
        if !config.norm_first {
            return Err(
                "GPT-NeoX is pre-norm; this model is post-norm (norm_first = false)".into(),
            );
        }
        super::classic_block(config, "GPT-NeoX")?;
        let hidden_act = super::activation_name(config.activation);
        let head = config.d_model / config.n_heads;
        let share = rotary_share(config.rotary_dims.unwrap_or(head), head);
        let rope = config.rope();
        let (rope_parameters, rope_scaling) =
            super::rotation_keys(rope, &[("partial_rotary_factor", share.into())]);
        Ok(Self {
            model_type: MODEL_TYPE.into(),
            vocab_size: config.vocab_size,
            hidden_size: config.d_model,
            num_hidden_layers: config.n_layers,
            num_attention_heads: config.n_heads,
            intermediate_size: config.d_ff(),
            hidden_act: hidden_act.into(),
            max_position_embeddings: config.max_positions(),
            layer_norm_eps: config.layer_norm_eps,
            use_parallel_residual: config.parallel_blocks,
            tie_word_embeddings: config.tie_weights,
            attention_bias: true,
            // Both generations of transformers' keys, so that either reads the rotation.
            rotary_pct: Some(share),
            rotary_emb_base: Some(rope.base),
            rope_parameters: Some(rope_parameters),
            rope_scaling,
            hidden_dropout: config.dropout,
            attention_dropout: config.dropout,
        })
    }
}

/// The share of a head of `head` dimensions that transformers turns into `turned` of them
/// (`int(head * share)`): `turned / head`, nudged up where rounding would make it one fewer.
fn rotary_share(turned: usize, head: usize) -> f64 {
    let mut share = turned as f64 / head as f64;
    while ((head as f64 * share) as usize) < turned {
        share = f64::from_bits(share.to_bits() + 1);
    }
    share
}

/// Writes `model` (whose every linear layer has a bias) in GPT-NeoX's layout to `path`.
pub(super) fn write_weights(
    model: &DecoderOnly,
    config: &DecoderOnlyConfig,
    path: &Path,
) -> Result<()> {
    let ours = ModelTensors::of(model);
    let ours = &ours;
    let theirs = entries(config)
        .into_iter()
        .map(|entry| Lazy {
            name: entry.neox,
            shape: entry.shape,
            make: Box::new(move || Ok(to_neox(&ours.array(&entry.ember)?, entry.how, config))),
        })
        .collect();
    super::weights::write_each(path, theirs)
}

/// Reads GPT-NeoX weights from `path` into `model` (built from `neox.to_ember`); every tensor
/// must be there with its shape, but for the attention's biases of a model without them.
pub(super) fn load_weights(
    model: DecoderOnly,
    config: &DecoderOnlyConfig,
    neox: &NeoxConfig,
    files: &WeightFiles,
) -> Result<DecoderOnly> {
    let path = files.path();
    let bad = |message: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message,
    };
    let file = files.read()?;
    let read = |entry: Entry| -> Result<(String, Array)> {
        // transformers 5 names the head `lm_head`; earlier ones `embed_out`.
        let stored = match file.tensor(&entry.neox) {
            Err(_) if entry.neox == "embed_out.weight" => file.tensor("lm_head.weight"),
            found => found,
        };
        let array = match stored {
            Ok(view) => {
                read_array(&view).map_err(|e| bad(format!("tensor `{}` {e}", entry.neox)))?
            }
            Err(_)
                if !neox.attention_bias
                    && entry.neox.contains(".attention.")
                    && entry.neox.ends_with(".bias") =>
            {
                Array {
                    shape: entry.shape.clone(),
                    values: vec![0.0; entry.shape.iter().product()],
                }
            }
            Err(_) => {
                return Err(bad(format!("tensor `{}` is missing", entry.neox)));
            }
        };
        if array.shape != entry.shape {
            return Err(bad(format!(
                "tensor `{}` has shape {:?}, but config.json asks for {:?}",
                entry.neox, array.shape, entry.shape
            )));
        }
        Ok((entry.ember, from_neox(&array, entry.how, config)))
    };
    super::weights::load_each(model, entries(config).into_iter().map(read), path)
}
