//! Decoding by replaying one captured step: the KV-cache path of [`crate::generate`] on a GPU
//! backend, with each token's kernels launched by one graph replay instead of one by one.
//!
//! A decoding step of a small model is dozens of kernel launches whose device work is a few
//! microseconds each, so the host's cost per launch bounds it (on an H200, nanoGPT's GPU config
//! decoded at a third of PyTorch's speed for that reason). cubecl records a step's launches once
//! (CUDA graphs; on wgpu, the resolved dispatches) and replays them with the arguments and
//! buffers they were recorded with. What changes from one token to the next therefore lives in
//! device buffers:
//! - the position of the step's input token, written by the host before each replay; the KV
//!   cache's write, its attention and the position's encoding (a learned table's row, or rows of
//!   tables of every position's sinusoids or rotary angles) read it there
//!   ([`ember_model::DecoderCache::read_position_from`]);
//! - the sampler's uniform number, written by the host before each replay ([`ops::draw_at`]);
//! - the tokens of the window, `history[i]` the token at cache position `i`: the step reads its
//!   input at the position and writes the token it chose one further ([`ops::write_token`]),
//!   where the next replay reads it. The host reads them [`READ_EVERY`] tokens at a time.
//!
//! A step run twice at the same position gives the same result, so the step before a capture
//! is run for real (it also allocates what the recording reuses) and the recording, which runs
//! nothing, is then replayed from the next position on. The cache's buffers are recorded too:
//! when they are full the next step runs unrecorded (it grows them) and the step after it is
//! captured again. Text fits the context, or the window is rebuilt as on the other paths.

use burn::backend::{Backend, BackendGraph, Dispatch};
use burn::tensor::{Device, Int, Tensor, TensorData};
use ember_kernels::{self as ops, GpuKernel};
use ember_model::positions::StepPosition;
use ember_model::{DecoderCache, DecoderOnly};
use rand::Rng;
use rand::rngs::StdRng;

use super::{Choice, READ_EVERY, hand_over};

/// Whether decoding on `device` can replay captured steps: a CubeCL backend, and the kernels
/// that read the step's inputs there turned on (`EMBER_GPU_KERNELS`; `-step-graph` turns the
/// replays off).
pub(crate) fn applies(device: &Device) -> bool {
    let kernels = [
        GpuKernel::CacheWrite,
        GpuKernel::CachedAttention,
        GpuKernel::Draw,
    ];
    ops::gpu_kernels::applies(ops::GpuStrategy::StepGraph)
        && kernels.into_iter().all(ops::gpu_kernels::uses)
        && ops::on_cubecl(device)
}

/// What [`decode_replayed`] did, for tests and benchmarks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Replays {
    /// The new token ids.
    pub produced: Vec<u32>,
    /// Steps captured as graphs.
    pub captures: usize,
    /// Steps run by a replay.
    pub replays: usize,
}

/// The step's inputs that the host writes between replays: `[1]` tensors whose memory is
/// written in place.
struct StepInputs {
    /// The position of the step's input token in the cache.
    position: Tensor<1, Int>,
    /// `position` with the tables the model's positions read it through.
    step: StepPosition,
    /// The uniform number of a temperature draw.
    u: Tensor<1>,
}

impl StepInputs {
    /// The buffers for `model` on its device, or `None` where the backend cannot write them in
    /// place (Burn's fusion, which owns its buffers).
    fn new(model: &DecoderOnly) -> Option<Self> {
        let device = &model.wte.weight.device();
        let position = Tensor::from_data(TensorData::new(vec![0i32], [1]), device);
        let inputs = StepInputs {
            step: model.step_position(position.clone()),
            position,
            u: Tensor::from_data(TensorData::new(vec![0f32], [1]), device),
        };
        (inputs.set_position(0) && inputs.set_u(0.0)).then_some(inputs)
    }

    fn set_position(&self, position: usize) -> bool {
        let data = TensorData::new(vec![position as i64], [1]).convert_dtype(self.position.dtype());
        ops::write_in_place(&self.position, data)
    }

    fn set_u(&self, u: f32) -> bool {
        let data = TensorData::new(vec![u], [1]).convert_dtype(self.u.dtype());
        ops::write_in_place(&self.u, data)
    }
}

/// The window of text the cache holds, with the step's token buffer and graph.
struct Window {
    /// The keys and values of cache positions `0..cache.len()`, reading the step's position
    /// from the device.
    cache: DecoderCache,
    /// The index in the text of cache position 0.
    start: usize,
    /// `[context + 1]`: the token at each cache position, up to the step's next input at
    /// `cache.len()`. Held by the window alone, so the step writes it in place.
    history: Option<Tensor<1, Int>>,
    /// The captured step, valid while the cache's buffers stay where they were recorded.
    graph: Option<BackendGraph<Dispatch>>,
}

/// The tokens chosen so far: the prompt and every id read back, and `on_token`.
struct Text<F> {
    tokens: Vec<u32>,
    produced: Vec<u32>,
    on_token: F,
    /// `on_token` asked to stop: the ids after that one are dropped.
    stopped: bool,
}

impl<F: FnMut(u32) -> bool> Text<F> {
    /// Reads the window's tokens not read yet (one transfer), telling `on_token` of each; false
    /// as soon as it asks to stop.
    fn read(&mut self, window: &Window) -> bool {
        let from = self.tokens.len() - window.start;
        let to = window.cache.len() + 1;
        if from >= to {
            return true;
        }
        let history = window.history.clone().expect("the window holds its tokens");
        let ids = history.narrow(0, from, to - from).into_data();
        let going = hand_over(
            ids,
            &mut self.tokens,
            &mut self.produced,
            &mut self.on_token,
        );
        self.stopped = !going;
        going
    }

    /// Tokens chosen on the device and not read yet.
    fn unread(&self, window: &Window) -> usize {
        (window.start + window.cache.len() + 1).saturating_sub(self.tokens.len())
    }
}

/// Generates like [`crate::generate`]'s device path, from the same seed the same ids, replaying
/// captured steps where the backend records graphs (see the module's documentation);
/// `Err(on_token)`, with nothing generated, where the step's inputs cannot be written in place
/// (Burn's fusion).
pub(crate) fn decode_replayed<F: FnMut(u32) -> bool>(
    model: &DecoderOnly,
    prompt: &[u32],
    max_new_tokens: usize,
    ctx: usize,
    (choice, mut rng): (Choice, StdRng),
    on_token: F,
) -> Result<Replays, F> {
    let device = model.wte.weight.device();
    let Some(inputs) = StepInputs::new(model) else {
        return Err(on_token);
    };
    let mut text = Text {
        tokens: prompt.to_vec(),
        produced: Vec::with_capacity(max_new_tokens),
        on_token,
        stopped: false,
    };
    let mut replays = Replays::default();
    // Cleared when the backend refuses a recording or a replay: the rest is decoded step by
    // step.
    let mut capturing = true;
    let mut window: Option<Window> = None;
    loop {
        let chosen = text.produced.len() + window.as_ref().map_or(0, |w| text.unread(w));
        if chosen >= max_new_tokens || text.stopped {
            break;
        }
        let Some(w) = window.as_mut().filter(|w| w.cache.len() < ctx) else {
            // First step, or the cache is full: rebuild it from the newest tokens, which the
            // host needs for that.
            let first = window.is_none();
            if let Some(old) = window.take()
                && !text.read(&old)
            {
                break;
            }
            let keep = if first { ctx } else { (ctx / 2).max(1) };
            let tokens = &text.tokens;
            window = Some(rebuild(model, tokens, keep, ctx, &inputs, choice, &mut rng));
            continue;
        };
        let p = w.cache.len();
        let capacity = w.cache.capacity();
        let written = inputs.set_position(p)
            && match choice {
                Choice::Temperature(_) => inputs.set_u(rng.random()),
                Choice::Greedy => true,
            };
        assert!(written, "the step's inputs were written in place before");
        let refused = match &w.graph {
            Some(graph) if p < capacity => {
                // SAFETY: every buffer the recording touched is alive: the model's weights,
                // the window's cache buffers and history (which replace themselves only when
                // the cache grows, and the graph is dropped before that), the step inputs; the
                // recording's own intermediates were allocated from pools whose pages it guards,
                // and nothing allocated since outlives a replay. One thread issues everything.
                let replayed = unsafe { Dispatch::graph_replay(device.as_dispatch(), graph) }
                    .is_ok()
                    && !tests_refuse(replays.replays);
                w.cache.set_len(p + 1);
                replays.replays += usize::from(replayed);
                !replayed
            }
            _ => {
                // No graph yet, or the buffers it recorded are full: this step runs for real
                // (growing them if they are full); with room for the next step after it, that
                // next step is recorded.
                w.graph = None;
                let capture = capturing && p + 2 <= capacity;
                let prepared = capture && Dispatch::graph_prepare(device.as_dispatch()).is_ok();
                step(model, w, &inputs, choice);
                if prepared {
                    // The tokens so far on the host first: a recording the backend refuses
                    // leaves what it would have written unreadable.
                    if !text.read(w) {
                        // Closing a prepared capture is what releases the stream.
                        let _ = Dispatch::graph_stop_capture(device.as_dispatch());
                        break;
                    }
                    match capture_step(model, w, &inputs, choice, &device) {
                        Capture::Graph(graph) => {
                            w.graph = Some(graph);
                            replays.captures += 1;
                            false
                        }
                        Capture::Unsupported => {
                            capturing = false;
                            false
                        }
                        Capture::Refused => true,
                    }
                } else {
                    false
                }
            }
        };
        if refused {
            // What the refused recording or replay would have written (the cache, the tokens
            // not read yet) cannot be read: decoding goes on step by step from a new window of
            // the tokens read, which chooses the next token again.
            capturing = false;
            let start = window.take().expect("a window").start;
            let keep = (text.tokens.len() - start).min(ctx);
            let tokens = &text.tokens;
            window = Some(rebuild(model, tokens, keep, ctx, &inputs, choice, &mut rng));
            continue;
        }
        let w = window.as_ref().expect("a window");
        if text.unread(w) >= READ_EVERY && !text.read(w) {
            break;
        }
    }
    if let Some(w) = &window
        && !text.stopped
    {
        text.read(w);
    }
    replays.produced = text.produced;
    Ok(replays)
}

/// Whether a test asks for replay number `n` to count as refused by the backend (lavapipe never
/// refuses one); always false outside tests.
fn tests_refuse(n: usize) -> bool {
    #[cfg(test)]
    {
        REFUSE_REPLAY.with(|at| at.get() == Some(n))
    }
    #[cfg(not(test))]
    {
        let _ = n;
        false
    }
}

#[cfg(test)]
thread_local! {
    /// The replay [`tests_refuse`] refuses on this thread.
    static REFUSE_REPLAY: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// A new window holding the newest `keep` of `tokens`, run through the model, and the token it
/// chose after them (with the host's uniform number, as the first step of the other paths) at
/// the cache's next position.
fn rebuild(
    model: &DecoderOnly,
    tokens: &[u32],
    keep: usize,
    ctx: usize,
    inputs: &StepInputs,
    choice: Choice,
    rng: &mut StdRng,
) -> Window {
    let device = model.wte.weight.device();
    let start = tokens.len().saturating_sub(keep);
    let ids: Vec<i32> = tokens[start..].iter().map(|&i| i as i32).collect();
    let input = Tensor::<1, Int>::from_ints(ids.as_slice(), &device).reshape([1, ids.len()]);
    let mut cache = model.new_whole_buffer_cache();
    let logits = model
        .forward_with(input, None, Some(&mut cache), false)
        .logits;
    let [_, t, v] = logits.dims();
    let last: Tensor<2> = logits.slice([0..1, t - 1..t, 0..v]).reshape([1, v]);
    let token = choice.pick(last, rng);
    assert!(inputs.set_position(cache.len()), "written in place before");
    let history = Tensor::<1, Int>::zeros([ctx + 1], &device);
    let history = ops::write_token(history, &inputs.position, 0, token);
    cache.read_position_from(Some(inputs.step.clone()));
    Window {
        cache,
        start,
        history: Some(history),
        graph: None,
    }
}

/// One step at the position `inputs` holds: the token there in the window's history through the
/// model, the next one chosen and written after it.
fn step(model: &DecoderOnly, w: &mut Window, inputs: &StepInputs, choice: Choice) {
    let history = w.history.take().expect("the window holds its tokens");
    let input = history
        .clone()
        .select(0, inputs.position.clone())
        .reshape([1, 1]);
    let logits = model
        .forward_with(input, None, Some(&mut w.cache), false)
        .logits; // [1, 1, V]
    let v = logits.dims()[2];
    let last: Tensor<2> = logits.reshape([1, v]);
    let token = match choice {
        Choice::Greedy => last.argmax(1),
        Choice::Temperature(t) => ops::draw_at(last, &inputs.u, t),
    };
    w.history = Some(ops::write_token(history, &inputs.position, 1, token));
}

/// What [`capture_step`] gave.
enum Capture {
    /// The recorded step.
    Graph(BackendGraph<Dispatch>),
    /// The backend records no graphs: nothing was recorded, the window is as it was.
    Unsupported,
    /// The backend refused the recording: what it would have written (the cache, the tokens)
    /// can no longer be read.
    Refused,
}

/// Records the step at the position `inputs` holds (run for real just before, so the recording
/// reuses what it allocated), leaving the cache's count where it was: the recording runs
/// nothing.
fn capture_step(
    model: &DecoderOnly,
    w: &mut Window,
    inputs: &StepInputs,
    choice: Choice,
    device: &Device,
) -> Capture {
    let device = device.as_dispatch();
    let len = w.cache.len();
    if Dispatch::graph_start_capture(device).is_err() {
        // Closing the prepared capture releases the stream.
        let _ = Dispatch::graph_stop_capture(device);
        return Capture::Unsupported;
    }
    step(model, w, inputs, choice);
    let graph = Dispatch::graph_stop_capture(device);
    w.cache.set_len(len);
    match graph {
        Ok(graph) => Capture::Graph(graph),
        Err(_) => Capture::Refused,
    }
}

#[cfg(all(test, feature = "wgpu"))]
#[path = "replayed_wgpu_tests.rs"]
mod wgpu_tests;
