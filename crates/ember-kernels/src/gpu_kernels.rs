//! Which of ember's GPU kernels run: the environment variable `EMBER_GPU_KERNELS`.
//!
//! Each op of `cube` is faster than Burn's ops on some GPUs and shapes and not on others (on
//! one H100, ember's attention kernels are slower than Burn's autotuned products for nanoGPT's
//! GPU config, while the fused AdamW is faster), so each can be turned off on its own, for
//! comparisons and until every kernel wins everywhere:
//!
//! - unset or `on`: all of them;
//! - `off`: none (every op runs its reference in Burn's ops);
//! - `-attention,-layer-norm`: all but the ones named;
//! - `attention,adamw`: only the ones named.
//!
//! Flex's CPU kernels are not affected.

use std::sync::OnceLock;

/// The environment variable that chooses the kernels.
pub const VARIABLE: &str = "EMBER_GPU_KERNELS";

/// One of ember's GPU kernels (each an op of `cube`); its discriminant is its place in
/// [`GpuKernel::ALL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuKernel {
    /// Causal self-attention in training and on a prompt, forward and backward.
    Attention,
    /// Attention over the KV cache's whole buffer, when decoding.
    CachedAttention,
    /// LayerNorm, forward and backward.
    LayerNorm,
    /// GELU (exact and tanh), forward and backward.
    Gelu,
    /// Dropout in training, forward and backward.
    Dropout,
    /// The AdamW update of one parameter and its moments.
    AdamW,
    /// The sum of squares of all gradients, for global-norm clipping.
    Norm,
    /// A linear layer's rows as one product (training, prompts), and its product and bias for
    /// a few rows in one kernel (decoding).
    Linear,
    /// The write of a decoding step's keys and values into the KV cache.
    CacheWrite,
    /// The cross-entropy loss, forward and backward.
    CrossEntropy,
    /// The gradient of an embedding table (small vocabularies).
    Embedding,
    /// A token drawn from a decoding step's logits at a temperature.
    Draw,
    /// Not a kernel: a one-token decoding step captured once as a graph (CUDA graphs; recorded
    /// dispatches on wgpu) and replayed for each token, instead of launching its kernels one by
    /// one.
    StepGraph,
    /// Not a kernel: the weight gradient `X^T dY` of a linear layer over many rows (a training
    /// step's) as partial products over chunks of the rows, summed (split-K), so that its small
    /// output gives the GPU enough blocks of work ([`crate::matmul`]).
    SplitK,
    /// Not ember's kernel: the matrix products of linear layers (forward and backward, many
    /// rows) by NVIDIA's cuBLAS on CUDA where it can be loaded, instead of cubek's
    /// ([`crate::matmul`]).
    Cublas,
    /// Not a kernel of its own: the training attention's forward and backward passes in
    /// register tiles (each unit 8 rows by 4 columns of the scores, 8 rows by `K / 8` columns
    /// of its output) for head sizes 32 and 64; off, or for other sizes, one row per unit.
    AttentionTiles,
    /// Not a kernel of its own: on CUDA with cuBLAS (and `cublas` on), the training attention's
    /// forward and backward passes as cuBLAS's batched products over one head's stored scores,
    /// with small kernels between them (`cube/attention_products`); off, the fused kernels.
    AttentionProducts,
    /// Not a kernel of its own: the elementwise kernels (GELU, dropout) on bf16 and f16 tensors
    /// read and write vectors (8 values on CUDA) instead of one value per unit (`f32` tensors
    /// always do).
    NarrowVectors,
}

impl GpuKernel {
    /// Every kernel, in the order of [`GpuKernel::name`]'s list.
    pub const ALL: [GpuKernel; 18] = [
        GpuKernel::Attention,
        GpuKernel::CachedAttention,
        GpuKernel::LayerNorm,
        GpuKernel::Gelu,
        GpuKernel::Dropout,
        GpuKernel::AdamW,
        GpuKernel::Norm,
        GpuKernel::Linear,
        GpuKernel::CacheWrite,
        GpuKernel::CrossEntropy,
        GpuKernel::Embedding,
        GpuKernel::Draw,
        GpuKernel::StepGraph,
        GpuKernel::SplitK,
        GpuKernel::Cublas,
        GpuKernel::AttentionTiles,
        GpuKernel::AttentionProducts,
        GpuKernel::NarrowVectors,
    ];

    /// The kernel's name in `EMBER_GPU_KERNELS`.
    pub fn name(self) -> &'static str {
        match self {
            GpuKernel::Attention => "attention",
            GpuKernel::CachedAttention => "cached-attention",
            GpuKernel::LayerNorm => "layer-norm",
            GpuKernel::Gelu => "gelu",
            GpuKernel::Dropout => "dropout",
            GpuKernel::AdamW => "adamw",
            GpuKernel::Norm => "norm",
            GpuKernel::Linear => "linear",
            GpuKernel::CacheWrite => "cache-write",
            GpuKernel::CrossEntropy => "cross-entropy",
            GpuKernel::Embedding => "embedding",
            GpuKernel::Draw => "draw",
            GpuKernel::StepGraph => "step-graph",
            GpuKernel::SplitK => "split-k",
            GpuKernel::Cublas => "cublas",
            GpuKernel::AttentionTiles => "attention-tiles",
            GpuKernel::AttentionProducts => "attention-products",
            GpuKernel::NarrowVectors => "narrow-vectors",
        }
    }
}

/// The set of kernels that run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuKernels {
    on: [bool; GpuKernel::ALL.len()],
}

impl Default for GpuKernels {
    /// All of them.
    fn default() -> Self {
        GpuKernels {
            on: [true; GpuKernel::ALL.len()],
        }
    }
}

impl GpuKernels {
    /// Parses a value of `EMBER_GPU_KERNELS` (see the module's documentation); the error names
    /// the variable, the value and what is accepted.
    pub fn parse(value: &str) -> Result<Self, String> {
        let value = value.trim();
        match value {
            "" | "on" => return Ok(GpuKernels::default()),
            "off" => {
                return Ok(GpuKernels {
                    on: [false; GpuKernel::ALL.len()],
                });
            }
            _ => {}
        }
        let entries: Vec<&str> = value.split(',').map(str::trim).collect();
        let removing = entries.iter().filter(|e| e.starts_with('-')).count();
        let bad = |why: String| {
            let names: Vec<&str> = GpuKernel::ALL.iter().map(|k| k.name()).collect();
            format!(
                "{VARIABLE}={value:?}: {why} (expected on, off, or a comma-separated list of {}; \
                 each with a leading '-' to turn just those off)",
                names.join(", ")
            )
        };
        if removing != 0 && removing != entries.len() {
            return Err(bad("mixes kernels to keep with kernels to remove".into()));
        }
        let mut on = [removing != 0; GpuKernel::ALL.len()];
        for entry in entries {
            let name = entry.trim_start_matches('-');
            let kernel = GpuKernel::ALL
                .into_iter()
                .find(|k| k.name() == name)
                .ok_or_else(|| bad(format!("unknown kernel {name:?}")))?;
            on[kernel as usize] = removing == 0;
        }
        Ok(GpuKernels { on })
    }

    /// The set the environment asks for (all of them where the variable is unset).
    pub fn from_env() -> Result<Self, String> {
        match std::env::var(VARIABLE) {
            Ok(value) => GpuKernels::parse(&value),
            Err(std::env::VarError::NotPresent) => Ok(GpuKernels::default()),
            Err(std::env::VarError::NotUnicode(_)) => Err(format!("{VARIABLE} is not UTF-8")),
        }
    }

    /// Whether `kernel` runs.
    pub fn uses(&self, kernel: GpuKernel) -> bool {
        self.on[kernel as usize]
    }
}

/// Whether `kernel` runs in this process: [`GpuKernels::from_env`], read once. A value that does
/// not parse leaves all kernels on (the `ember` binary refuses it at start-up, in one line).
pub fn uses(kernel: GpuKernel) -> bool {
    static KERNELS: OnceLock<GpuKernels> = OnceLock::new();
    KERNELS
        .get_or_init(|| GpuKernels::from_env().unwrap_or_default())
        .uses(kernel)
}

/// The environment variable that turns on cuDNN's flash attention for the training attention of
/// a bf16 (or f16) projection on CUDA (`1` or `on`; unset, `0` or `off`: not used). Off by
/// default until its start-up check agrees on the GPUs measured (docs/benchmarks.md).
pub const CUDNN_VARIABLE: &str = "EMBER_CUDNN_ATTENTION";

/// Parses a value of `EMBER_CUDNN_ATTENTION`; the error names the variable, the value and what
/// is accepted.
pub fn parse_cudnn(value: &str) -> Result<bool, String> {
    match value.trim() {
        "1" | "on" => Ok(true),
        "" | "0" | "off" => Ok(false),
        other => Err(format!(
            "{CUDNN_VARIABLE}={other:?}: expected on (or 1) to use cuDNN's flash attention, off (or 0) not to"
        )),
    }
}

/// [`parse_cudnn`] of the environment's value (off where it is unset).
pub fn cudnn_from_env() -> Result<bool, String> {
    match std::env::var(CUDNN_VARIABLE) {
        Ok(value) => parse_cudnn(&value),
        Err(std::env::VarError::NotPresent) => Ok(false),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{CUDNN_VARIABLE} is not UTF-8")),
    }
}

/// Whether cuDNN's flash attention is on in this process: [`cudnn_from_env`], read once; a
/// value that does not parse counts as off (the `ember` binary refuses it at start-up, in one
/// line).
pub fn cudnn_attention() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| cudnn_from_env().unwrap_or(false))
}

/// The environment variable that fixes the number of chunks of rows of [`GpuKernel::SplitK`]
/// (for benchmarks): `auto` (or unset) for ember's rule, or a power of two from 1 to 64.
pub const SPLIT_VARIABLE: &str = "EMBER_SPLIT_K";

/// Parses a value of `EMBER_SPLIT_K`: `None` for `auto`, else the fixed number of chunks; the
/// error names the variable, the value and what is accepted.
pub fn parse_split(value: &str) -> Result<Option<usize>, String> {
    let value = value.trim();
    if value.is_empty() || value == "auto" {
        return Ok(None);
    }
    match value.parse::<usize>() {
        Ok(n) if n.is_power_of_two() && n <= 64 => Ok(Some(n)),
        _ => Err(format!(
            "{SPLIT_VARIABLE}={value:?}: expected auto or a power of two from 1 to 64 (chunks of \
             rows of a linear layer's weight gradient)"
        )),
    }
}

/// [`parse_split`] of the environment's value (`None` where it is unset).
pub fn split_from_env() -> Result<Option<usize>, String> {
    match std::env::var(SPLIT_VARIABLE) {
        Ok(value) => parse_split(&value),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{SPLIT_VARIABLE} is not UTF-8")),
    }
}

/// [`split_from_env`] in this process, read once; a value that does not parse counts as `auto`
/// (the `ember` binary refuses it at start-up, in one line).
pub fn fixed_split() -> Option<usize> {
    static SPLIT: OnceLock<Option<usize>> = OnceLock::new();
    *SPLIT.get_or_init(|| split_from_env().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(kernels: GpuKernels) -> Vec<&'static str> {
        GpuKernel::ALL
            .into_iter()
            .filter(|&k| kernels.uses(k))
            .map(GpuKernel::name)
            .collect()
    }

    #[test]
    fn parses_on_off_and_lists() {
        let all: Vec<_> = GpuKernel::ALL.map(GpuKernel::name).into();
        assert_eq!(on(GpuKernels::parse("on").unwrap()), all);
        assert_eq!(on(GpuKernels::parse("").unwrap()), all);
        assert!(on(GpuKernels::parse("off").unwrap()).is_empty());
        assert_eq!(
            on(GpuKernels::parse("-attention, -layer-norm").unwrap()),
            [
                "cached-attention",
                "gelu",
                "dropout",
                "adamw",
                "norm",
                "linear",
                "cache-write",
                "cross-entropy",
                "embedding",
                "draw",
                "step-graph",
                "split-k",
                "cublas",
                "attention-tiles",
                "attention-products",
                "narrow-vectors",
            ]
        );
        assert_eq!(
            on(GpuKernels::parse("adamw,cached-attention").unwrap()),
            ["cached-attention", "adamw"]
        );
    }

    #[test]
    fn refuses_unknown_names_and_mixed_lists_in_one_line() {
        let unknown = GpuKernels::parse("attention,softmax").unwrap_err();
        assert!(
            unknown.contains("EMBER_GPU_KERNELS=\"attention,softmax\""),
            "{unknown}"
        );
        assert!(unknown.contains("unknown kernel \"softmax\""), "{unknown}");
        assert!(unknown.contains("cached-attention"), "{unknown}");
        let mixed = GpuKernels::parse("attention,-gelu").unwrap_err();
        assert!(mixed.contains("mixes"), "{mixed}");
        assert!(!unknown.contains('\n') && !mixed.contains('\n'));
        assert!(GpuKernels::parse("-").is_err());
    }

    #[test]
    fn parses_the_cudnn_switch() {
        for on in ["1", "on", " on "] {
            assert_eq!(parse_cudnn(on), Ok(true), "{on}");
        }
        for off in ["", "0", "off"] {
            assert_eq!(parse_cudnn(off), Ok(false), "{off}");
        }
        let e = parse_cudnn("yes").unwrap_err();
        assert!(
            e.starts_with("EMBER_CUDNN_ATTENTION=\"yes\"") && e.contains("expected on"),
            "{e}"
        );
    }

    #[test]
    fn parses_split_factors() {
        assert_eq!(parse_split("auto"), Ok(None));
        assert_eq!(parse_split(""), Ok(None));
        assert_eq!(parse_split("1"), Ok(Some(1)));
        assert_eq!(parse_split(" 16 "), Ok(Some(16)));
        for bad in ["0", "3", "128", "-4", "eight"] {
            let e = parse_split(bad).unwrap_err();
            assert!(
                e.starts_with("EMBER_SPLIT_K=") && e.contains("power of two"),
                "{e}"
            );
        }
    }
}
