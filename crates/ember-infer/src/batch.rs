//! Several prompts generated together: one batch, the prompts left-padded to one length, each
//! row with its own sampler.

use burn::tensor::{Device, Int, Tensor};
use ember_model::{DecoderCache, DecoderOnly};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::generate::GenerateOptions;
use crate::sampling::{penalize_repeats, sample};

/// Token fed at padded positions; attention never sees it.
const PAD_ID: i32 = 0;

/// Generates up to `options.max_new_tokens` after each of `prompts` at once. Row `i` samples
/// with its own generator seeded `seeds[i]`, so it gets the tokens [`crate::generate()`] gives
/// the prompt alone with that seed (up to float rounding, which a near-tie may expose) while
/// its text fits in the context. `keep_going(i, id)` sees each new id of row `i` and returns
/// `false` to finish that row; generation ends when every row is finished. Returns each row's
/// new ids.
///
/// With the cache, the batch rebuilds its window (each row's newest `context_len / 2` tokens)
/// when its longest row fills the context; without it, each step recomputes each row's last
/// `context_len` tokens.
///
/// # Panics
/// If `prompts` is empty, a prompt is empty, or `seeds` is not one per prompt.
pub fn generate_batch(
    model: &DecoderOnly,
    prompts: &[Vec<u32>],
    seeds: &[u64],
    options: &GenerateOptions,
    mut keep_going: impl FnMut(usize, u32) -> bool,
) -> Vec<Vec<u32>> {
    assert!(
        !prompts.is_empty() && prompts.iter().all(|p| !p.is_empty()),
        "batched generation needs prompts of at least one token"
    );
    assert_eq!(prompts.len(), seeds.len(), "one seed per prompt");
    let device = model.wte.weight.device();
    let ctx = options.context_len.min(model.max_positions).max(1);
    let mut rngs: Vec<StdRng> = seeds.iter().map(|&s| StdRng::seed_from_u64(s)).collect();
    let mut rows: Vec<Vec<u32>> = prompts.to_vec();
    let mut produced = vec![Vec::new(); prompts.len()];
    let mut finished = vec![false; prompts.len()];
    let mut cache: Option<DecoderCache> = None;
    for _ in 0..options.max_new_tokens {
        let logits = match cache.as_mut() {
            Some(c) if options.use_cache && c.len() < ctx => {
                let last: Vec<u32> = rows.iter().map(|r| r[r.len() - 1]).collect();
                let columns: Vec<&[u32]> = last.iter().map(std::slice::from_ref).collect();
                last_logits(model, &columns, c, &device)
            }
            _ => {
                // First step, a full window, or no cache: (re)build from each row's newest tokens.
                let keep = if cache.is_none() || !options.use_cache {
                    ctx
                } else {
                    (ctx / 2).max(1)
                };
                let windows: Vec<&[u32]> = rows
                    .iter()
                    .map(|r| &r[r.len().saturating_sub(keep)..])
                    .collect();
                let longest = windows.iter().map(|w| w.len()).max().unwrap_or(0);
                let pads = windows.iter().map(|w| longest - w.len()).collect();
                let fresh = cache.insert(DecoderCache::left_padded(model.blocks.len(), pads));
                last_logits(model, &windows, fresh, &device)
            }
        };
        for (i, mut logits) in logits.into_iter().enumerate() {
            penalize_repeats(&mut logits, &rows[i], options.sampling.repetition_penalty);
            let next = sample(&logits, &options.sampling, &mut rngs[i]);
            // A finished row still takes a token, to keep the batch in step; it is not kept.
            rows[i].push(next);
            if !finished[i] {
                produced[i].push(next);
                finished[i] = !keep_going(i, next);
            }
        }
        if finished.iter().all(|&f| f) {
            break;
        }
    }
    produced
}

/// Runs the rows (left-padded to the longest) through the model with `cache` and returns each
/// row's logits `[V]` at the last position.
fn last_logits(
    model: &DecoderOnly,
    rows: &[&[u32]],
    cache: &mut DecoderCache,
    device: &Device,
) -> Vec<Vec<f32>> {
    let t = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let ids: Vec<i32> = rows
        .iter()
        .flat_map(|r| std::iter::repeat_n(PAD_ID, t - r.len()).chain(r.iter().map(|&i| i as i32)))
        .collect();
    let b = rows.len();
    let input = Tensor::<1, Int>::from_ints(ids.as_slice(), device).reshape([b, t]);
    let logits = model.forward_with(input, None, Some(cache), false).logits; // [B, T, V]
    let v = logits.dims()[2];
    let last = logits
        .slice([0..b, t - 1..t, 0..v])
        .try_into_vec_as::<f32>()
        .expect("logits are f32");
    last.chunks(v).map(<[f32]>::to_vec).collect()
}
