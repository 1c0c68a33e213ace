//! The TOML run config: `[model]`, `[data]` and `[training]`. Every field is documented here,
//! has a default, and unknown keys are rejected.

use std::path::{Path, PathBuf};

use ember_model::DecoderOnlyConfig;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError, value_err};
use crate::precision::Precision;
use crate::schedule::{Schedule, ScheduleKind};

/// A whole run: what to train, on what, and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// `"lm"` (the default) for language modelling; translation configs say `"translation"`.
    pub task: String,
    /// The model; see [`DecoderOnlyConfig`]. `vocab_size` is filled in from the tokenizer.
    pub model: DecoderOnlyConfig,
    /// The corpus and tokenizer.
    pub data: DataConfig,
    /// Optimisation, evaluation and checkpointing.
    pub training: TrainingConfig,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            task: "lm".into(),
            model: DecoderOnlyConfig::default(),
            data: DataConfig::default(),
            training: TrainingConfig::default(),
        }
    }
}

/// How text becomes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// One token per character of the corpus.
    #[default]
    Char,
    /// Byte-level BPE trained on the corpus (or loaded from `tokenizer_file`).
    Bpe,
}

/// The `[data]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// UTF-8 text file to train on. Default `data/tinyshakespeare.txt`.
    pub path: PathBuf,
    /// `char` (default) or `bpe`.
    pub tokenizer: TokenizerKind,
    /// BPE vocabulary size when training one. Default 512.
    pub bpe_vocab_size: usize,
    /// A Hugging Face `tokenizer.json` to use instead of training a BPE.
    pub tokenizer_file: Option<PathBuf>,
    /// Fraction of the corpus used for training; the rest is validation. Default 0.9.
    pub train_fraction: f64,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            path: PathBuf::from("data/tinyshakespeare.txt"),
            tokenizer: TokenizerKind::Char,
            bpe_vocab_size: 512,
            tokenizer_file: None,
            train_fraction: 0.9,
        }
    }
}

/// The `[training]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingConfig {
    /// Compute device: `flex` (default), `ndarray`, `wgpu`, `vulkan`, `cuda[:N]` or `auto`; or
    /// several, comma-separated (`cuda:0,cuda:1`), for data-parallel training: the step's
    /// `grad_accum` micro-batches are spread over them, so `grad_accum` must be a multiple of
    /// their number.
    pub device: String,
    /// Seed of weights, batches and dropout. Default 1337.
    pub seed: u64,
    /// Sequences per micro-batch. Default 12.
    pub batch_size: usize,
    /// Micro-batches whose gradients are summed before each optimizer step. Default 1.
    pub grad_accum: usize,
    /// Optimizer steps. Default 2000.
    pub max_steps: u64,
    /// Peak learning rate. Default 1e-3.
    pub lr: f64,
    /// Final learning rate of the cosine schedule. Default 1e-4.
    pub min_lr: f64,
    /// Linear warmup steps. Default 100.
    pub warmup_steps: u64,
    /// Step where the cosine reaches `min_lr`. Default `max_steps`.
    pub decay_steps: Option<u64>,
    /// `cosine` (default), `constant` or `inverse_sqrt`.
    pub schedule: ScheduleKind,
    /// AdamW beta1. Default 0.9.
    pub beta1: f64,
    /// AdamW beta2. Default 0.99.
    pub beta2: f64,
    /// AdamW epsilon. Default 1e-8.
    pub eps: f64,
    /// Decoupled weight decay of weight matrices (not biases, norms). Default 0.1.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this; 0 turns clipping off. Default 1.0.
    pub grad_clip: f64,
    /// Label smoothing of the training loss (the transformer paper uses 0.1). Default 0.
    pub label_smoothing: f64,
    /// Evaluate every this many steps (and at the end). Default 250.
    pub eval_interval: u64,
    /// Batches averaged for each train/val loss estimate. Default 20.
    pub eval_batches: usize,
    /// Write a checkpoint every this many steps (and at the end). Default 500.
    pub checkpoint_interval: u64,
    /// Checkpoints kept on disk (the newest). Default 2.
    pub keep_checkpoints: usize,
    /// Update the progress line (or, off a terminal, print a log line) every this many
    /// steps. Default 10.
    pub log_interval: u64,
    /// Stop once this many evaluations in a row have not lowered the best validation loss
    /// (the best checkpoint is kept either way). Default: off.
    pub early_stop_patience: Option<u64>,
    /// Float type of the products: `f32` (default) or `bf16` (bf16 products with `f32`
    /// weights, optimizer state, norms, softmax and loss; for GPUs). See [`Precision`].
    pub precision: Precision,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            device: "flex".into(),
            seed: 1337,
            batch_size: 12,
            grad_accum: 1,
            max_steps: 2000,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 100,
            decay_steps: None,
            schedule: ScheduleKind::Cosine,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
            label_smoothing: 0.0,
            eval_interval: 250,
            eval_batches: 20,
            checkpoint_interval: 500,
            keep_checkpoints: 2,
            log_interval: 10,
            early_stop_patience: None,
            precision: Precision::F32,
        }
    }
}

impl TrainingConfig {
    /// The devices a run uses: `override_name` (`--device`) if given, else `device`; the first
    /// holds the model.
    pub fn devices(&self, override_name: Option<&str>) -> Result<Vec<burn::tensor::Device>> {
        crate::device::parse_list(override_name.unwrap_or(&self.device))
    }

    /// The learning-rate schedule these settings describe.
    pub fn schedule(&self) -> Schedule {
        Schedule {
            kind: self.schedule,
            lr: self.lr,
            min_lr: self.min_lr,
            warmup_steps: self.warmup_steps,
            decay_steps: self.decay_steps.unwrap_or(self.max_steps),
        }
    }

    /// Checks every value; the error names `training.<key>` and the value.
    pub fn validate(&self) -> Result<()> {
        let positive_int = |key: &str, v: u64| {
            if v == 0 {
                Err(value_err(
                    &format!("training.{key}"),
                    "must be at least 1, got 0",
                ))
            } else {
                Ok(())
            }
        };
        positive_int("batch_size", self.batch_size as u64)?;
        positive_int("grad_accum", self.grad_accum as u64)?;
        positive_int("max_steps", self.max_steps)?;
        positive_int("eval_interval", self.eval_interval)?;
        positive_int("eval_batches", self.eval_batches as u64)?;
        positive_int("checkpoint_interval", self.checkpoint_interval)?;
        positive_int("keep_checkpoints", self.keep_checkpoints as u64)?;
        positive_int("log_interval", self.log_interval)?;
        if let Some(patience) = self.early_stop_patience {
            positive_int("early_stop_patience", patience)?;
        }
        let positive_float = |key: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(value_err(
                    &format!("training.{key}"),
                    format!("must be a positive number, got {v}"),
                ))
            }
        };
        positive_float("lr", self.lr)?;
        positive_float("eps", self.eps)?;
        let non_negative = |key: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(value_err(
                    &format!("training.{key}"),
                    format!("must be zero or positive, got {v}"),
                ))
            }
        };
        non_negative("min_lr", self.min_lr)?;
        non_negative("weight_decay", self.weight_decay)?;
        non_negative("grad_clip", self.grad_clip)?;
        if !(0.0..1.0).contains(&self.label_smoothing) {
            return Err(value_err(
                "training.label_smoothing",
                format!("must be in [0, 1), got {}", self.label_smoothing),
            ));
        }
        for (key, v) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(value_err(
                    &format!("training.{key}"),
                    format!("must be in [0, 1), got {v}"),
                ));
            }
        }
        if self.min_lr > self.lr {
            return Err(value_err(
                "training.min_lr",
                format!("= {} is above training.lr = {}", self.min_lr, self.lr),
            ));
        }
        let devices = crate::device::check_list(&self.device)?;
        if !self.grad_accum.is_multiple_of(devices) {
            return Err(value_err(
                "training.grad_accum",
                format!(
                    "= {} is not a multiple of the {devices} devices in training.device = \"{}\" \
                     (each device takes whole micro-batches)",
                    self.grad_accum, self.device
                ),
            ));
        }
        Ok(())
    }
}

impl DataConfig {
    /// Checks every value; the error names `data.<key>` and the value.
    pub fn validate(&self) -> Result<()> {
        if !(self.train_fraction > 0.0 && self.train_fraction < 1.0) {
            return Err(value_err(
                "data.train_fraction",
                format!(
                    "must be between 0 and 1 (exclusive), got {}",
                    self.train_fraction
                ),
            ));
        }
        if self.tokenizer == TokenizerKind::Bpe
            && self.tokenizer_file.is_none()
            && self.bpe_vocab_size < 257
        {
            return Err(value_err(
                "data.bpe_vocab_size",
                format!(
                    "must be at least 257 (256 bytes + merges), got {}",
                    self.bpe_vocab_size
                ),
            ));
        }
        Ok(())
    }
}

impl RunConfig {
    /// Reads and validates a config file. Errors name the file, and the line and key or the
    /// key and value at fault.
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_with(path, &[])
    }

    /// Reads a config file, applies command-line overrides (in order), and validates the
    /// result. Errors name the file or the override at fault.
    pub fn load_with(path: &Path, overrides: &[Override]) -> Result<Self> {
        let config: Self = parse_with(path, overrides)?;
        config.validate().map_err(|e| blame(path, overrides, e))?;
        Ok(config)
    }

    /// Parses and validates config text.
    pub fn parse(text: &str) -> Result<Self> {
        let config: RunConfig = toml::from_str(text).map_err(|e| TrainError::ConfigFile {
            path: PathBuf::from("<config>"),
            message: one_line(&e),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks all sections. The model's `vocab_size` may still be 0 (it comes from the data).
    pub fn validate(&self) -> Result<()> {
        if self.task != "lm" {
            return Err(value_err(
                "task",
                format!("must be \"lm\" here, got {:?}", self.task),
            ));
        }
        let mut model = self.model.clone();
        if model.vocab_size == 0 {
            model.vocab_size = 1;
        }
        model.validate()?;
        self.data.validate()?;
        self.training.validate()
    }

    /// The config as TOML, as saved beside checkpoints.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("the config always serializes")
    }
}

/// Reads `path` and deserializes it; errors name the file and the parser's line and key.
pub(crate) fn parse_toml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::ConfigFile {
        path: path.to_path_buf(),
        message: format!("cannot read config: {e}"),
    })?;
    toml::from_str(&text).map_err(|e| TrainError::ConfigFile {
        path: path.to_path_buf(),
        message: one_line(&e),
    })
}

/// One `--set section.key=value` of the command line: a config value given beside the file,
/// as nanoGPT's `--batch_size=32`. The value is read as TOML (`3e-4`, `true`, `"cuda"`, `[1,
/// 2]`); a value that is not TOML is taken as a string, so `training.device=cuda` works.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    /// The dotted key, e.g. `training.lr`.
    pub key: String,
    /// The value.
    pub value: toml::Value,
    text: String,
}

impl std::str::FromStr for Override {
    type Err = TrainError;

    fn from_str(text: &str) -> Result<Self> {
        let bad = |message: &str| TrainError::Override {
            text: text.to_string(),
            message: message.to_string(),
        };
        let Some((key, value)) = text.split_once('=') else {
            return Err(bad("expected section.key=value, e.g. training.lr=3e-4"));
        };
        let key = key.trim();
        let well_formed = |part: &str| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        if !key.split('.').all(well_formed) {
            return Err(bad("the key must be dotted names, e.g. training.lr"));
        }
        if key == "task" {
            return Err(bad(
                "the task is the config file's: choose a config of the other task",
            ));
        }
        let value = value.trim();
        let value = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.to_string()));
        Ok(Self {
            key: key.to_string(),
            value,
            text: text.to_string(),
        })
    }
}

impl std::fmt::Display for Override {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.text)
    }
}

impl Override {
    fn error(&self, message: impl Into<String>) -> TrainError {
        TrainError::Override {
            text: self.text.clone(),
            message: message.into(),
        }
    }

    /// Sets the value in a parsed config file, making sections as needed.
    fn apply(&self, table: &mut toml::Table) -> Result<()> {
        let parts: Vec<&str> = self.key.split('.').collect();
        let (last, sections) = parts.split_last().expect("a key has one part at least");
        let mut at = table;
        for (i, section) in sections.iter().enumerate() {
            let entry = at
                .entry(section.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            at = entry.as_table_mut().ok_or_else(|| {
                self.error(format!(
                    "`{}` is a value, not a section",
                    parts[..=i].join(".")
                ))
            })?;
        }
        at.insert(last.to_string(), self.value.clone());
        Ok(())
    }
}

/// Reads `path`, applies `overrides` one at a time, and deserializes. The file alone is read
/// first, so that its own errors name its line; each override is then checked as it is applied,
/// so that an unknown key or a value of the wrong type names the override.
pub(crate) fn parse_with<T: serde::de::DeserializeOwned>(
    path: &Path,
    overrides: &[Override],
) -> Result<T> {
    let parsed: T = parse_toml(path)?;
    if overrides.is_empty() {
        return Ok(parsed);
    }
    let mut table: toml::Table = parse_toml(path)?;
    for o in overrides {
        o.apply(&mut table)?;
        toml::Value::Table(table.clone())
            .try_into::<T>()
            .map_err(|e| o.error(e.message().trim().replace('\n', " ")))?;
    }
    toml::Value::Table(table)
        .try_into::<T>()
        .map_err(|e| TrainError::ConfigFile {
            path: path.to_path_buf(),
            message: e.message().trim().to_string(),
        })
}

/// A validation error of a config read from `path` with `overrides`: the override whose key
/// it names is blamed, else the file.
pub(crate) fn blame(path: &Path, overrides: &[Override], e: TrainError) -> TrainError {
    let text = e.to_string();
    let named = |o: &&Override| {
        let last = o.key.rsplit('.').next().unwrap_or_default();
        text.contains(&o.key)
            || text.contains(&format!("`{last}`"))
            || text.contains(&format!("{last} "))
    };
    match overrides.iter().rev().find(named) {
        Some(o) if matches!(e, TrainError::ConfigValue { .. } | TrainError::Model(_)) => {
            o.error(text)
        }
        _ => in_file(path, e),
    }
}

/// A validation error of the config read from `path`, prefixed with the file's name.
pub(crate) fn in_file(path: &Path, e: TrainError) -> TrainError {
    match e {
        TrainError::ConfigValue { .. } | TrainError::Model(_) => TrainError::ConfigFile {
            path: path.to_path_buf(),
            message: e.to_string(),
        },
        other => other,
    }
}

/// The `task` a config file declares (`"lm"` when it has none), read before the whole file is
/// parsed so the right config type can be chosen.
pub fn task_of(path: &Path) -> Result<String> {
    let table: toml::Table = parse_toml(path)?;
    match table.get("task") {
        None => Ok("lm".into()),
        Some(toml::Value::String(task)) if task == "lm" || task == "translation" => {
            Ok(task.clone())
        }
        Some(other) => Err(in_file(
            path,
            value_err(
                "task",
                format!("must be \"lm\" or \"translation\", got {other}"),
            ),
        )),
    }
}

/// The TOML parser's message on one line: "line 3, column 1: unknown field `d_modle`, ...".
fn one_line(e: &toml::de::Error) -> String {
    let message = e.message().trim().replace('\n', " ");
    let full = e.to_string();
    let location = full.lines().next().unwrap_or_default();
    match location.strip_prefix("TOML parse error at ") {
        Some(at) => format!("{at}: {message}"),
        None => message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        RunConfig::parse(text).unwrap_err().to_string()
    }

    #[test]
    fn defaults_parse_and_sections_override() {
        let c = RunConfig::parse("[model]\nd_model = 64\n[training]\nlr = 3e-4\n").unwrap();
        assert_eq!(c.model.d_model, 64);
        assert_eq!(c.training.lr, 3e-4);
        assert_eq!(c.training.batch_size, 12);
        let again = RunConfig::parse(&c.to_toml()).unwrap();
        assert_eq!(again, c);
    }

    fn temp_config(text: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "ember-override-{}-{}.toml",
            std::process::id(),
            text.len()
        ));
        std::fs::write(&path, text).unwrap();
        path
    }

    fn set(items: &[&str]) -> Vec<Override> {
        items.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn overrides_set_values_and_errors_name_them() {
        let path = temp_config("[model]\nd_model = 64\n[training]\nlr = 1e-3\n");
        let c = RunConfig::load_with(
            &path,
            &set(&[
                "training.lr=3e-4",
                "model.n_layers=6",
                "training.device=flex",
                "model.positional=\"rotary\"",
                "data.train_fraction = 0.8",
            ]),
        )
        .unwrap();
        assert_eq!(c.training.lr, 3e-4);
        assert_eq!(c.model.n_layers, 6);
        assert_eq!(c.model.d_model, 64, "the file's other values stay");
        assert_eq!(c.training.device, "flex");
        assert_eq!(c.data.train_fraction, 0.8);
        assert!(c.to_toml().contains("lr = 0.0003"), "{}", c.to_toml());

        let err = |items: &[&str]| {
            RunConfig::load_with(&path, &set(items))
                .unwrap_err()
                .to_string()
        };
        let e = err(&["training.lrr=1"]);
        assert!(
            e.starts_with("--set training.lrr=1:") && e.contains("lrr"),
            "{e}"
        );
        let e = err(&["trainin.lr=1"]);
        assert!(
            e.contains("--set trainin.lr=1") && e.contains("trainin"),
            "{e}"
        );
        let e = err(&["training.batch_size=twelve"]);
        assert!(e.contains("--set training.batch_size=twelve"), "{e}");
        let e = err(&["training.lr=-1"]);
        assert!(
            e.contains("--set training.lr=-1") && e.contains("-1"),
            "{e}"
        );
        let e = err(&["model.n_heads=5"]);
        assert!(
            e.contains("--set model.n_heads=5") && e.contains("n_heads"),
            "{e}"
        );
        let e = err(&["training.lr.x=1"]);
        assert!(e.contains("not a section"), "{e}");
        for bad in ["training.lr", "=3", "training..lr=1", "task=translation"] {
            assert!(bad.parse::<Override>().is_err(), "{bad}");
        }
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn errors_name_the_key_and_the_value() {
        let e = err("[model]\nd_modle = 64\n");
        assert!(e.contains("d_modle") && e.contains("line 2"), "{e}");
        let e = err("[trainin]\nlr = 1\n");
        assert!(e.contains("trainin"), "{e}");
        let e = err("[training]\nbatch_size = \"twelve\"\n");
        assert!(e.contains("twelve") || e.contains("invalid type"), "{e}");
        let e = err("[training]\nlr = nan\n");
        assert!(e.contains("training.lr") && e.contains("NaN"), "{e}");
        let e = err("[training]\nlr = -0.1\n");
        assert!(e.contains("training.lr") && e.contains("-0.1"), "{e}");
        let e = err("[training]\nbatch_size = 0\n");
        assert!(e.contains("training.batch_size"), "{e}");
        let e = err("[training]\nbatch_size = -3\n");
        assert!(e.contains("batch_size") || e.contains("-3"), "{e}");
        let e = err("[model]\nd_model = 30\nn_heads = 4\n");
        assert!(e.contains("n_heads") && e.contains("30"), "{e}");
        let e = err("[model]\ncontext_len = 128\nmax_positions = 64\n");
        assert!(e.contains("context_len") && e.contains("64"), "{e}");
        let e = err("[training]\ndevice = \"tpu\"\n");
        assert!(e.contains("tpu") && e.contains("flex"), "{e}");
        let e = err("this is not toml");
        assert!(e.contains("line 1"), "{e}");
    }
}
