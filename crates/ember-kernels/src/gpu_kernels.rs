//! Which of ember's GPU kernels and strategies run: a policy value ([`GpuPolicy`]) that the
//! application sets ([`set_policy`]; the `ember` binary builds it from the environment
//! variables `EMBER_GPU_KERNELS`, `EMBER_SPLIT_K` and `EMBER_CUDNN_ATTENTION` at start-up, and
//! refuses a bad value in one line) and a test or a caller may scope to one thread
//! ([`with_policy`]). The library itself never reads the environment for it; without a
//! [`set_policy`] everything is on but cuDNN's attention (opt-in).
//!
//! Each op of `cube` is faster than Burn's ops on some GPUs and shapes and not on others (on
//! one H100, ember's attention kernels are slower than Burn's autotuned products for nanoGPT's
//! GPU config, while the fused AdamW is faster), so each can be turned off on its own, for
//! comparisons and until every kernel wins everywhere. The kernels ([`GpuKernel`]) are ember's
//! own ops; the strategies ([`GpuStrategy`]) are ways of running them (replayed decoding steps,
//! split weight gradients, cuBLAS, the attention's tiles or products, bf16 vectors). In
//! `EMBER_GPU_KERNELS` both share one list of names:
//!
//! - unset or `on`: all of them;
//! - `off`: none (every op runs its reference in Burn's ops);
//! - `-attention,-layer-norm`: all but the ones named;
//! - `attention,adamw`: only the ones named.
//!
//! Flex's CPU kernels are not affected.

use std::cell::Cell;
use std::sync::RwLock;

/// The environment variable that chooses the kernels and strategies.
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
    /// GELU (exact and tanh), forward and backward; also the gated MLP's `silu(gate) * up`.
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
}

impl GpuKernel {
    /// Every kernel, in the order of [`GpuKernel::name`]'s list.
    pub const ALL: [GpuKernel; 12] = [
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
        }
    }
}

/// A way of running ember's ops on a GPU that is not a kernel of its own; its discriminant is
/// its place in [`GpuStrategy::ALL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuStrategy {
    /// A one-token decoding step captured once as a graph (CUDA graphs; recorded dispatches on
    /// wgpu) and replayed for each token, instead of launching its kernels one by one.
    StepGraph,
    /// The weight gradient `X^T dY` of a linear layer over many rows (a training step's) as
    /// partial products over chunks of the rows, summed (split-K), so that its small output
    /// gives the GPU enough blocks of work ([`crate::matmul`]).
    SplitK,
    /// The matrix products of linear layers (forward and backward, many rows) by NVIDIA's
    /// cuBLAS on CUDA where it can be loaded, instead of cubek's ([`crate::matmul`]).
    Cublas,
    /// The training attention's forward and backward passes in register tiles (each unit 8 rows
    /// by 4 columns of the scores, 8 rows by `K / 8` columns of its output) for head sizes 32
    /// and 64; off, or for other sizes, one row per unit.
    AttentionTiles,
    /// On CUDA with cuBLAS (and `cublas` on), the training attention's forward and backward
    /// passes as cuBLAS's batched products over one head's stored scores, with small kernels
    /// between them (`cube/attention_products`); off, the fused kernels.
    AttentionProducts,
    /// The elementwise kernels (GELU, dropout) on bf16 and f16 tensors read and write vectors
    /// (8 values on CUDA) instead of one value per unit (`f32` tensors always do).
    NarrowVectors,
    /// Mixed precision's linear layers on CUDA with cuBLAS (and `cublas` on) as one product op
    /// each: the `f32` input rounded inside, the result written in `f32` where the model widens
    /// it, the input's gradient in `f32` ([`crate::linear_into`]); off, tracked casts around
    /// products of one type.
    MixedProducts,
    /// cuBLAS's products of the linear layers and cuDNN's attention passes (CUDA) handed to
    /// CubeCL's device thread to enqueue in order, without waiting for it (off: each call waits
    /// for the device thread to reach it, a round trip that keeps the host from running ahead).
    AsyncProducts,
    /// The attention as batched products ([`GpuStrategy::AttentionProducts`]) on long
    /// sequences in blocks of query rows (256), each block's products over only the keys its
    /// rows may see (and the keys' gradients over only the queries that see them), where
    /// one product per pass over every `[T, T]` score computes and stores the masked half too
    /// (context 1024: 5/8 of the products' work); off, one product per pass.
    CausalBlocks,
    /// Mixed precision's weights in the products' type kept from one step to the next: the
    /// first cast of an `f32` weight is kept, and ember's AdamW kernel writes the updated
    /// weight's copy as it updates the weight, so forward passes read it without a cast
    /// (`cube/weight_copies`); off, every forward pass casts its weights.
    WeightCopies,
    /// An evaluation's forward pass captured once as a graph and replayed for each of its
    /// batches (`ember_infer::summed_losses`), instead of launching its kernels batch by batch.
    EvalGraph,
    /// AdamW's steps launched three parameters at a time where the optimizer opens a group
    /// ([`crate::AdamWGroups`]), instead of one launch per parameter.
    GroupedAdamW,
    /// The training attention's fused kernels on tensor cores where the device has matrix
    /// fragments of the projection's type (TF32 for `f32` on CUDA; bf16, f16): every product
    /// of a pass in CubeCL's `cmma`, the softmax between them in shared memory
    /// (`cube/attention/mma.rs`); off, or without such fragments, the kernels on the GPU's
    /// ordinary cores. Where it runs: cuDNN's attention, where it applies, comes first; below
    /// it the tensor-core kernels are timed against the batched products and the fused kernels
    /// ([`GpuStrategy::AttentionTune`]), or come after the products where nothing is timed.
    AttentionMma,
    /// The training attention's path for each pass and shape chosen by timing every path that
    /// applies on the device (the batched products, the tensor-core kernels at each of their
    /// tile sizes, the fused kernels) once per process, on the call's own tensors
    /// (`cube/attention/tune.rs`); off, or for small calls, the first that applies in that
    /// order. cuDNN's attention, where it applies, is not timed: it comes first.
    AttentionTune,
}

impl GpuStrategy {
    /// Every strategy, in the order of [`GpuStrategy::name`]'s list.
    pub const ALL: [GpuStrategy; 14] = [
        GpuStrategy::StepGraph,
        GpuStrategy::SplitK,
        GpuStrategy::Cublas,
        GpuStrategy::AttentionTiles,
        GpuStrategy::AttentionProducts,
        GpuStrategy::NarrowVectors,
        GpuStrategy::MixedProducts,
        GpuStrategy::AsyncProducts,
        GpuStrategy::CausalBlocks,
        GpuStrategy::WeightCopies,
        GpuStrategy::EvalGraph,
        GpuStrategy::GroupedAdamW,
        GpuStrategy::AttentionMma,
        GpuStrategy::AttentionTune,
    ];

    /// The strategy's name in `EMBER_GPU_KERNELS`.
    pub fn name(self) -> &'static str {
        match self {
            GpuStrategy::StepGraph => "step-graph",
            GpuStrategy::SplitK => "split-k",
            GpuStrategy::Cublas => "cublas",
            GpuStrategy::AttentionTiles => "attention-tiles",
            GpuStrategy::AttentionProducts => "attention-products",
            GpuStrategy::NarrowVectors => "narrow-vectors",
            GpuStrategy::MixedProducts => "mixed-products",
            GpuStrategy::AsyncProducts => "async-products",
            GpuStrategy::CausalBlocks => "causal-blocks",
            GpuStrategy::WeightCopies => "weight-copies",
            GpuStrategy::EvalGraph => "eval-graph",
            GpuStrategy::GroupedAdamW => "grouped-adamw",
            GpuStrategy::AttentionMma => "attention-mma",
            GpuStrategy::AttentionTune => "attention-tune",
        }
    }
}

/// The kernels and strategies that run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuKernels {
    kernels: [bool; GpuKernel::ALL.len()],
    strategies: [bool; GpuStrategy::ALL.len()],
}

impl Default for GpuKernels {
    /// All of them.
    fn default() -> Self {
        GpuKernels::all(true)
    }
}

impl GpuKernels {
    /// All kernels and strategies on, or all off.
    pub fn all(on: bool) -> Self {
        GpuKernels {
            kernels: [on; GpuKernel::ALL.len()],
            strategies: [on; GpuStrategy::ALL.len()],
        }
    }

    /// The same with `kernel` on or off.
    pub fn with_kernel(mut self, kernel: GpuKernel, on: bool) -> Self {
        self.kernels[kernel as usize] = on;
        self
    }

    /// The same with `strategy` on or off.
    pub fn with_strategy(mut self, strategy: GpuStrategy, on: bool) -> Self {
        self.strategies[strategy as usize] = on;
        self
    }

    /// Parses a value of `EMBER_GPU_KERNELS` (see the module's documentation); the error names
    /// the variable, the value and what is accepted.
    pub fn parse(value: &str) -> Result<Self, String> {
        let value = value.trim();
        match value {
            "" | "on" => return Ok(GpuKernels::all(true)),
            "off" => return Ok(GpuKernels::all(false)),
            _ => {}
        }
        let entries: Vec<&str> = value.split(',').map(str::trim).collect();
        let removing = entries.iter().filter(|e| e.starts_with('-')).count();
        let bad = |why: String| {
            let kernels: Vec<&str> = GpuKernel::ALL.iter().map(|k| k.name()).collect();
            let strategies: Vec<&str> = GpuStrategy::ALL.iter().map(|s| s.name()).collect();
            format!(
                "{VARIABLE}={value:?}: {why} (expected on, off, or a comma-separated list of \
                 kernels ({}) and strategies ({}); each with a leading '-' to turn just those off)",
                kernels.join(", "),
                strategies.join(", ")
            )
        };
        if removing != 0 && removing != entries.len() {
            return Err(bad("mixes kernels to keep with kernels to remove".into()));
        }
        let mut set = GpuKernels::all(removing != 0);
        for entry in entries {
            let name = entry.trim_start_matches('-');
            let on = removing == 0;
            if let Some(kernel) = GpuKernel::ALL.into_iter().find(|k| k.name() == name) {
                set = set.with_kernel(kernel, on);
            } else if let Some(strategy) = GpuStrategy::ALL.into_iter().find(|s| s.name() == name) {
                set = set.with_strategy(strategy, on);
            } else {
                return Err(bad(format!("unknown kernel {name:?}")));
            }
        }
        Ok(set)
    }

    /// Whether `kernel` runs.
    pub fn uses(&self, kernel: GpuKernel) -> bool {
        self.kernels[kernel as usize]
    }

    /// Whether `strategy` applies.
    pub fn applies(&self, strategy: GpuStrategy) -> bool {
        self.strategies[strategy as usize]
    }
}

/// Knobs of the training attention's GPU paths, for tests and comparisons; the defaults are
/// ember's rules.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionTuning {
    /// The attention as batched products on any CubeCL device (Burn's `matmul` standing in
    /// for cuBLAS where there is none), not only on CUDA with cuBLAS.
    pub products_anywhere: bool,
    /// Sequences per call of the batched products (`None`: as many as 64 MiB of scores hold).
    pub sequences_per_call: Option<usize>,
    /// Keys the one-row forward pass scores per rescale of its running output (`None`: 8).
    pub keys_per_rescale: Option<usize>,
    /// Query rows per block of the batched products ([`GpuStrategy::CausalBlocks`]; `None`:
    /// 256).
    pub block_rows: Option<usize>,
    /// Units per row in the tensor-core kernels' row-wise steps ([`GpuStrategy::AttentionMma`];
    /// `None`: a plane's units over a fragment's rows, 2 on CUDA); more than that adds planes
    /// that take no part in the products.
    pub mma_row_units: Option<usize>,
    /// The fewest scores (`B * H * T * T`) of a call whose path is timed
    /// ([`GpuStrategy::AttentionTune`]; `None`: 2^22, about a quarter of nanoGPT's GPU
    /// config's): smaller calls take the first path that applies, where the timing would cost
    /// more than any path could save.
    pub tune_min_scores: Option<usize>,
}

/// Everything that decides which of ember's GPU paths run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuPolicy {
    /// The kernels and strategies on.
    pub kernels: GpuKernels,
    /// The chunks of rows of a linear layer's weight gradient ([`GpuStrategy::SplitK`]), fixed
    /// for benchmarks; `None` for ember's rule.
    pub split_k: Option<usize>,
    /// Whether the training attention of a bf16 (or f16) projection on CUDA runs through
    /// cuDNN's flash attention where cuDNN loads and its start-up check agrees (on unless
    /// turned off).
    pub cudnn_attention: bool,
    /// The training attention's knobs.
    pub attention: AttentionTuning,
}

impl Default for GpuPolicy {
    /// Every kernel and strategy, ember's split rule, cuDNN's attention where it agrees.
    fn default() -> Self {
        GpuPolicy {
            kernels: GpuKernels::default(),
            split_k: None,
            cudnn_attention: true,
            attention: AttentionTuning {
                products_anywhere: false,
                sequences_per_call: None,
                keys_per_rescale: None,
                block_rows: None,
                mma_row_units: None,
                tune_min_scores: None,
            },
        }
    }
}

impl GpuPolicy {
    /// The policy the environment asks for (`EMBER_GPU_KERNELS`, `EMBER_SPLIT_K`,
    /// `EMBER_CUDNN_ATTENTION`; the default where they are unset); the error names the
    /// variable and the value. For applications: the library never reads the environment.
    pub fn from_env() -> Result<Self, String> {
        let kernels = match std::env::var(VARIABLE) {
            Ok(value) => GpuKernels::parse(&value)?,
            Err(std::env::VarError::NotPresent) => GpuKernels::default(),
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(format!("{VARIABLE} is not UTF-8"));
            }
        };
        Ok(GpuPolicy {
            kernels,
            split_k: split_from_env()?,
            cudnn_attention: cudnn_from_env()?,
            attention: AttentionTuning::default(),
        })
    }
}

/// The process's policy (set by the application), and a thread's scoped one.
static POLICY: RwLock<GpuPolicy> = RwLock::new(GpuPolicy {
    kernels: GpuKernels {
        kernels: [true; GpuKernel::ALL.len()],
        strategies: [true; GpuStrategy::ALL.len()],
    },
    split_k: None,
    cudnn_attention: true,
    attention: AttentionTuning {
        products_anywhere: false,
        sequences_per_call: None,
        keys_per_rescale: None,
        block_rows: None,
        mma_row_units: None,
        tune_min_scores: None,
    },
});

thread_local! {
    static SCOPED: Cell<Option<GpuPolicy>> = const { Cell::new(None) };
}

/// Sets the process's policy (an application does it once at start-up).
pub fn set_policy(policy: GpuPolicy) {
    *POLICY.write().unwrap_or_else(|e| e.into_inner()) = policy;
}

/// `f` with `policy` on this thread (restored when it returns, or unwinds): how a test or a
/// caller runs one computation under other settings without touching the process's.
pub fn with_policy<R>(policy: GpuPolicy, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<GpuPolicy>);
    impl Drop for Restore {
        fn drop(&mut self) {
            set_scoped(self.0);
        }
    }
    let _restore = Restore(scoped());
    set_scoped(Some(policy));
    f()
}

/// This thread's scoped policy, if any (for a scope that spans a block rather than a closure).
pub(crate) fn scoped() -> Option<GpuPolicy> {
    SCOPED.with(Cell::get)
}

/// Sets (or with `None` clears) this thread's scoped policy; the caller restores the one before.
pub(crate) fn set_scoped(policy: Option<GpuPolicy>) {
    SCOPED.with(|c| c.set(policy));
}

/// The policy in force on this thread: its scoped one, else the process's.
pub fn policy() -> GpuPolicy {
    SCOPED
        .with(Cell::get)
        .unwrap_or_else(|| *POLICY.read().unwrap_or_else(|e| e.into_inner()))
}

/// Whether `kernel` runs under the policy in force.
pub fn uses(kernel: GpuKernel) -> bool {
    policy().kernels.uses(kernel)
}

/// Whether `strategy` applies under the policy in force.
pub fn applies(strategy: GpuStrategy) -> bool {
    policy().kernels.applies(strategy)
}

/// The fixed chunks of [`GpuStrategy::SplitK`] under the policy in force (`None`: ember's rule).
pub fn fixed_split() -> Option<usize> {
    policy().split_k
}

/// Whether cuDNN's flash attention is on under the policy in force.
pub fn cudnn_attention() -> bool {
    policy().cudnn_attention
}

/// The environment variable that fixes the number of chunks of rows of [`GpuStrategy::SplitK`]
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

/// The environment variable that turns off cuDNN's flash attention for the training attention of
/// a bf16 (or f16) projection on CUDA (`0` or `off`; unset, `1` or `on`: used where cuDNN loads
/// and its start-up check agrees with ember's kernels).
pub const CUDNN_VARIABLE: &str = "EMBER_CUDNN_ATTENTION";

/// Parses a value of `EMBER_CUDNN_ATTENTION`; the error names the variable, the value and what
/// is accepted.
pub fn parse_cudnn(value: &str) -> Result<bool, String> {
    match value.trim() {
        "" | "1" | "on" => Ok(true),
        "0" | "off" => Ok(false),
        other => Err(format!(
            "{CUDNN_VARIABLE}={other:?}: expected on (or 1) to use cuDNN's flash attention, off (or 0) not to"
        )),
    }
}

/// [`parse_cudnn`] of the environment's value (on where it is unset).
pub fn cudnn_from_env() -> Result<bool, String> {
    match std::env::var(CUDNN_VARIABLE) {
        Ok(value) => parse_cudnn(&value),
        Err(std::env::VarError::NotPresent) => Ok(true),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{CUDNN_VARIABLE} is not UTF-8")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(kernels: GpuKernels) -> Vec<&'static str> {
        let k = GpuKernel::ALL
            .into_iter()
            .filter(|&k| kernels.uses(k))
            .map(GpuKernel::name);
        let s = (GpuStrategy::ALL.into_iter())
            .filter(|&s| kernels.applies(s))
            .map(GpuStrategy::name);
        k.chain(s).collect()
    }

    #[test]
    fn parses_on_off_and_lists() {
        let all: Vec<_> = (GpuKernel::ALL.map(GpuKernel::name).into_iter())
            .chain(GpuStrategy::ALL.map(GpuStrategy::name))
            .collect();
        assert_eq!(on(GpuKernels::parse("on").unwrap()), all);
        assert_eq!(on(GpuKernels::parse("").unwrap()), all);
        assert!(on(GpuKernels::parse("off").unwrap()).is_empty());
        assert_eq!(
            on(GpuKernels::parse("-attention, -layer-norm, -cublas").unwrap()),
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
                "attention-tiles",
                "attention-products",
                "narrow-vectors",
                "mixed-products",
                "async-products",
                "causal-blocks",
                "weight-copies",
                "eval-graph",
                "grouped-adamw",
                "attention-mma",
                "attention-tune",
            ]
        );
        assert_eq!(
            on(GpuKernels::parse("adamw,cached-attention,step-graph").unwrap()),
            ["cached-attention", "adamw", "step-graph"]
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
        assert!(unknown.contains("strategies (step-graph"), "{unknown}");
        let mixed = GpuKernels::parse("attention,-gelu").unwrap_err();
        assert!(mixed.contains("mixes"), "{mixed}");
        assert!(!unknown.contains('\n') && !mixed.contains('\n'));
        assert!(GpuKernels::parse("-").is_err());
    }

    /// A scoped policy holds on its thread only, and the process's comes back after it.
    #[test]
    fn a_scoped_policy_is_this_threads_until_it_returns() {
        let off = GpuPolicy {
            kernels: GpuKernels::all(false),
            split_k: Some(4),
            cudnn_attention: true,
            attention: AttentionTuning::default(),
        };
        let before = policy();
        let inside = with_policy(off, || {
            let other = std::thread::spawn(policy).join().unwrap();
            (
                uses(GpuKernel::Gelu),
                applies(GpuStrategy::Cublas),
                fixed_split(),
                other,
            )
        });
        assert!(!inside.0, "gelu off in scope");
        assert!(!inside.1, "cublas off in scope");
        assert_eq!(inside.2, Some(4));
        assert_eq!(
            inside.3, before,
            "another thread keeps the process's policy"
        );
        assert_eq!(policy(), before);
        assert!(GpuPolicy::default().cudnn_attention);
    }

    #[test]
    fn parses_the_cudnn_switch() {
        for on in ["", "1", "on", " on "] {
            assert_eq!(parse_cudnn(on), Ok(true), "{on}");
        }
        for off in ["0", "off", " off"] {
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
