//! Hugging Face GPT-NeoX folders: ember's decoder-only model with rotary positions.
//!
//! GPT-NeoX (`GPTNeoXForCausalLM`, the layout of EleutherAI's models) is the GPT-2 block with
//! rotary positions in place of a learned table: a fused Q/K/V projection, pre-norm LayerNorms,
//! an MLP with biases, rotary angles `pos * base^(-2i/K)` applied to dimension pairs `(i, i +
//! K/2)` ("rotate half", as ember's rotary positions are). With `use_parallel_residual = false`
//! and the rotation over the whole head (`rotary_pct = 1`) it is exactly ember's model. Three
//! things differ in the files: names, PyTorch's `nn.Linear` storing weights `[out, in]` where
//! Burn's `Linear` stores `[in, out]` (transposed here), and the fused projection's outputs,
//! grouped by head (`[q_h | k_h | v_h]` for each head `h`) where ember's are `[Q | K | V]` (rows
//! reordered here).

use std::collections::BTreeMap;
use std::path::Path;

use burn::store::{ApplyError, ModuleSnapshot, SafetensorsStore};
use burn::tensor::{DType, TensorData};
use ember_model::{Activation, DecoderOnly, DecoderOnlyConfig, PositionalKind};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, TrainError, write_err};

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
    #[serde(default = "eps")]
    pub layer_norm_eps: f64,
    /// Attention and MLP side by side (`x + attn(ln1(x)) + mlp(ln2(x))`, Pythia's) instead of one
    /// after the other; ember has only the latter.
    #[serde(default = "yes")]
    pub use_parallel_residual: bool,
    /// The head shares the token embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// The attention's projections have biases (the MLP's always do).
    #[serde(default = "yes")]
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
    /// Older transformers' scaled rotations (ember has none).
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

fn eps() -> f64 {
    1e-5
}

fn yes() -> bool {
    true
}

impl NeoxConfig {
    /// The rotation's share of a head, its base and its kind, from either generation of keys.
    fn rotary(&self) -> (f64, f64, String) {
        let newer = |key: &str| self.rope_parameters.as_ref().and_then(|p| p.get(key));
        let share = newer("partial_rotary_factor")
            .and_then(Value::as_f64)
            .or(self.rotary_pct)
            .unwrap_or(0.25);
        let base = newer("rope_theta")
            .and_then(Value::as_f64)
            .or(self.rotary_emb_base)
            .unwrap_or(10000.0);
        let kind = newer("rope_type")
            .and_then(Value::as_str)
            .unwrap_or("default");
        (share, base, kind.to_string())
    }

    /// The matching ember model: rotary positions over whole heads, pre-norm, biases.
    pub fn to_ember(&self, path: &Path) -> Result<DecoderOnlyConfig> {
        let bad = |key: &str, message: String| TrainError::ConfigFile {
            path: path.to_path_buf(),
            message: format!("`{key}` {message}"),
        };
        let activation = match self.hidden_act.as_str() {
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Activation::GeluTanh,
            "gelu" => Activation::Gelu,
            "relu" => Activation::Relu,
            other => {
                return Err(bad(
                    "hidden_act",
                    format!("is {other:?}; ember supports gelu, gelu_new and relu"),
                ));
            }
        };
        if self.use_parallel_residual {
            return Err(bad(
                "use_parallel_residual",
                "is true (attention and MLP side by side, as in Pythia); ember's blocks apply \
                 them one after the other (false)"
                    .into(),
            ));
        }
        let (share, base, kind) = self.rotary();
        if share != 1.0 {
            return Err(bad(
                "rotary_pct",
                format!(
                    "is {share}; ember rotates whole heads (1.0), not a share of each (Pythia's \
                     0.25)"
                ),
            ));
        }
        let scaled = self.rope_scaling.as_ref().is_some_and(|v| !v.is_null());
        if kind != "default" || scaled {
            return Err(bad(
                "rope_parameters",
                format!("asks for {kind:?} rotary scaling; ember has the default rotation only"),
            ));
        }
        let config = DecoderOnlyConfig {
            vocab_size: self.vocab_size,
            d_model: self.hidden_size,
            n_heads: self.num_attention_heads,
            n_layers: self.num_hidden_layers,
            d_ff: Some(self.intermediate_size),
            context_len: self.max_position_embeddings,
            max_positions: Some(self.max_position_embeddings),
            positional: PositionalKind::Rotary,
            rotary_base: base,
            norm_first: true,
            activation,
            dropout: 0.0,
            bias: true,
            tie_weights: self.tie_word_embeddings,
            layer_norm_eps: self.layer_norm_eps,
            ..DecoderOnlyConfig::default()
        };
        config.validate().map_err(|e| TrainError::ConfigFile {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(config)
    }

    /// The GPT-NeoX config of an ember model with rotary positions (the caller checks that).
    pub fn from_ember(config: &DecoderOnlyConfig) -> std::result::Result<Self, String> {
        if !config.norm_first {
            return Err(
                "GPT-NeoX is pre-norm; this model is post-norm (norm_first = false)".into(),
            );
        }
        let hidden_act = match config.activation {
            Activation::GeluTanh => "gelu_new",
            Activation::Gelu => "gelu",
            Activation::Relu => "relu",
        };
        let base = config.rotary_base;
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
            use_parallel_residual: false,
            tie_word_embeddings: config.tie_weights,
            attention_bias: true,
            // Both generations of transformers' keys, so that either reads the rotation.
            rotary_pct: Some(1.0),
            rotary_emb_base: Some(base),
            rope_parameters: Some(serde_json::json!({
                "rope_type": "default",
                "rope_theta": base,
                "partial_rotary_factor": 1.0,
            })),
            rope_scaling: None,
            hidden_dropout: config.dropout,
            attention_dropout: config.dropout,
        })
    }
}

/// How a tensor's values move between the two layouts.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Move {
    /// As they are.
    Same,
    /// A linear layer's weight: `[out, in]` in GPT-NeoX, `[in, out]` in ember.
    Transposed,
    /// The fused projection's weight: transposed, and its outputs regrouped by head.
    QkvWeight,
    /// The fused projection's bias: regrouped by head.
    QkvBias,
}

/// One tensor of the model under both names, its GPT-NeoX shape and how its values move.
#[derive(Debug, Clone)]
struct Entry {
    ember: String,
    neox: String,
    shape: Vec<usize>,
    how: Move,
}

/// Every tensor of the model `config` describes (GPT-NeoX holds all the biases).
fn entries(config: &DecoderOnlyConfig) -> Vec<Entry> {
    let (d, f, v) = (config.d_model, config.d_ff(), config.vocab_size);
    let entry = |ember: String, neox: String, shape: &[usize], how| Entry {
        ember,
        neox,
        shape: shape.to_vec(),
        how,
    };
    let mut all = vec![entry(
        "wte.weight".into(),
        "gpt_neox.embed_in.weight".into(),
        &[v, d],
        Move::Same,
    )];
    for i in 0..config.n_layers {
        let (e, n) = (format!("blocks.{i}."), format!("gpt_neox.layers.{i}."));
        for (ours, theirs) in [
            ("ln_1", "input_layernorm"),
            ("ln_2", "post_attention_layernorm"),
        ] {
            for (gamma, weight) in [("gamma", "weight"), ("beta", "bias")] {
                all.push(entry(
                    format!("{e}{ours}.norm.{gamma}"),
                    format!("{n}{theirs}.{weight}"),
                    &[d],
                    Move::Same,
                ));
            }
        }
        let linears = [
            ("attn.c_attn", "attention.query_key_value", d, 3 * d),
            ("attn.c_proj", "attention.dense", d, d),
            ("mlp.c_fc", "mlp.dense_h_to_4h", d, f),
            ("mlp.c_proj", "mlp.dense_4h_to_h", f, d),
        ];
        for (ours, theirs, inputs, outputs) in linears {
            let qkv = ours == "attn.c_attn";
            let (weight, bias) = match qkv {
                true => (Move::QkvWeight, Move::QkvBias),
                false => (Move::Transposed, Move::Same),
            };
            all.push(entry(
                format!("{e}{ours}.weight"),
                format!("{n}{theirs}.weight"),
                &[outputs, inputs],
                weight,
            ));
            all.push(entry(
                format!("{e}{ours}.bias"),
                format!("{n}{theirs}.bias"),
                &[outputs],
                bias,
            ));
        }
    }
    all.push(entry(
        "ln_f.gamma".into(),
        "gpt_neox.final_layer_norm.weight".into(),
        &[d],
        Move::Same,
    ));
    all.push(entry(
        "ln_f.beta".into(),
        "gpt_neox.final_layer_norm.bias".into(),
        &[d],
        Move::Same,
    ));
    if !config.tie_weights {
        all.push(entry(
            "lm_head.weight".into(),
            "embed_out.weight".into(),
            &[v, d],
            Move::Transposed,
        ));
    }
    all
}

/// A tensor's shape and `f32` values, row-major.
#[derive(Debug, Clone, PartialEq)]
struct Array {
    shape: Vec<usize>,
    values: Vec<f32>,
}

impl Array {
    /// `[r, c]` -> `[c, r]`.
    fn transposed(&self) -> Array {
        let (r, c) = (self.shape[0], self.shape[1]);
        let mut values = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                values[j * r + i] = self.values[i * c + j];
            }
        }
        Array {
            shape: vec![c, r],
            values,
        }
    }

    /// Rows (entries of a vector) reordered: row `i` of the result is row `from(i)`.
    fn rows_from(&self, from: impl Fn(usize) -> usize) -> Array {
        let rows = self.shape[0];
        let width = self.values.len() / rows.max(1);
        let mut values = Vec::with_capacity(self.values.len());
        for i in 0..rows {
            let j = from(i);
            values.extend_from_slice(&self.values[j * width..(j + 1) * width]);
        }
        Array {
            shape: self.shape.clone(),
            values,
        }
    }
}

/// The fused projection's output `r` in GPT-NeoX's order (head, then q/k/v, then the head's
/// dimension) is ember's output (q/k/v, then head, then dimension) of this index.
fn ember_output(r: usize, d_model: usize, n_heads: usize) -> usize {
    let head_size = d_model / n_heads;
    let (head, rest) = (r / (3 * head_size), r % (3 * head_size));
    let (which, e) = (rest / head_size, rest % head_size);
    which * d_model + head * head_size + e
}

/// The inverse of [`ember_output`].
fn neox_output(c: usize, d_model: usize, n_heads: usize) -> usize {
    let head_size = d_model / n_heads;
    let (which, rest) = (c / d_model, c % d_model);
    let (head, e) = (rest / head_size, rest % head_size);
    head * 3 * head_size + which * head_size + e
}

/// `ember`'s tensor in GPT-NeoX's layout.
fn to_neox(array: &Array, how: Move, config: &DecoderOnlyConfig) -> Array {
    let (d, h) = (config.d_model, config.n_heads);
    match how {
        Move::Same => array.clone(),
        Move::Transposed => array.transposed(),
        Move::QkvWeight => array.transposed().rows_from(|r| ember_output(r, d, h)),
        Move::QkvBias => array.rows_from(|r| ember_output(r, d, h)),
    }
}

/// A GPT-NeoX tensor in ember's layout.
fn from_neox(array: &Array, how: Move, config: &DecoderOnlyConfig) -> Array {
    let (d, h) = (config.d_model, config.n_heads);
    match how {
        Move::Same => array.clone(),
        Move::Transposed => array.transposed(),
        Move::QkvWeight => array.rows_from(|c| neox_output(c, d, h)).transposed(),
        Move::QkvBias => array.rows_from(|c| neox_output(c, d, h)),
    }
}

/// The `f32` values of a stored tensor (stored as `f32`, `f16` or `bf16`).
fn read_array(view: &TensorView<'_>) -> std::result::Result<Array, String> {
    let dtype = match view.dtype() {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        other => {
            return Err(format!(
                "is stored as {other:?}; ember reads F32, F16 and BF16"
            ));
        }
    };
    let shape = view.shape().to_vec();
    let data = TensorData::from_bytes_vec(view.data().to_vec(), shape.clone(), dtype);
    let values = data
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| format!("cannot be read as f32: {e:?}"))?;
    Ok(Array { shape, values })
}

/// Safetensors bytes of `arrays` (`f32`).
fn serialize(arrays: &BTreeMap<String, Array>) -> std::result::Result<Vec<u8>, String> {
    let bytes: BTreeMap<&str, (Vec<usize>, Vec<u8>)> = arrays
        .iter()
        .map(|(name, a)| {
            let raw = a.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name.as_str(), (a.shape.clone(), raw))
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, (shape, raw))| {
            TensorView::new(Dtype::F32, shape.clone(), raw).map(|view| (*name, view))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let metadata = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize(views, Some(metadata)).map_err(|e| e.to_string())
}

/// Writes `model` (whose every linear layer has a bias) in GPT-NeoX's layout to `path`.
pub(super) fn write_weights(
    model: &DecoderOnly,
    config: &DecoderOnlyConfig,
    path: &Path,
) -> Result<()> {
    let failed = |e: String| write_err(path, e);
    let mut store = SafetensorsStore::from_bytes(None);
    model
        .save_into(&mut store)
        .map_err(|e| failed(e.to_string()))?;
    let bytes = store.get_bytes().map_err(|e| failed(e.to_string()))?;
    let ours = SafeTensors::deserialize(&bytes).map_err(|e| failed(e.to_string()))?;
    let mut theirs = BTreeMap::new();
    for entry in entries(config) {
        let view = ours
            .tensor(&entry.ember)
            .map_err(|e| failed(format!("{}: {e}", entry.ember)))?;
        let array = read_array(&view).map_err(|e| failed(format!("{}: {e}", entry.ember)))?;
        theirs.insert(entry.neox, to_neox(&array, entry.how, config));
    }
    let bytes = serialize(&theirs).map_err(failed)?;
    std::fs::write(path, bytes).map_err(|e| write_err(path, e))
}

/// Reads GPT-NeoX weights from `path` into `model` (built from `neox.to_ember`); every tensor
/// must be there with its shape, but for the attention's biases of a model without them.
pub(super) fn load_weights(
    model: DecoderOnly,
    config: &DecoderOnlyConfig,
    neox: &NeoxConfig,
    path: &Path,
) -> Result<DecoderOnly> {
    let bad = |message: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message,
    };
    let bytes = std::fs::read(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| bad(format!("cannot read: {e}")))?;
    let mut ours = BTreeMap::new();
    for entry in entries(config) {
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
        ours.insert(entry.ember, from_neox(&array, entry.how, config));
    }
    let bytes = serialize(&ours).map_err(|e| bad(format!("cannot convert: {e}")))?;
    let mut model = model;
    let mut store = SafetensorsStore::from_bytes(Some(bytes)).validate(false);
    let result = model
        .load_from(&mut store)
        .map_err(|e| bad(format!("cannot read: {e}")))?;
    // Every tensor was checked above: what is left is ember's side.
    let left = result.errors.first().map(|e| match e {
        ApplyError::ShapeMismatch { path, .. } => path.clone(),
        other => other.to_string(),
    });
    if let Some(what) = left.or_else(|| result.missing.first().map(|(p, _)| p.clone())) {
        return Err(bad(format!(
            "does not fit the model config.json describes: {what}"
        )));
    }
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fused_projection_regroups_by_head_and_back() {
        // d_model 6, 2 heads of 3: ember [q0 q1 | k0 k1 | v0 v1], GPT-NeoX [q0 k0 v0 | q1 k1 v1].
        let neox: Vec<usize> = (0..18).map(|r| ember_output(r, 6, 2)).collect();
        assert_eq!(
            neox,
            [0, 1, 2, 6, 7, 8, 12, 13, 14, 3, 4, 5, 9, 10, 11, 15, 16, 17]
        );
        for c in 0..18 {
            assert_eq!(ember_output(neox_output(c, 6, 2), 6, 2), c);
        }
        let config = DecoderOnlyConfig {
            d_model: 6,
            n_heads: 2,
            ..Default::default()
        };
        let weight = Array {
            shape: vec![6, 18],
            values: (0..108).map(|v| v as f32).collect(),
        };
        let theirs = to_neox(&weight, Move::QkvWeight, &config);
        assert_eq!(theirs.shape, [18, 6]);
        // GPT-NeoX's output 3 (head 0's first key) is ember's output 6, whose weights from
        // input i sit at [i, 6].
        let column: Vec<f32> = (0..6).map(|i| weight.values[i * 18 + 6]).collect();
        assert_eq!(&theirs.values[3 * 6..4 * 6], column.as_slice());
        assert_eq!(from_neox(&theirs, Move::QkvWeight, &config), weight);
        let bias = Array {
            shape: vec![18],
            values: (0..18).map(|v| v as f32).collect(),
        };
        let moved = to_neox(&bias, Move::QkvBias, &config);
        assert_eq!(moved.values[3], 6.0);
        assert_eq!(from_neox(&moved, Move::QkvBias, &config), bias);
    }
}
