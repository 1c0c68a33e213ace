//! The window of context a KV cache holds while decoding: rebuilt when the context slides past
//! it, kept between tokens otherwise.

use burn::tensor::{Device, Int, Tensor};
use ember_model::{DecoderCache, DecoderOnly};

/// Whether `device`'s backend compiles (and, with fusion, autotunes) a kernel per tensor shape:
/// Burn's cubecl backends (wgpu, vulkan, cuda). They decode with a whole-buffer cache, whose
/// attention keeps its shapes until the buffer doubles, instead of taking a new shape per token.
/// CPU backends read only the valid rows, which is less work.
pub(super) fn compiles_per_shape(device: &Device) -> bool {
    ember_kernels::on_cubecl(device)
}

/// A cache of the keys and values of `tokens[start..start + cache.len()]`.
pub(super) struct Window {
    pub(super) cache: DecoderCache,
    pub(super) start: usize,
}

/// Logits for the token after `tokens`, feeding only what the cache has not seen.
pub(super) fn next_logits_cached(
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
pub(super) fn last_logits(
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
