//! Which path a training attention pass takes below cuDNN's ([`GpuStrategy::AttentionTune`]):
//! the batched products, the tensor-core kernels (at each of their plans) or the fused kernels,
//! chosen by timing each on the device, once per process for each pass and shape.
//!
//! Which one is fastest depends on the GPU, the precision and the shape: the products store a
//! head's `[B, T, T]` scores, the fused kernels store nothing and pay for it in arithmetic on
//! the ordinary cores, the tensor-core kernels in barriers and shared memory. A rule fixed in
//! advance would be wrong somewhere, so the first call of a shape times every path that applies
//! on the call's own tensors (a first run that compiles and tunes what the path launches, then
//! runs timed between synchronisations, the best of two rounds) and keeps the fastest (a later
//! path of the order below only where it is at least 5% faster) for the rest of the process,
//! saying so in one line on stderr. Every path computes the same function with the same
//! dropout mask and log-sum-exps (`f32` on every path), so the forward pass and the backward
//! pass choose independently: a backward pass may run on another path than its forward pass
//! did.
//!
//! Not timed, and the first path that applies taken (the products, then the tensor-core
//! kernels, then the fused kernels): a single path, the strategy off, and calls of fewer scores
//! than the policy's `tune_min_scores` (decoding's prompts, the tests' small shapes), where the
//! timing costs more than it could save. While a graph is being recorded (nothing may wait or
//! allocate there) a shape takes the path kept for it, else the first.

use super::dims::Dims;
use super::mma::MmaPlan;
use super::route::by_products;
use crate::GpuStrategy;
use burn::backend::TensorMetadata;
use burn::tensor::DType;
use burn_cubecl::cubecl::device::DeviceId;
use burn_cubecl::tensor::CubeTensor;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Calls of at least this many scores are timed unless the policy says otherwise: 2^22, a
/// sixth of nanoGPT's GPU config's `64 * 6 * 256 * 256`.
const MIN_SCORES: usize = 1 << 22;

/// The share of the fastest earlier path's time a later path must take less than to be kept
/// instead (5% faster).
const MARGIN: f64 = 0.95;

/// The device time a round of timed runs aims at (a pass that takes longer runs once a round).
const ROUND: Duration = Duration::from_millis(4);

/// A path of the training attention's passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Path {
    /// The batched products over a head's stored scores (`cube::attention_products`).
    Products,
    /// The tensor-core kernels under one plan.
    Mma(MmaPlan),
    /// The fused kernels on the ordinary cores (register tiles or one row per unit).
    Fused,
}

impl Path {
    fn describe(self) -> String {
        match self {
            Path::Products => "the batched products".into(),
            Path::Mma(plan) => format!(
                "the tensor-core kernels ({:?}, blocks of {} rows, tiles of {})",
                plan.operand,
                plan.rows(),
                plan.cols
            ),
            Path::Fused => "the fused kernels".into(),
        }
    }
}

/// The training attention's two passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Pass {
    Forward,
    Backward,
}

/// The paths that apply to a call on `qkv` (in its own type, before any
/// widening), in the order taken when nothing is timed: the batched products, the tensor-core
/// kernels at each plan ([`MmaPlan::all_that_apply`]), the fused kernels (always).
pub(super) fn paths(qkv: &CubeTensor, dims: &Dims) -> Vec<Path> {
    let mut paths = Vec::new();
    if by_products(qkv) {
        paths.push(Path::Products);
    }
    paths.extend(
        MmaPlan::all_that_apply(dims, qkv, qkv.dtype())
            .into_iter()
            .map(Path::Mma),
    );
    paths.push(Path::Fused);
    paths
}

/// What a choice is kept for: the device, the pass, the call's type and sizes, whether it drops
/// weights, and the paths that applied (another policy is another choice).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct Key {
    device: DeviceId,
    pass: Pass,
    dtype: DType,
    sizes: [usize; 4],
    dropout: bool,
    paths: Vec<Path>,
}

impl Key {
    fn describe(&self) -> String {
        let [b, t, heads, k] = self.sizes;
        let pass = match self.pass {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        };
        let dropout = if self.dropout { ", dropout" } else { "" };
        let dtype = format!("{:?}", self.dtype).to_lowercase();
        format!("{pass} pass of {b} x {t} positions, {heads} heads of {k}, {dtype}{dropout}")
    }
}

/// The choices made so far, and how many paths were timed for each call's sizes (for the
/// tests).
#[derive(Default)]
pub(super) struct Choices {
    chosen: HashMap<Key, Path>,
    timed: HashMap<[usize; 4], usize>,
}

impl Choices {
    /// The path kept for `key`, else the fastest of `key`'s paths by `time` (each timed once,
    /// in order; a later path only where it takes less than [`MARGIN`] of the time of the
    /// fastest before it; `None`, a path that failed, never, and where all fail the first),
    /// kept and said in one line on stderr.
    fn choose(&mut self, key: Key, mut time: impl FnMut(Path) -> Option<Duration>) -> Path {
        if let Some(&path) = self.chosen.get(&key) {
            return path;
        }
        let times: Vec<(Path, Option<Duration>)> =
            key.paths.iter().map(|&p| (p, time(p))).collect();
        *self.timed.entry(key.sizes).or_default() += times.len();
        // A later path must be clearly faster: noise between two close paths then does not
        // decide, and runs on one machine choose alike.
        let mut best: Option<(Path, Duration)> = None;
        for &(path, t) in &times {
            match (t, best) {
                (Some(t), Some((_, fastest)))
                    if t.as_secs_f64() < MARGIN * fastest.as_secs_f64() =>
                {
                    best = Some((path, t))
                }
                (Some(t), None) => best = Some((path, t)),
                _ => {}
            }
        }
        let (best, best_time) = best.map_or((key.paths[0], None), |(p, t)| (p, Some(t)));
        let said = |t: Option<Duration>| match t {
            Some(t) => format!("{:.2} ms", ms(t)),
            None => "failed".into(),
        };
        let others: Vec<String> = times
            .iter()
            .filter(|(p, _)| *p != best)
            .map(|&(p, t)| format!("{} {}", p.describe(), said(t)))
            .collect();
        eprintln!(
            "attention: the {} on {}: {} ({})",
            key.describe(),
            best.describe(),
            said(best_time),
            others.join(", ")
        );
        self.chosen.insert(key, best);
        best
    }

    /// The path kept for a call of `pass` of these sizes, if any (any device, type, paths).
    #[cfg(all(test, feature = "wgpu"))]
    pub(super) fn kept(&self, pass: Pass, sizes: [usize; 4]) -> Option<(Path, Vec<Path>)> {
        self.chosen
            .iter()
            .find(|(key, _)| key.pass == pass && key.sizes == sizes)
            .map(|(key, &path)| (path, key.paths.clone()))
    }

    /// How many paths were timed for calls of these sizes.
    #[cfg(all(test, feature = "wgpu"))]
    pub(super) fn timed(&self, sizes: [usize; 4]) -> usize {
        self.timed.get(&sizes).copied().unwrap_or(0)
    }
}

fn ms(t: Duration) -> f64 {
    t.as_secs_f64() * 1e3
}

/// The process's choices.
pub(super) static CHOICES: Mutex<Option<Choices>> = Mutex::new(None);

/// One call of a pass, as its path is chosen: the projection `qkv` (contiguous, in its own
/// type), its sizes, the dropout probability and the pass.
pub(super) struct Call<'a> {
    pub(super) qkv: &'a CubeTensor,
    pub(super) dims: &'a Dims,
    pub(super) dropout: f32,
    pub(super) pass: Pass,
}

impl<'a> Call<'a> {
    /// A call of `pass` on `qkv`.
    pub(super) fn of(qkv: &'a CubeTensor, dims: &'a Dims, dropout: f32, pass: Pass) -> Self {
        Call {
            qkv,
            dims,
            dropout,
            pass,
        }
    }
}

/// The path `call` takes among `paths` (at least one, [`paths`]' order): the first where
/// nothing is timed (the module's documentation), else the fastest, `run(path)` running the
/// pass on that path (its outputs dropped) for the timing.
pub(super) fn choose(call: Call, paths: Vec<Path>, run: impl FnMut(Path)) -> Path {
    let recording = call.qkv.client.is_capturing();
    choose_while(recording, call, paths, run)
}

/// [`choose`] where `recording` says whether the device records a graph (a test's recording
/// would take every other test's launches on the device with it).
pub(super) fn choose_while(
    recording: bool,
    Call {
        qkv,
        dims,
        dropout,
        pass,
    }: Call,
    paths: Vec<Path>,
    mut run: impl FnMut(Path),
) -> Path {
    let first = paths[0];
    let min_scores = crate::gpu_kernels::policy()
        .attention
        .tune_min_scores
        .unwrap_or(MIN_SCORES);
    if paths.len() == 1
        || !crate::gpu_kernels::applies(GpuStrategy::AttentionTune)
        || dims.b * dims.heads * dims.t * dims.t < min_scores
    {
        return first;
    }
    let key = Key {
        device: qkv.device.to_id(),
        pass,
        dtype: qkv.dtype(),
        sizes: [dims.b, dims.t, dims.heads, dims.k()],
        dropout: dropout > 0.0,
        paths,
    };
    // The lock is held while timing: another thread's call of the same shape waits for the
    // choice instead of timing it again (and the timings do not overlap).
    let mut choices = CHOICES.lock().unwrap_or_else(|e| e.into_inner());
    let choices = choices.get_or_insert_with(Choices::default);
    // A recording takes the path kept for its shape (an evaluation records the pass it has just
    // run for real, and checks the replays against it), or the first.
    if recording {
        return choices.chosen.get(&key).copied().unwrap_or(first);
    }
    choices.choose(key, |path| time(qkv, || run(path)))
}

/// The device time of `run`: one run first (it compiles and tunes what it launches), then two
/// rounds of runs between synchronisations (as many as fill [`ROUND`], at most 8), the best
/// round's time per run; `None` where the device reports an error at a synchronisation (a
/// launch it refused takes no time, and must not win).
fn time(like: &CubeTensor, mut run: impl FnMut()) -> Option<Duration> {
    let sync = || burn_cubecl::cubecl::future::block_on(like.client.sync()).ok();
    run();
    sync()?;
    let start = Instant::now();
    run();
    sync()?;
    let once = start.elapsed().max(Duration::from_micros(1));
    let runs = (ROUND.as_nanos() / once.as_nanos()).clamp(1, 8) as u32;
    let mut best = once;
    for _ in 0..2 {
        let start = Instant::now();
        for _ in 0..runs {
            run();
        }
        sync()?;
        best = best.min(start.elapsed() / runs);
    }
    Some(best)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    fn key(t: usize, paths: Vec<Path>) -> Key {
        Key {
            device: DeviceId::new(0, 0),
            pass: Pass::Forward,
            dtype: DType::F32,
            sizes: [2, t, 3, 16],
            dropout: false,
            paths,
        }
    }

    /// The fastest path is kept (an earlier one unless a later one is 5% faster; a failed one
    /// never, and the first where all failed), each path of a key timed once, and a key seen
    /// before is answered without timing.
    #[test]
    fn the_fastest_path_is_kept_for_each_key() {
        use Path::{Fused, Products};
        let mut choices = Choices::default();
        let log = &RefCell::new(Vec::new());
        // Timings of the products and of the fused kernels, in milliseconds (0: failed).
        let time = move |ms: [u64; 2]| {
            move |path: Path| {
                log.borrow_mut().push(path);
                let ms = if path == Products { ms[0] } else { ms[1] };
                (ms > 0).then(|| Duration::from_millis(ms))
            }
        };
        let both = vec![Products, Fused];
        assert_eq!(choices.choose(key(8, both.clone()), time([3, 2])), Fused);
        assert_eq!(choices.choose(key(8, both.clone()), time([1, 9])), Fused);
        assert_eq!(
            choices.choose(key(9, both.clone()), time([100, 96])),
            Products
        );
        assert_eq!(
            choices.choose(key(9, vec![Fused, Products]), time([94, 100])),
            Products
        );
        assert_eq!(choices.choose(key(10, both.clone()), time([0, 5])), Fused);
        assert_eq!(
            choices.choose(key(11, vec![Fused, Products]), time([0, 0])),
            Fused
        );
        assert_eq!(
            *log.borrow(),
            [
                Products, Fused, Products, Fused, Fused, Products, Products, Fused, Fused, Products
            ]
        );
        assert_eq!(choices.timed.values().sum::<usize>(), 10);
    }
}
