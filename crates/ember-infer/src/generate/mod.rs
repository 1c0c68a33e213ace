//! Autoregressive generation from a [`DecoderOnly`] model, with or without the KV cache.
//!
//! Layout: this file holds the API and which path decodes; [`host`] the host's path (every
//! token read back and chosen on the host), [`device`] tokens chosen on the device and read
//! back in batches, [`replayed`] the same with one captured step replayed per token (GPU
//! backends), [`window`] the KV cache's window of context they share.

mod device;
mod host;
pub(crate) mod replayed;
#[cfg(all(test, feature = "wgpu"))]
pub(crate) mod wgpu_tests;
mod window;

pub(crate) use device::{Choice, READ_EVERY, decode_on_device, hand_over};
pub(crate) use host::generate_on_host;
use window::compiles_per_shape;

use ember_model::DecoderOnly;
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::sampling::Sampling;

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
///
/// On a GPU backend, with the cache and a choice the device makes (greedy or plain
/// temperature), tokens are chosen on the device and read back in bursts, one captured step
/// replayed per token (`replayed`; `EMBER_GPU_KERNELS=-step-graph` launches every step's
/// kernels instead). Both give the same ids as the host.
pub fn generate(
    model: &DecoderOnly,
    prompt: &[u32],
    options: &GenerateOptions,
    on_token: impl FnMut(u32) -> bool,
) -> Vec<u32> {
    generate_reporting(model, prompt, options, on_token).0
}

/// Where [`generate_reporting`] chose the tokens, and how the device ran its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoding {
    /// On the host, from each step's logits read back.
    Host,
    /// On the device, every step's kernels launched one by one; the ids read back in bursts.
    Device,
    /// On the device, `replays` steps run by replaying a captured step (`captures` of them were
    /// captured); the other steps launched their kernels. No replay at all where the backend
    /// records no graph.
    Replayed { captures: usize, replays: usize },
}

impl std::fmt::Display for Decoding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Decoding::Host => write!(f, "tokens chosen on the host"),
            Decoding::Device => write!(f, "tokens chosen on the device, steps launched"),
            Decoding::Replayed { captures, replays } => write!(
                f,
                "tokens chosen on the device, {replays} steps replayed from {captures} captured"
            ),
        }
    }
}

/// [`generate`], and which way it decoded (for benchmarks and `ember generate`'s summary).
pub fn generate_reporting(
    model: &DecoderOnly,
    prompt: &[u32],
    options: &GenerateOptions,
    on_token: impl FnMut(u32) -> bool,
) -> (Vec<u32>, Decoding) {
    assert!(
        !prompt.is_empty(),
        "generation needs at least one prompt token"
    );
    let device = model.wte.weight.device();
    let ctx = options.context_len.min(model.max_positions).max(1);
    if let Some(choice) = Choice::on_device(&options.sampling)
        && options.use_cache
        && compiles_per_shape(&device)
    {
        let rng = StdRng::seed_from_u64(options.seed);
        let on_token = match replayed::applies(&device) {
            true => match replayed::decode_replayed(
                model,
                prompt,
                options.max_new_tokens,
                ctx,
                (choice, rng.clone()),
                on_token,
            ) {
                Ok(replays) => {
                    let decoding = Decoding::Replayed {
                        captures: replays.captures,
                        replays: replays.replays,
                    };
                    return (replays.produced, decoding);
                }
                Err(on_token) => on_token,
            },
            false => on_token,
        };
        let ids = decode_on_device(
            model,
            prompt,
            options.max_new_tokens,
            ctx,
            (choice, rng),
            on_token,
        );
        return (ids, Decoding::Device);
    }
    let ids = generate_on_host(model, prompt, options, ctx, on_token);
    (ids, Decoding::Host)
}
