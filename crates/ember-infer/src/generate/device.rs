//! Decoding with tokens chosen on the device and read back in batches of [`READ_EVERY`].

use burn::tensor::{Int, Tensor};
use ember_model::DecoderOnly;
use rand::Rng;
use rand::rngs::StdRng;

use super::window::Window;
use crate::sampling::Sampling;

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
    pub(super) fn on_device(sampling: &Sampling) -> Option<Self> {
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
pub(super) struct Chosen<F> {
    tokens: Vec<u32>,
    produced: Vec<u32>,
    pending: Vec<Tensor<2, Int>>,
    on_token: F,
}

impl<F: FnMut(u32) -> bool> Chosen<F> {
    /// Reads the pending ids (one transfer), telling `on_token` of each; false as soon as it
    /// asks to stop (the ids after that one are dropped).
    pub(super) fn read(&mut self) -> bool {
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
