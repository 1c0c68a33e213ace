//! Decoding on the host: each token's logits read back and the token chosen there.

use ember_model::DecoderOnly;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::GenerateOptions;
use super::window::{Window, last_logits, next_logits_cached};
use crate::sampling::{penalize_repeats, sample};

/// [`generate`] choosing each token on the host from its logits, read back one token at a time.
pub(crate) fn generate_on_host(
    model: &DecoderOnly,
    prompt: &[u32],
    options: &GenerateOptions,
    ctx: usize,
    mut on_token: impl FnMut(u32) -> bool,
) -> Vec<u32> {
    let device = model.wte.weight.device();
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
