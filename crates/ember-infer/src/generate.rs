//! Autoregressive generation from a [`DecoderOnly`] model, with or without the KV cache.

use burn::tensor::{Device, Int, Tensor};
use ember_model::{DecoderCache, DecoderOnly};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::sampling::{Sampling, penalize_repeats, sample};

/// Settings of one generation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to produce after the prompt.
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// Seed of the sampler: the same seed gives the same text.
    pub seed: u64,
    /// Reuse keys and values of earlier tokens (fast) instead of recomputing the window.
    pub use_cache: bool,
    /// The longest window the model attends over (its training context).
    pub context_len: usize,
}

/// Generates up to `max_new_tokens` after `prompt`, calling `on_token` with each new id as soon
/// as it is chosen; generation stops early when `on_token` returns `false`. Returns the new ids.
///
/// The model sees at most the last `context_len` tokens. Without the cache that window slides
/// by one token per step (as nanoGPT does). With the cache, when it is full it is rebuilt from
/// the newest `context_len / 2` tokens (learned positions cannot be shifted in place), so the
/// two agree exactly while the text fits in the context.
pub fn generate(
    model: &DecoderOnly,
    prompt: &[u32],
    options: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> bool,
) -> Vec<u32> {
    assert!(
        !prompt.is_empty(),
        "generation needs at least one prompt token"
    );
    let device = model.wte.weight.device();
    let ctx = options.context_len.min(model.max_positions).max(1);
    let mut rng = StdRng::seed_from_u64(options.seed);
    let mut tokens: Vec<u32> = prompt.to_vec();
    let mut window: Option<Window> = None;
    let mut produced = Vec::with_capacity(options.max_new_tokens);
    for _ in 0..options.max_new_tokens {
        let mut logits = if options.use_cache {
            next_logits_cached(model, &tokens, &mut window, ctx, &device)
        } else {
            let window = &tokens[tokens.len().saturating_sub(ctx)..];
            last_logits(model, window, None, &device)
        };
        penalize_repeats(&mut logits, &tokens, options.sampling.repetition_penalty);
        let next = sample(&logits, &options.sampling, &mut rng);
        tokens.push(next);
        produced.push(next);
        if !on_token(next) {
            break;
        }
    }
    produced
}

/// Whether `device`'s backend compiles (and, with fusion, autotunes) a kernel per tensor shape:
/// Burn's cubecl backends (wgpu, vulkan, cuda). They decode with a whole-buffer cache, whose
/// attention keeps its shapes until the buffer doubles, instead of taking a new shape per token.
/// CPU backends read only the valid rows, which is less work.
fn compiles_per_shape(device: &Device) -> bool {
    use burn::backend::{Backend, Dispatch};
    Dispatch::name(device.as_dispatch()).contains("cubecl<")
}

/// A cache of the keys and values of `tokens[start..start + cache.len()]`.
struct Window {
    cache: DecoderCache,
    start: usize,
}

/// Logits for the token after `tokens`, feeding only what the cache has not seen.
fn next_logits_cached(
    model: &DecoderOnly,
    tokens: &[u32],
    window: &mut Option<Window>,
    ctx: usize,
    device: &Device,
) -> Vec<f32> {
    if let Some(w) = window.as_mut() {
        let seen = w.cache.len();
        if w.start + seen + 1 == tokens.len() && seen < ctx {
            let last = &tokens[tokens.len() - 1..];
            return last_logits(model, last, Some(&mut w.cache), device);
        }
    }
    // First call, or the cache is full: (re)build it from the newest tokens.
    let keep = if window.is_none() {
        ctx
    } else {
        (ctx / 2).max(1)
    };
    let start = tokens.len().saturating_sub(keep);
    let mut cache = if compiles_per_shape(device) {
        model.new_whole_buffer_cache()
    } else {
        model.new_cache()
    };
    let logits = last_logits(model, &tokens[start..], Some(&mut cache), device);
    *window = Some(Window { cache, start });
    logits
}

/// Runs `tokens` through the model and returns the logits `[V]` of the last position.
fn last_logits(
    model: &DecoderOnly,
    tokens: &[u32],
    cache: Option<&mut DecoderCache>,
    device: &Device,
) -> Vec<f32> {
    let t = tokens.len();
    let ids: Vec<i32> = tokens.iter().map(|&i| i as i32).collect();
    let input = Tensor::<1, Int>::from_ints(ids.as_slice(), device).reshape([1, t]);
    let logits = model.forward_with(input, None, cache, false).logits; // [1, T, V]
    let v = logits.dims()[2];
    logits
        .slice([0..1, t - 1..t, 0..v])
        .try_into_vec_as::<f32>()
        .expect("logits are f32")
}
