//! Hugging Face Llama folders (`LlamaForCausalLM`: Meta's Llama, SmolLM, TinyLlama and the
//! many models in its layout; Mistral's up to its sliding window; Qwen2's, whose biases on Q, K
//! and V alone ember holds with zeros for the other layers'; Microsoft's Phi-3, whose Q, K and V
//! and gate and up matrices are fused as ember's are, its rotation perhaps over a share of each
//! head): ember's decoder-only model with rotary positions,
//! RMSNorm (`[model] norm = "rms_norm"`), a gated MLP (`gated_mlp`, SiLU: SwiGLU) and perhaps
//! fewer key/value heads than query heads (`n_kv_heads`, grouped-query attention).
//!
//! The rotation pairs dimension `i` with `i + K/2` ("rotate half") in both. What differs in the
//! files: names; PyTorch's `nn.Linear` storing weights `[out, in]` where Burn's `Linear` stores
//! `[in, out]`; and separate matrices where ember fuses them: `q_proj`, `k_proj`, `v_proj` are
//! ember's `c_attn` (columns `[Q | K | V]`), `gate_proj` and `up_proj` its `c_fc` (`[gate |
//! up]`). [`entries`] says which parts make each of ember's tensors.

use std::path::Path;

use ember_model::{DecoderOnly, DecoderOnlyConfig, NormKind, PositionalKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::shards::WeightFiles;
use super::tensors::{Array, read_array};
use super::weights::{Lazy, ModelTensors};
use crate::error::{Result, TrainError};

/// `config.json`'s `model_type` of a Llama folder.
pub const MODEL_TYPE: &str = "llama";
/// `config.json`'s `model_type` of a Mistral folder: Llama's layout, attention perhaps within a
/// sliding window.
pub const MISTRAL: &str = "mistral";
/// `config.json`'s `model_type` of a Qwen2 folder (Qwen2 and Qwen2.5): Llama's layout with
/// biases on the query, key and value projections alone.
pub const QWEN2: &str = "qwen2";
/// `config.json`'s `model_type` of a Phi-3 folder (Phi-3, Phi-3.5, Phi-4-mini): Llama's layout
/// with `qkv_proj` (`[Q; K; V]`) and `gate_up_proj` (`[gate; up]`) one matrix each, perhaps a
/// partial rotation (`partial_rotary_factor`) and a sliding window.
pub const PHI3: &str = "phi3";

/// The fields of a Llama `config.json` that ember reads and writes; others are ignored.
/// Defaults are transformers' `LlamaConfig`'s.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// `"llama"`.
    pub model_type: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Width.
    pub hidden_size: usize,
    /// The gated MLP's width.
    pub intermediate_size: usize,
    /// Blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); `null` means as many as query heads.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// A head's width, if the config says it (ember's is `hidden_size / num_attention_heads`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// The gate's activation: `silu` in every Llama.
    #[serde(default = "silu")]
    pub hidden_act: String,
    /// The longest context.
    #[serde(default = "positions")]
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    #[serde(default = "rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// The head shares the token embedding (SmolLM's do; Llama's do not).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// The attention's projections have biases.
    #[serde(default)]
    pub attention_bias: bool,
    /// The MLP's projections have biases.
    #[serde(default)]
    pub mlp_bias: bool,
    /// The rotation's base (older transformers' key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// Newer transformers' rotary settings: `rope_type`, `rope_theta`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<Value>,
    /// Older transformers' scaled rotations (`linear`, Llama 3.1's `llama3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Value>,
    /// Dropout on the attention weights (training only).
    #[serde(default)]
    pub attention_dropout: f64,
    /// Mistral's: each position attends to at most this many (`null`: all before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// Qwen2's: whether `sliding_window` applies (Qwen2 configs carry a window they do not use).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    /// Phi's: the share of each head the rotation turns (older transformers' key; newer ones
    /// keep it in `rope_parameters`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
}

/// Which of a Llama-layout model's projections have biases in its file; ember gives all of them
/// one if any has (zeros for the others, which compute the same).
#[derive(Debug, Clone, Copy, PartialEq)]
struct StoredBiases {
    /// `q_proj`, `k_proj`, `v_proj`.
    qkv: bool,
    /// `o_proj`.
    out: bool,
    /// `gate_proj`, `up_proj`, `down_proj`.
    mlp: bool,
}

impl StoredBiases {
    /// Whether the file holds the bias of tensor `name` (`model.layers.N.<layer>.bias`).
    fn holds(&self, name: &str) -> bool {
        if name.contains(".mlp.") {
            self.mlp
        } else if name.contains(".o_proj.") {
            self.out
        } else {
            self.qkv
        }
    }
}

fn silu() -> String {
    "silu".into()
}

fn positions() -> usize {
    2048
}

fn rms_norm_eps() -> f64 {
    1e-6
}

impl LlamaConfig {
    /// The biases the file holds: Qwen2's on Q, K and V; Llama's and Mistral's on the attention
    /// (`attention_bias`) and on the MLP (`mlp_bias`).
    fn stored_biases(&self) -> StoredBiases {
        match self.model_type.as_str() {
            QWEN2 => StoredBiases {
                qkv: true,
                out: false,
                mlp: false,
            },
            _ => StoredBiases {
                qkv: self.attention_bias,
                out: self.attention_bias,
                mlp: self.mlp_bias,
            },
        }
    }

    /// The sliding window that applies, if any.
    fn window(&self) -> Option<usize> {
        let applies = match self.model_type.as_str() {
            QWEN2 => self.use_sliding_window == Some(true),
            _ => true,
        };
        self.sliding_window.filter(|_| applies)
    }

    /// The matching ember model: rotary positions over whole heads, RMSNorm before each
    /// sub-layer, a gated MLP, grouped keys and values where there are fewer of them.
    pub fn to_ember(&self, path: &Path) -> Result<DecoderOnlyConfig> {
        let bad = |key: &str, message: String| TrainError::ConfigFile {
            path: path.to_path_buf(),
            message: format!("`{key}` {message}"),
        };
        let activation = super::activation(&self.hidden_act, "hidden_act", path)?;
        let rope = super::rotation(
            self.rope_parameters.as_ref(),
            self.rope_theta,
            self.rope_scaling.as_ref(),
            path,
        )?;
        let head = self.hidden_size / self.num_attention_heads.max(1);
        if let Some(dim) = self.head_dim.filter(|&d| d != head) {
            return Err(bad(
                "head_dim",
                format!(
                    "is {dim}, where ember's heads are hidden_size / num_attention_heads = {head} \
                     wide"
                ),
            ));
        }
        let share = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            .or(self.partial_rotary_factor)
            .unwrap_or(1.0);
        let turned = super::turned_dims(share, head, "partial_rotary_factor", path)?;
        let biases = self.stored_biases();
        // Within its window, sliding-window attention is the causal attention ember computes:
        // the model takes no more positions than the window.
        let positions = match self.window() {
            Some(window) => window.min(self.max_position_embeddings),
            None => self.max_position_embeddings,
        };
        let config = DecoderOnlyConfig {
            vocab_size: self.vocab_size,
            d_model: self.hidden_size,
            n_heads: self.num_attention_heads,
            n_kv_heads: self
                .num_key_value_heads
                .filter(|&g| g != self.num_attention_heads),
            n_layers: self.num_hidden_layers,
            d_ff: Some(self.intermediate_size),
            gated_mlp: true,
            context_len: positions,
            max_positions: Some(positions),
            positional: PositionalKind::Rotary,
            rotary_base: rope.base,
            rotary_scaling: rope.scaling,
            rotary_dims: (turned < head).then_some(turned),
            norm_first: true,
            norm: NormKind::RmsNorm,
            activation,
            dropout: 0.0,
            bias: biases.qkv || biases.out || biases.mlp,
            tie_weights: self.tie_word_embeddings,
            layer_norm_eps: self.rms_norm_eps,
            ..DecoderOnlyConfig::default()
        };
        super::validated(config, path)
    }

    /// The Llama config of an ember model with rotary positions (the caller checks that).
    pub fn from_ember(config: &DecoderOnlyConfig) -> std::result::Result<Self, String> {
        let head = config.d_model / config.n_heads;
        let refusal = if config.norm != NormKind::RmsNorm {
            Some("Llama's norms are RMSNorm; this model's are LayerNorm (norm = \"layer_norm\")")
        } else if !config.gated_mlp {
            Some("Llama's MLP is gated; this model's is not (gated_mlp = false)")
        } else if !config.norm_first {
            Some("Llama is pre-norm; this model is post-norm (norm_first = false)")
        } else if config.parallel_blocks {
            Some("Llama's blocks run attention, then the MLP; this model's run them side by side")
        } else if config.rotary_dims.is_some_and(|d| d < head) {
            Some("Llama rotates whole heads; this model a part of each (rotary_dims)")
        } else {
            None
        };
        if let Some(refusal) = refusal {
            return Err(refusal.into());
        }
        let rope = config.rope();
        let (rope_parameters, rope_scaling) = super::rotation_keys(rope, &[]);
        Ok(Self {
            model_type: MODEL_TYPE.into(),
            vocab_size: config.vocab_size,
            hidden_size: config.d_model,
            intermediate_size: config.d_ff(),
            num_hidden_layers: config.n_layers,
            num_attention_heads: config.n_heads,
            num_key_value_heads: Some(config.n_kv_heads()),
            head_dim: Some(head),
            hidden_act: super::activation_name(config.activation).into(),
            max_position_embeddings: config.max_positions(),
            rms_norm_eps: config.layer_norm_eps,
            tie_word_embeddings: config.tie_weights,
            attention_bias: config.bias,
            mlp_bias: config.bias,
            // Both generations of transformers' keys, so that either reads the rotation.
            rope_theta: Some(rope.base),
            rope_parameters: Some(rope_parameters),
            rope_scaling,
            attention_dropout: config.dropout,
            sliding_window: None,
            use_sliding_window: None,
            partial_rotary_factor: None,
        })
    }
}

/// One of ember's tensors and the Llama tensors it is made of, stacked along their first axis
/// (`[out, in]` weights, or biases), each with its shape there.
#[derive(Debug, Clone)]
struct Entry {
    ember: String,
    parts: Vec<(String, Vec<usize>)>,
    /// A linear layer's weight: `[in, out]` in ember, the parts' `[out, in]` stacked.
    transposed: bool,
}

/// An ember linear layer, the Llama layers stacked into it (name and outputs), its inputs.
type Stacked<'a> = (&'a str, Parts<'a>, usize);

/// Llama layers stacked into one of ember's, each with its outputs.
type Parts<'a> = &'a [(&'a str, usize)];

/// Every tensor of the model `config` describes.
/// With `fused`, Phi-3's names: `qkv_proj` and `gate_up_proj` each one matrix, as ember's are.
fn entries(config: &DecoderOnlyConfig, fused: bool) -> Vec<Entry> {
    let (d, f, v) = (config.d_model, config.d_ff(), config.vocab_size);
    let kv = d / config.n_heads * config.n_kv_heads();
    let one = |ember: String, llama: String, shape: &[usize], transposed| Entry {
        ember,
        parts: vec![(llama, shape.to_vec())],
        transposed,
    };
    let mut all = vec![one(
        "wte.weight".into(),
        "model.embed_tokens.weight".into(),
        &[v, d],
        false,
    )];
    for i in 0..config.n_layers {
        let (e, l) = (format!("blocks.{i}."), format!("model.layers.{i}."));
        for (ours, theirs) in [
            ("ln_1", "input_layernorm"),
            ("ln_2", "post_attention_layernorm"),
        ] {
            let (ember, llama) = (
                format!("{e}{ours}.norm.gamma"),
                format!("{l}{theirs}.weight"),
            );
            all.push(one(ember, llama, &[d], false));
        }
        // ember's layer, the Llama layers stacked into it with their outputs, and its inputs
        // (Phi-3's files hold the fused ones whole).
        let (qkv, gate_up): (Parts, Parts) = match fused {
            true => (
                &[("self_attn.qkv_proj", d + 2 * kv)],
                &[("mlp.gate_up_proj", 2 * f)],
            ),
            false => (
                &[
                    ("self_attn.q_proj", d),
                    ("self_attn.k_proj", kv),
                    ("self_attn.v_proj", kv),
                ],
                &[("mlp.gate_proj", f), ("mlp.up_proj", f)],
            ),
        };
        let linears: [Stacked; 4] = [
            ("attn.c_attn", qkv, d),
            ("attn.c_proj", &[("self_attn.o_proj", d)], d),
            ("mlp.c_fc", gate_up, d),
            ("mlp.c_proj", &[("mlp.down_proj", d)], f),
        ];
        for (ours, theirs, inputs) in linears {
            let part = |suffix: &str, shape: &dyn Fn(usize) -> Vec<usize>| {
                theirs
                    .iter()
                    .map(|(name, outputs)| (format!("{l}{name}.{suffix}"), shape(*outputs)))
                    .collect()
            };
            all.push(Entry {
                ember: format!("{e}{ours}.weight"),
                parts: part("weight", &|outputs| vec![outputs, inputs]),
                transposed: true,
            });
            if config.bias {
                all.push(Entry {
                    ember: format!("{e}{ours}.bias"),
                    parts: part("bias", &|outputs| vec![outputs]),
                    transposed: false,
                });
            }
        }
    }
    all.push(one(
        "ln_f.gamma".into(),
        "model.norm.weight".into(),
        &[d],
        false,
    ));
    if !config.tie_weights {
        all.push(one(
            "lm_head.weight".into(),
            "lm_head.weight".into(),
            &[v, d],
            true,
        ));
    }
    all
}

/// Part `i` of ember's tensor `array` in Llama's layout: rows `a..b` of the parts stacked
/// (columns `a..b` of a weight, transposed), made without the rest.
fn part(entry: &Entry, array: &Array, i: usize) -> Array {
    let a: usize = entry.parts[..i].iter().map(|(_, shape)| shape[0]).sum();
    let shape = entry.parts[i].1.clone();
    let b = a + shape[0];
    let values = match entry.transposed {
        true => array.columns_transposed(a, b).values,
        false => {
            let width = array.values.len() / array.shape[0].max(1);
            array.values[a * width..b * width].to_vec()
        }
    };
    Array { shape, values }
}

/// Writes `model` in Llama's layout to `path`, one tensor at a time.
pub(super) fn write_weights(
    model: &DecoderOnly,
    config: &DecoderOnlyConfig,
    path: &Path,
) -> Result<()> {
    let ours = ModelTensors::of(model);
    let all = entries(config, false);
    let mut theirs = Vec::new();
    for entry in &all {
        for (i, (name, shape)) in entry.parts.iter().enumerate() {
            let ours = &ours;
            theirs.push(Lazy {
                name: name.clone(),
                shape: shape.clone(),
                make: Box::new(move || Ok(part(entry, &ours.array(&entry.ember)?, i))),
            });
        }
    }
    super::weights::write_each(path, theirs)
}

/// Reads Llama weights from `path` into `model` (built from `llama.to_ember`); every tensor must
/// be there with its shape, but for the biases the layout has none of (zeros).
pub(super) fn load_weights(
    model: DecoderOnly,
    config: &DecoderOnlyConfig,
    llama: &LlamaConfig,
    files: &WeightFiles,
) -> Result<DecoderOnly> {
    let path = files.path();
    let biases = llama.stored_biases();
    let bad = |message: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message,
    };
    let file = files.read()?;
    let misshaped = |name: &str, found: &[usize], shape: &[usize]| {
        bad(format!(
            "tensor `{name}` has shape {found:?}, but config.json asks for {shape:?}"
        ))
    };
    let read = |entry: Entry| -> Result<(String, Array)> {
        if entry.transposed {
            // A weight: read from the file straight into ember's layout.
            let mut views = Vec::with_capacity(entry.parts.len());
            for (name, shape) in &entry.parts {
                let view = file
                    .tensor(name)
                    .map_err(|_| bad(format!("tensor `{name}` is missing")))?;
                if view.shape() != shape.as_slice() {
                    return Err(misshaped(name, view.shape(), shape));
                }
                views.push(view);
            }
            let array = super::tensors::read_transposed(&views)
                .map_err(|e| bad(format!("tensor `{}` {e}", entry.parts[0].0)))?;
            return Ok((entry.ember, array));
        }
        let mut parts = Vec::with_capacity(entry.parts.len());
        for (name, shape) in &entry.parts {
            let array = match file.tensor(name) {
                Ok(view) => read_array(&view).map_err(|e| bad(format!("tensor `{name}` {e}")))?,
                Err(_) if name.ends_with(".bias") && !biases.holds(name) => Array {
                    shape: shape.clone(),
                    values: vec![0.0; shape.iter().product()],
                },
                Err(_) => return Err(bad(format!("tensor `{name}` is missing"))),
            };
            if &array.shape != shape {
                return Err(misshaped(name, &array.shape, shape));
            }
            parts.push(array);
        }
        Ok((entry.ember, Array::stacked(parts)))
    };
    let fused = llama.model_type == PHI3;
    super::weights::load_each(model, entries(config, fused).into_iter().map(read), path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Grouped-query attention's fused projection from three Llama matrices and back: width 4,
    /// 2 query heads of 2, 1 key/value head: `q_proj` `[4, 4]`, `k_proj` and `v_proj` `[2, 4]`,
    /// ember's `c_attn` `[4, 8]` with columns `[Q | K | V]`.
    #[test]
    fn the_fused_projections_stack_and_split() {
        let config = DecoderOnlyConfig {
            vocab_size: 5,
            d_model: 4,
            n_heads: 2,
            n_kv_heads: Some(1),
            n_layers: 1,
            d_ff: Some(3),
            gated_mlp: true,
            bias: false,
            ..Default::default()
        };
        let all = entries(&config, false);
        let c_attn = all
            .iter()
            .find(|e| e.ember == "blocks.0.attn.c_attn.weight")
            .unwrap();
        let shapes: Vec<_> = c_attn.parts.iter().map(|(_, s)| s.clone()).collect();
        assert_eq!(shapes, [vec![4, 4], vec![2, 4], vec![2, 4]]);
        let parts: Vec<Array> = shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| Array {
                shape: shape.clone(),
                values: (0..shape[0] * 4).map(|v| (100 * i + v) as f32).collect(),
            })
            .collect();
        let ours = Array::stacked(parts.clone()).transposed();
        assert_eq!(ours.shape, [4, 8]);
        // Column 5 is the key head's second output: row 1 of k_proj, whose input 2 weight is
        // k_proj[1, 2] = 100 + 1 * 4 + 2.
        assert_eq!(ours.values[2 * 8 + 5], 106.0);
        let split: Vec<Array> = (0..3).map(|i| part(c_attn, &ours, i)).collect();
        assert_eq!(split, parts);
        // The gated MLP: gate then up, each [3, 4], into ember's [4, 6].
        let c_fc = all
            .iter()
            .find(|e| e.ember == "blocks.0.mlp.c_fc.weight")
            .unwrap();
        let names: Vec<_> = c_fc.parts.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.0.mlp.gate_proj.weight",
                "model.layers.0.mlp.up_proj.weight"
            ]
        );
        // No biases and a tied head: norms, 4 linear layers, embedding, final norm.
        assert_eq!(all.len(), 2 + 4 + 2);
    }
}
