//! Autoregressive generation from a [`DecoderOnly`] model, with or without the KV cache.

use burn::tensor::{Device, Int, Tensor};
use ember_model::{DecoderCache, DecoderOnly};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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
        let on_token = match crate::replayed::applies(&device) {
            true => match crate::replayed::decode_replayed(
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

/// Whether `device`'s backend compiles (and, with fusion, autotunes) a kernel per tensor shape:
/// Burn's cubecl backends (wgpu, vulkan, cuda). They decode with a whole-buffer cache, whose
/// attention keeps its shapes until the buffer doubles, instead of taking a new shape per token.
/// CPU backends read only the valid rows, which is less work.
fn compiles_per_shape(device: &Device) -> bool {
    ember_kernels::on_cubecl(device)
}

/// How [`decode_on_device`] picks a token from its logits, on the device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Choice {
    /// The argmax (the first maximum on ties, as [`crate::sampling::argmax`]).
    Greedy,
    /// A draw from `softmax(logits / temperature)`, by the host's uniform number, as
    /// [`sample`] draws without top-k or top-p.
    Temperature(f32),
}

impl Choice {
    /// The choice for `sampling` where it does not read the text so far (the repetition
    /// penalty does) or sort the logits (top-k, top-p); else `None`: chosen on the host.
    fn on_device(sampling: &Sampling) -> Option<Self> {
        if sampling.repetition_penalty != 1.0 {
            return None;
        }
        if sampling.greedy || sampling.temperature <= 0.0 {
            return Some(Choice::Greedy);
        }
        let plain = sampling.top_k.is_none() && sampling.top_p.is_none();
        plain.then_some(Choice::Temperature(sampling.temperature))
    }

    /// The token `[1, 1]` chosen from `logits` `[1, V]`; a temperature draw takes the next
    /// uniform number of `rng` (one per token, as the host path does) and draws with
    /// [`ember_kernels::draw`] (one kernel on GPUs), which picks the host walk's token up to
    /// rounding: a `u` within rounding of a boundary could pick the neighbour, about one token
    /// in millions.
    pub(crate) fn pick(self, logits: Tensor<2>, rng: &mut StdRng) -> Tensor<2, Int> {
        match self {
            Choice::Greedy => logits.argmax(1),
            Choice::Temperature(t) => ember_kernels::draw(logits, rng.random(), t),
        }
    }
}

/// Tokens read back to the host at once by [`decode_on_device`].
pub(crate) const READ_EVERY: usize = 16;

/// [`generate`] with the KV cache on a GPU backend, without a round trip to the host per
/// token: each token is chosen from its logits on the device ([`Choice`]) and fed to the next
/// step from there, and the host reads the chosen ids [`READ_EVERY`] tokens at a time (and
/// before the cache is rebuilt, which needs them). So the host queues the next steps' kernels
/// while the device runs, instead of waiting for every token; with Burn's fusion, no thread
/// spins on a read per token. `on_token` sees the ids in bursts; tokens computed after it
/// returned `false` are dropped. The same ids as the host path.
pub(crate) fn decode_on_device(
    model: &DecoderOnly,
    prompt: &[u32],
    max_new_tokens: usize,
    ctx: usize,
    (choice, mut rng): (Choice, StdRng),
    on_token: impl FnMut(u32) -> bool,
) -> Vec<u32> {
    let device = model.wte.weight.device();
    let mut chosen = Chosen {
        tokens: prompt.to_vec(),
        produced: Vec::with_capacity(max_new_tokens),
        pending: Vec::new(),
        on_token,
    };
    let mut window: Option<Window> = None;
    // The newest chosen token, on the device: the next step's input.
    let mut newest: Option<Tensor<2, Int>> = None;
    for _ in 0..max_new_tokens {
        let total = chosen.tokens.len() + chosen.pending.len();
        let logits = match (window.as_mut(), newest.take()) {
            (Some(w), Some(input))
                if w.start + w.cache.len() + 1 == total && w.cache.len() < ctx =>
            {
                model
                    .forward_with(input, None, Some(&mut w.cache), false)
                    .logits
            }
            _ => {
                // First step, or the cache is full: (re)build it from the newest tokens, which
                // the host needs for that.
                if !chosen.read() {
                    return chosen.produced;
                }
                let keep = if window.is_none() {
                    ctx
                } else {
                    (ctx / 2).max(1)
                };
                let start = chosen.tokens.len().saturating_sub(keep);
                let ids: Vec<i32> = chosen.tokens[start..].iter().map(|&i| i as i32).collect();
                let input =
                    Tensor::<1, Int>::from_ints(ids.as_slice(), &device).reshape([1, ids.len()]);
                let mut cache = model.new_whole_buffer_cache();
                let logits = model
                    .forward_with(input, None, Some(&mut cache), false)
                    .logits;
                window = Some(Window { cache, start });
                logits
            }
        };
        let [_, t, v] = logits.dims();
        let last: Tensor<2> = logits.slice([0..1, t - 1..t, 0..v]).reshape([1, v]);
        let next = choice.pick(last, &mut rng);
        chosen.pending.push(next.clone());
        newest = Some(next);
        if chosen.pending.len() == READ_EVERY && !chosen.read() {
            return chosen.produced;
        }
    }
    chosen.read();
    chosen.produced
}

/// The ids [`decode_on_device`] has chosen: read (`tokens`, the prompt first, and `produced`)
/// and still on the device (`pending`).
struct Chosen<F> {
    tokens: Vec<u32>,
    produced: Vec<u32>,
    pending: Vec<Tensor<2, Int>>,
    on_token: F,
}

impl<F: FnMut(u32) -> bool> Chosen<F> {
    /// Reads the pending ids (one transfer), telling `on_token` of each; false as soon as it
    /// asks to stop (the ids after that one are dropped).
    fn read(&mut self) -> bool {
        if self.pending.is_empty() {
            return true;
        }
        let ids = Tensor::cat(std::mem::take(&mut self.pending), 1).into_data();
        hand_over(
            ids,
            &mut self.tokens,
            &mut self.produced,
            &mut self.on_token,
        )
    }
}

/// Token ids read back from the device, appended to `tokens` and `produced` and told to
/// `on_token` one by one; false as soon as it asks to stop (the ids after that one are dropped).
pub(crate) fn hand_over(
    ids: burn::tensor::TensorData,
    tokens: &mut Vec<u32>,
    produced: &mut Vec<u32>,
    on_token: &mut impl FnMut(u32) -> bool,
) -> bool {
    let ids = ids
        .convert::<i64>()
        .try_into_vec::<i64>()
        .expect("token ids are integers");
    for id in ids {
        let id = id as u32;
        tokens.push(id);
        produced.push(id);
        if !on_token(id) {
            return false;
        }
    }
    true
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

#[cfg(all(test, feature = "wgpu"))]
pub(crate) mod wgpu_tests {
    use burn::module::{Module, Param};
    use burn::tensor::DeviceKind;
    use burn::tensor::Distribution;
    use ember_model::{DecoderOnlyConfig, PositionalKind};

    use super::*;

    /// A random model on wgpu with every matrix scaled up (unit-scale embeddings, sharp
    /// attention, an untied head), so its logits are far apart and its greedy text depends on
    /// position and context (at init scale it repeats one token).
    pub(crate) fn model(positional: PositionalKind) -> DecoderOnly {
        model_with_context(positional, 16)
    }

    /// [`model`] with room for `context_len` positions.
    pub(crate) fn model_with_context(
        positional: PositionalKind,
        context_len: usize,
    ) -> DecoderOnly {
        // The tests run in parallel on one device, whose random numbers are one stream: the
        // seeding and the draws under a lock, or another test's draws land between them and the
        // weights change from run to run (once, a model that repeated one token).
        static DRAWS: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _draws = DRAWS.lock().unwrap_or_else(|e| e.into_inner());
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        // Seeded: the same weights in every run.
        device.seed(11);
        let config = DecoderOnlyConfig {
            vocab_size: 23,
            d_model: 32,
            n_heads: 4,
            n_layers: 2,
            context_len,
            positional,
            tie_weights: false,
            ..Default::default()
        };
        config.init(&device).unwrap().map(&mut UnitMatrices)
    }

    struct UnitMatrices;

    impl burn::module::ModuleMapper for UnitMatrices {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let device = param.val().device();
            let dims = param.val().dims();
            match D {
                2 => Param::from_tensor(Tensor::random(
                    dims,
                    Distribution::Normal(0.0, 1.0),
                    &device,
                )),
                _ => param,
            }
        }
    }

    pub(crate) fn greedy(use_cache: bool, max_new_tokens: usize) -> GenerateOptions {
        GenerateOptions {
            max_new_tokens,
            sampling: Sampling {
                greedy: true,
                ..Default::default()
            },
            seed: 1,
            use_cache,
            context_len: 16,
        }
    }

    fn greedy_choice() -> (Choice, StdRng) {
        (Choice::Greedy, StdRng::seed_from_u64(1))
    }

    #[test]
    fn greedy_chosen_on_the_device_equals_the_host_paths() {
        for positional in [PositionalKind::Learned, PositionalKind::Rotary] {
            let m = model(positional);
            let prompt = [1, 2, 3];
            // 45 new tokens in a context of 16: the cache is rebuilt on the way, and the ids
            // are read in bursts of 16 and a last shorter one.
            let cached = greedy(true, 45);
            let host = generate_on_host(&m, &prompt, &cached, 16, |_| true);
            let seen = std::cell::RefCell::new(Vec::new());
            let device = decode_on_device(&m, &prompt, 45, 16, greedy_choice(), |id| {
                seen.borrow_mut().push(id);
                true
            });
            assert_eq!(device, host, "{positional:?}");
            assert_eq!(
                seen.into_inner(),
                host,
                "{positional:?}: on_token saw every id"
            );
            let distinct: std::collections::HashSet<_> = host.iter().collect();
            assert!(distinct.len() > 4, "too uniform to compare: {host:?}");
            // Through `generate`, which takes the device path here.
            assert_eq!(generate(&m, &prompt, &cached, |_| true), host);
            // While everything fits in the context, the no-cache path (the whole window each
            // step) agrees too.
            let fits = generate_on_host(&m, &prompt, &greedy(false, 13), 16, |_| true);
            assert_eq!(fits[..], host[..13], "{positional:?}");
        }
    }

    #[test]
    fn a_stop_inside_a_burst_ends_the_device_path_where_it_ends_the_host_path() {
        let m = model(PositionalKind::Learned);
        // Asks to stop at the 20th id, the 4th of the second burst.
        let stop_at_20 = || {
            let mut count = 0;
            move |_| {
                count += 1;
                count < 20
            }
        };
        let device = decode_on_device(&m, &[4], 45, 16, greedy_choice(), stop_at_20());
        let host = generate_on_host(&m, &[4], &greedy(true, 45), 16, stop_at_20());
        assert_eq!(device.len(), 20);
        assert_eq!(device, host);
    }

    #[test]
    fn temperature_draws_on_the_device_equal_the_host_draws_of_the_same_seed() {
        let m = model(PositionalKind::Rotary);
        for (temperature, seed) in [(1.0, 3), (3.0, 4)] {
            let options = GenerateOptions {
                sampling: Sampling {
                    temperature,
                    ..Default::default()
                },
                seed,
                ..greedy(true, 45)
            };
            assert_eq!(
                Choice::on_device(&options.sampling),
                Some(Choice::Temperature(temperature))
            );
            let host = generate_on_host(&m, &[1, 2], &options, 16, |_| true);
            let rng = StdRng::seed_from_u64(seed);
            let device = decode_on_device(
                &m,
                &[1, 2],
                45,
                16,
                (Choice::Temperature(temperature), rng),
                |_| true,
            );
            assert_eq!(device, host, "temperature {temperature}");
            assert_eq!(generate(&m, &[1, 2], &options, |_| true), host);
            // The draws are not the argmax's choices.
            let argmax = generate_on_host(&m, &[1, 2], &greedy(true, 45), 16, |_| true);
            assert_ne!(host, argmax, "temperature {temperature}");
        }
        // Top-k, top-p and the repetition penalty stay on the host.
        for sampling in [
            Sampling {
                top_k: Some(5),
                ..Default::default()
            },
            Sampling {
                top_p: Some(0.9),
                ..Default::default()
            },
            Sampling {
                repetition_penalty: 1.2,
                greedy: true,
                ..Default::default()
            },
        ] {
            assert_eq!(Choice::on_device(&sampling), None, "{sampling:?}");
        }
    }
}
