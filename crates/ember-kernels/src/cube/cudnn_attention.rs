//! The training attention's two passes through cuDNN's fused flash attention (feature `cudnn`,
//! CUDA, `EMBER_CUDNN_ATTENTION=1`): for mixed precision's bf16 (or f16) projection, the
//! attention that PyTorch runs on a Hopper GPU (`cudnn_generated_fort_native_sdpa_sm90_flash_
//! {fprop,bprop}`), on tensor cores, with no `[B, T, T]` scores stored.
//!
//! The graphs (`cudnn::attention_graph`) read and write ember's buffers in place: the
//! projection, the output, the log-sum-exps ember's own passes keep, the gradient. Plans are
//! built once per device and shape (`B`, `H`, `T`, `K`, type, dropout) and kept. The dropout
//! mask is cuDNN's (Philox, from a seed made of the op's seed on the device and offset 0): the
//! same in both passes, not the fused kernels' hashed mask, so a pass never mixes the two paths
//! for one op (the backward pass takes cuDNN exactly where the forward pass did).
//!
//! Off by default: on an H200 with cuDNN 9.19 the start-up check ([`agrees`]) found the graphs
//! without dropout disagreeing with ember's kernels (every row but the first of the output),
//! while training steps through the graphs with dropout gave the losses of ember's own path
//! (docs/benchmarks.md). `EMBER_CUDNN_CHECK=report` prints every comparison of the check, in
//! both forms of the graphs and four shapes, for diagnosing that on a GPU;
//! `EMBER_CUDNN_CHECK=skip` skips the check (for measurements only); `EMBER_CUDNN_SYNC=1` waits
//! for the device around each call.
//!
//! Where cuDNN cannot be loaded, refuses a graph, or disagrees with ember's kernels on the
//! start-up check, one warning line says so and ember's own path runs.

use super::attention::{float_cast_to, wide};
use crate::cudnn::attention_graph::{AttentionShape, backward_graph, forward_graph, uid};
use crate::cudnn::graph::{DataType, Uid};
use crate::cudnn::library;
use crate::cudnn::lowering::{self, CudnnError, Plan};
use burn::backend::TensorMetadata;
use burn::tensor::DType;
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::{CubeCount, CubeDim};
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::cudnn::sys as dnn;
use cudarc::driver::sys as driver;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

type CudaServer = <CudaRuntime as Runtime>::Server;

/// cuDNN 9.6 and later zero the queries' gradient accumulator themselves (cudnn-frontend stops
/// clearing it there).
const ZEROES_ITS_ACCUMULATOR: usize = 9_06_00;

/// The shape of `qkv`'s attention if cuDNN may take it: a bf16 or f16 projection on a CUDA
/// device, the `cudnn` switch on, head sizes cuDNN's flash kernels take (a multiple of 8, at
/// most 256), a width whose column blocks start 16-byte aligned, no graph being recorded, cuDNN
/// loaded, and the start-up check passed for the type.
pub(crate) fn takes(qkv: &CubeTensor, heads: usize, dropout: f32) -> Option<AttentionShape> {
    let dtype = match qkv.dtype() {
        DType::BF16 => DataType::Bf16,
        DType::F16 => DataType::F16,
        _ => return None,
    };
    if !crate::gpu_kernels::cudnn_attention()
        || !matches!(qkv.device, burn_cubecl::CubeDevice::Cuda(_))
        || qkv.client.is_capturing()
    {
        return None;
    }
    let [b, t, d3] = qkv.shape().dims::<3>();
    let d = d3 / 3;
    let k = d / heads.max(1);
    if b == 0 || t == 0 || k == 0 || !k.is_multiple_of(8) || k > 256 || !d.is_multiple_of(8) {
        return None;
    }
    if FAILED.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    let version = loaded()?;
    let shape = AttentionShape {
        b: b as i64,
        h: heads as i64,
        t: t as i64,
        k: k as i64,
        dtype,
        dropout,
        rng: false,
        masked: match version < 9_01_00 {
            true => f32::MIN,
            false => f32::NEG_INFINITY,
        },
    };
    if CHECKING.with(|c| c.get()) {
        return Some(shape);
    }
    // The form of the graphs without dropout is the one the check found to agree.
    agrees_on(qkv).then(|| AttentionShape {
        rng: dropout == 0.0 && RNG_WHEN_KEPT.load(std::sync::atomic::Ordering::Relaxed),
        ..shape
    })
}

/// Set by the first failed call: from then on the attention runs on ember's own path (a
/// forward pass through cuDNN whose backward pass then cannot is the only mix of the two).
static FAILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// cuDNN's version where it loads, else `None` (said once).
fn loaded() -> Option<usize> {
    static SAID: OnceLock<()> = OnceLock::new();
    match library::api() {
        Ok(api) => Some(api.version),
        Err(why) => {
            SAID.get_or_init(|| {
                eprintln!("warning: cuDNN's flash attention is not used: {why}; the attention runs on ember's own path");
            });
            None
        }
    }
}

/// The forward pass: the output `[B, T, D]` (in the projection's type) and the log-sum-exps
/// `[B, H, T]` (`f32`) of the contiguous projection, or `None` where cuDNN does not take it
/// (nothing was written).
pub(crate) fn forward(
    qkv: &CubeTensor,
    seed: &CubeTensor,
    shape: &AttentionShape,
) -> Option<(CubeTensor, CubeTensor)> {
    let plans = plans_for(qkv, shape)?;
    let (b, h, t, d) = dims(shape);
    let out = super::empty_of(qkv, [b, t, d], qkv.dtype());
    let lse = super::empty(qkv, [b, h, t]);
    let mut bound: Vec<(Uid, &CubeTensor, usize)> = vec![
        (uid::O, &out, 0),
        (uid::Q, qkv, offset(shape, uid::Q, qkv)),
        (uid::K, qkv, offset(shape, uid::K, qkv)),
        (uid::V, qkv, offset(shape, uid::V, qkv)),
        (uid::STATS, &lse, 0),
    ];
    let seeds = (shape.dropout > 0.0 || shape.rng).then(|| philox_seeds(seed));
    if let Some((s, o)) = &seeds {
        bound.extend([(uid::SEED, s, 0), (uid::OFFSET, o, 0)]);
    }
    let workspace = super::empty(qkv, [plans.forward.workspace.div_ceil(4).max(1)]);
    match execute(&plans.forward, "cudnnSdpaForward", &bound, &workspace, None) {
        Ok(()) => Some((out, lse)),
        Err(e) => {
            warn_once(&format!("the forward pass failed ({e})"));
            None
        }
    }
}

/// The backward pass: the gradient `[B, T, 3D]` (in the projection's type) from the forward
/// pass's contiguous projection, seed, output and log-sum-exps and the output's contiguous
/// gradient (in the projection's type); `None` where the forward pass's plans are not there.
pub(crate) fn backward(
    qkv: &CubeTensor,
    seed: &CubeTensor,
    out: &CubeTensor,
    lse: &CubeTensor,
    grad: &CubeTensor,
    shape: &AttentionShape,
) -> Option<CubeTensor> {
    let plans = plans_for(qkv, shape)?;
    let (b, h, t, d) = dims(shape);
    let dtype = qkv.dtype();
    let dqkv = super::empty_of(qkv, [b, t, 3 * d], dtype);
    let delta = super::empty(qkv, [b, h, t]);
    let accumulator = super::empty(qkv, [b, h, t, d / h]);
    let mut bound: Vec<(Uid, &CubeTensor, usize)> = vec![
        (uid::DQ, &dqkv, offset(shape, uid::DQ, qkv)),
        (uid::DK, &dqkv, offset(shape, uid::DK, qkv)),
        (uid::DV, &dqkv, offset(shape, uid::DV, qkv)),
        (uid::Q, qkv, offset(shape, uid::Q, qkv)),
        (uid::K, qkv, offset(shape, uid::K, qkv)),
        (uid::V, qkv, offset(shape, uid::V, qkv)),
        (uid::O, out, 0),
        (uid::DO, grad, 0),
        (uid::STATS, lse, 0),
        (uid::DELTA, &delta, 0),
        (uid::DQ_ACCUMULATOR, &accumulator, 0),
    ];
    let seeds = (shape.dropout > 0.0 || shape.rng).then(|| philox_seeds(seed));
    if let Some((s, o)) = &seeds {
        bound.extend([(uid::SEED, s, 0), (uid::OFFSET, o, 0)]);
    }
    let workspace = super::empty(qkv, [plans.backward.workspace.div_ceil(4).max(1)]);
    let zero = (library::api().map_or(0, |a| a.version) < ZEROES_ITS_ACCUMULATOR)
        .then_some((uid::DQ_ACCUMULATOR, b * h * t * (d / h)));
    match execute(
        &plans.backward,
        "cudnnSdpaBackward",
        &bound,
        &workspace,
        zero,
    ) {
        Ok(()) => Some(dqkv),
        Err(e) => {
            warn_once(&format!("the backward pass failed ({e})"));
            None
        }
    }
}

fn dims(shape: &AttentionShape) -> (usize, usize, usize, usize) {
    let (b, h, t) = (shape.b as usize, shape.h as usize, shape.t as usize);
    (b, h, t, (shape.h * shape.k) as usize)
}

/// Where `uid`'s tensor starts in its buffer, in bytes.
fn offset(shape: &AttentionShape, uid: Uid, like: &CubeTensor) -> usize {
    shape.element_offset(uid) as usize * like.dtype().size()
}

/// One warning line for the first failure of the process, and no cuDNN from then on.
fn warn_once(what: &str) {
    FAILED.store(true, std::sync::atomic::Ordering::Relaxed);
    static SAID: OnceLock<()> = OnceLock::new();
    SAID.get_or_init(|| {
        eprintln!(
            "warning: cuDNN's flash attention: {what}; the attention runs on ember's own path"
        );
    });
}

/// A device's plans for one shape.
struct Plans {
    forward: Plan,
    backward: Plan,
}

/// What a pair of plans is built for: the CUDA context and the shape (the dropout by its bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    context: usize,
    dims: [i64; 4],
    dtype: DataType,
    dropout: u32,
    rng: bool,
}

/// The plans of each context and shape: `None` where cuDNN refused one of the graphs.
fn cache() -> &'static Mutex<HashMap<Key, Option<Arc<Plans>>>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Option<Arc<Plans>>>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// `shape`'s plans on `like`'s device, built on first use (both passes: a forward pass cuDNN
/// takes always has its backward pass); `None` where cuDNN refuses either graph (said once).
fn plans_for(like: &CubeTensor, shape: &AttentionShape) -> Option<Arc<Plans>> {
    let on = with_handle(like, |handle, context| {
        let key = Key {
            context,
            dims: [shape.b, shape.h, shape.t, shape.k],
            dtype: shape.dtype,
            dropout: shape.dropout.to_bits(),
            rng: shape.rng,
        };
        let mut cache = cache().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = cache.get(&key) {
            return found.clone();
        }
        let built = (|| -> Result<Plans, CudnnError> {
            Ok(Plans {
                forward: lowering::build(handle, &forward_graph(shape))?,
                backward: lowering::build(handle, &backward_graph(shape))?,
            })
        })();
        let plans = match built {
            Ok(plans) => Some(Arc::new(plans)),
            Err(e) => {
                eprintln!(
                    "warning: cuDNN refused the attention of {} sequences of {} positions, {} heads of {} ({:?}, dropout {}): {e}; \
                     that shape runs on ember's own path",
                    shape.b, shape.t, shape.h, shape.k, shape.dtype, shape.dropout
                );
                None
            }
        };
        cache.insert(key, plans.clone());
        plans
    });
    on.flatten()
}

/// A cuDNN handle, created in one CUDA context and used under the lock of [`handles`].
struct Handle(dnn::cudnnHandle_t);

// SAFETY: a handle is only used while [`handles`]' lock is held, by one thread at a time.
unsafe impl Send for Handle {}

fn handles() -> &'static Mutex<HashMap<usize, Handle>> {
    static HANDLES: OnceLock<Mutex<HashMap<usize, Handle>>> = OnceLock::new();
    HANDLES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// `f` with the cuDNN handle of `like`'s CUDA context (made current; the handle created on
/// first use) and the context's address; `None` where the buffer is not CUDA's or cuDNN
/// refuses a handle.
fn with_handle<R>(like: &CubeTensor, f: impl FnOnce(dnn::cudnnHandle_t, usize) -> R) -> Option<R> {
    let api = library::api().ok()?;
    let resource = like
        .client
        .get_resource::<CudaServer>(like.handle.clone())
        .ok()?;
    let stream = resource.resource().stream;
    let mut handles = handles().lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: the stream is CubeCL's; its context is made current before cuDNN is called.
    unsafe {
        let mut context = std::ptr::null_mut();
        if driver::cuStreamGetCtx(stream, &mut context)
            .result()
            .is_err()
            || driver::cuCtxSetCurrent(context).result().is_err()
        {
            return None;
        }
        let handle = match handles.get(&(context as usize)) {
            Some(handle) => handle.0,
            None => {
                let mut handle = std::ptr::null_mut();
                if let Err(e) = lowering::check((api.create)(&mut handle), "create a cuDNN handle")
                {
                    warn_once(&e.0);
                    return None;
                }
                handles.insert(context as usize, Handle(handle));
                handle
            }
        };
        if (api.set_stream)(handle, stream as dnn::cudaStream_t) != 0 {
            return None;
        }
        Some(f(handle, context as usize))
    }
}

/// Enqueues `plan` on the stream of the first bound tensor's buffer, each uid of the plan at
/// its tensor's buffer plus its byte offset, `workspace` as its work memory; with `zero`, that
/// uid's first `n` `f32`s are cleared first. Timed as one launch named `name` where a profiler
/// observes ([`crate::external_launches`]).
fn execute(
    plan: &Plan,
    name: &'static str,
    bound: &[(Uid, &CubeTensor, usize)],
    workspace: &CubeTensor,
    zero: Option<(Uid, usize)>,
) -> Result<(), CudnnError> {
    let client = &bound[0].1.client;
    let lookup = |x: &CubeTensor| client.get_resource::<CudaServer>(x.handle.clone()).ok();
    // Resources keep their buffers in place until dropped, after the plan is enqueued.
    let resources = bound
        .iter()
        .map(|(_, x, _)| lookup(x))
        .collect::<Option<Vec<_>>>();
    let (Some(resources), Some(space)) = (resources, lookup(workspace)) else {
        return Err(CudnnError("a buffer is not CUDA's".into()));
    };
    let address = |uid: Uid| -> Result<u64, CudnnError> {
        let i = bound
            .iter()
            .position(|(u, ..)| *u == uid)
            .ok_or_else(|| CudnnError(format!("no buffer for tensor {uid}")))?;
        Ok(resources[i].resource().ptr + bound[i].2 as u64)
    };
    let addresses = plan
        .memory_uids()
        .iter()
        .map(|&u| address(u))
        .collect::<Result<Vec<_>, _>>()?;
    let zero = match zero {
        Some((uid, n)) => Some((address(uid)?, n)),
        None => None,
    };
    let stream = resources[0].resource().stream;
    let done = with_handle(bound[0].1, |handle, context| {
        // SAFETY: the addresses are the live buffers held above, each holding its tensor's
        // extent (the callers allocate them from the plan's shape), on this stream's device.
        unsafe {
            if let Some((at, n)) = zero {
                driver::cuMemsetD32Async(at, 0, n, stream)
                    .result()
                    .map_err(|e| CudnnError(format!("clear the accumulator: {e:?}")))?;
            }
            let timing = crate::external_launches::observer()
                .and_then(|observer| Some((observer, crate::products::cublas::event_on(stream)?)));
            if synchronizes() {
                driver::cuCtxSynchronize()
                    .result()
                    .map_err(|e| CudnnError(format!("synchronize: {e:?}")))?;
            }
            let ran = plan.execute(handle, &addresses, space.resource().ptr);
            if synchronizes() {
                driver::cuCtxSynchronize()
                    .result()
                    .map_err(|e| CudnnError(format!("synchronize: {e:?}")))?;
            }
            if let Some((observer, start)) = timing
                && let Some(end) = crate::products::cublas::event_on(stream)
            {
                observer.launched(
                    name,
                    crate::products::cublas::elapsed_between(
                        context as driver::CUcontext,
                        start,
                        end,
                    ),
                );
            }
            ran
        }
    });
    done.unwrap_or_else(|| Err(CudnnError("no cuDNN handle for the device".into())))
}

/// Whether each cuDNN call waits for the device before and after it (`EMBER_CUDNN_SYNC=1`, for
/// diagnosing the order of cuDNN's work and CubeCL's: slower).
fn synchronizes() -> bool {
    static SYNC: OnceLock<bool> = OnceLock::new();
    *SYNC.get_or_init(|| std::env::var("EMBER_CUDNN_SYNC").is_ok_and(|v| v == "1"))
}

/// The dropout's Philox seed and offset, `[1]` `i64` tensors: the op's seed (a uniform number in
/// `[0, 1)` on the device, its first 24 bits) and 0.
fn philox_seeds(seed: &CubeTensor) -> (CubeTensor, CubeTensor) {
    let (s, o) = (
        super::empty_of(seed, [1], DType::I64),
        super::empty_of(seed, [1], DType::I64),
    );
    kernels::philox_seeds::launch(
        &seed.client.clone(),
        CubeCount::new_single(),
        CubeDim::new_single(),
        seed.clone().into_tensor_arg(),
        s.clone().into_tensor_arg(),
        o.clone().into_tensor_arg(),
    );
    (s, o)
}

mod kernels {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    /// `seed_out[0] = floor(seed[0] * 2^24)`, `offset[0] = 0`.
    #[cube(launch)]
    pub(super) fn philox_seeds(
        seed: &Tensor<f32>,
        seed_out: &mut Tensor<i64>,
        offset: &mut Tensor<i64>,
    ) {
        seed_out[0] = i64::cast_from(seed[0] * 16777216.0);
        offset[0] = 0;
    }
}

/// Whether [`agrees`] on `like`'s device, checked on the first call in the process for each
/// type, so that a wrong graph never trains a model: where it does not agree, says so once and
/// the attention runs on ember's own path.
fn agrees_on(like: &CubeTensor) -> bool {
    static AGREES: [OnceLock<bool>; 2] = [const { OnceLock::new() }; 2];
    let slot = usize::from(like.dtype() == DType::F16);
    *AGREES[slot].get_or_init(|| {
        if std::env::var("EMBER_CUDNN_CHECK").is_ok_and(|v| v == "skip") {
            eprintln!("attention: cuDNN {} flash attention ({:?}), not checked (EMBER_CUDNN_CHECK=skip)", version_name(), like.dtype());
            return true;
        }
        match agrees(like) {
            Ok(report) => {
                eprintln!("attention: cuDNN {} flash attention ({:?}), {report}", version_name(), like.dtype());
                true
            }
            Err(why) => {
                eprintln!(
                    "warning: cuDNN's flash attention disagrees with ember's kernels on this device ({why}); \
                     the attention runs on ember's own path"
                );
                false
            }
        }
    })
}

thread_local! {
    /// Set while the start-up check runs on this thread (its own calls of [`takes`] skip it).
    static CHECKING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// cuDNN's version and where it was loaded from.
fn version_name() -> String {
    match library::api() {
        Ok(api) => format!("{} (from {})", library::name(api.version), api.folder),
        Err(_) => "?".into(),
    }
}

/// cuDNN's passes against ember's fused kernels on `like`'s device in its type.
///
/// Without dropout (2 sequences of 128 positions, 2 heads of 64; 4 of 256, 6 heads of 64): the
/// output, log-sum-exps and gradient agree within 2% of the largest value (weights and outputs
/// rounded to 8 bits in bf16, the fused kernels computing from the same rounded inputs in
/// `f32`), and the fused kernels give the same values before and after cuDNN ran. The graphs
/// without dropout nodes are tried first, then those with the nodes kept (every element kept):
/// the first form that agrees is the one used from then on ([`RNG_WHEN_KEPT`]).
///
/// With dropout (0.25; 64 positions, `V` the identity so the output is the dropped weights
/// themselves, and `dO` the identity so `dV` is their transpose): each weight kept is the fused
/// kernels' weight times `1 / (1 - p)`, the backward pass drops the same weights as the forward
/// pass, and about a quarter of the weights the causal mask keeps are dropped.
///
/// The error names what differs; the report gives the largest differences.
fn agrees(like: &CubeTensor) -> Result<String, String> {
    if std::env::var("EMBER_CUDNN_CHECK").is_ok_and(|v| v == "report") {
        report_all(like);
    }
    let mut report = Vec::new();
    let mut failures = Vec::new();
    let mut chosen = None;
    for rng in [false, true] {
        let checked: Result<Vec<String>, String> = [(2, 128, 2), (4, 256, 6)]
            .into_iter()
            .map(|(b, t, heads)| without_dropout(like, b, t, heads, rng))
            .collect();
        match checked {
            Ok(lines) => {
                chosen = Some(rng);
                report.push(lines.join("; "));
                break;
            }
            Err(e) => failures.push(format!(
                "{}: {e}",
                if rng {
                    "with dropout nodes"
                } else {
                    "plain graphs"
                }
            )),
        }
    }
    let Some(rng) = chosen else {
        return Err(failures.join("; "));
    };
    RNG_WHEN_KEPT.store(rng, std::sync::atomic::Ordering::Relaxed);
    if rng {
        report.push(format!(
            "without dropout as the graphs with their dropout nodes (the plain graphs disagreed: {})",
            failures.join("; ")
        ));
    }
    report.push(with_dropout(like)?);
    Ok(format!(
        "checked against ember's kernels: {}",
        report.join("; ")
    ))
}

/// Every comparison of [`agrees`] in both forms of the graphs and four shapes, each on its own
/// line of stderr whether it agrees or not, with the first values of the output's rows 1 to 3
/// and of the log-sum-exps (head 0, first sequence) from cuDNN and from the fused kernels: for
/// diagnosing a disagreement on a GPU (`EMBER_CUDNN_CHECK=report`).
fn report_all(like: &CubeTensor) {
    for rng in [false, true] {
        let form = if rng {
            "with dropout nodes"
        } else {
            "plain graphs"
        };
        for (b, t, heads) in [(2, 128, 2), (1, 64, 1), (4, 256, 6), (1, 1024, 12)] {
            let line = match without_dropout(like, b, t, heads, rng) {
                Ok(line) => format!("agrees: {line}"),
                Err(e) => format!("DIFFERS: {e}"),
            };
            eprintln!("cuDNN check, {form}, {b}x{t}, {heads} heads of 64: {line}");
            if let Err(e) = dump(like, b, t, heads, rng) {
                eprintln!("    (no values: {e})");
            }
        }
    }
    match with_dropout(like) {
        Ok(line) => eprintln!("cuDNN check, dropout 0.25: agrees: {line}"),
        Err(e) => eprintln!("cuDNN check, dropout 0.25: DIFFERS: {e}"),
    }
}

/// The first values of [`report_all`]'s line for one case.
fn dump(like: &CubeTensor, b: usize, t: usize, heads: usize, rng: bool) -> Result<(), String> {
    let d = heads * 64;
    let qkv = load(like, pattern(b * t * 3 * d, 1), vec![b, t, 3 * d]);
    let grad = load(like, pattern(b * t * d, 2), vec![b, t, d]);
    let shape = AttentionShape {
        rng,
        ..takes_unchecked(&qkv, heads, 0.0).ok_or("cuDNN does not take the shape")?
    };
    let (out, lse, _) = through_cudnn(like, &qkv, &grad, &shape)?;
    let (fused_out, fused_lse) = super::attention::fused_forward(
        wide::<CubeBackend>(qkv.clone()),
        check_seed(like),
        heads,
        0.0,
    );
    let (out, lse) = (read(out, "output")?, read(lse, "log-sum-exp")?);
    let (fused_out, fused_lse) = (read(fused_out, "output")?, read(fused_lse, "log-sum-exp")?);
    for row in 1..4.min(t) {
        let at = row * d;
        eprintln!(
            "    output row {row}: cuDNN {:?}, fused {:?}",
            &out[at..at + 4],
            &fused_out[at..at + 4]
        );
    }
    eprintln!(
        "    log-sum-exp rows 0-3: cuDNN {:?}, fused {:?}",
        &lse[..4.min(t)],
        &fused_lse[..4.min(t)]
    );
    Ok(())
}

/// Whether the graphs keep their dropout nodes when nothing is dropped (the form [`agrees`]
/// found to agree).
static RNG_WHEN_KEPT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `((i * 7919 + seed) mod 61) / 30 - 1` for `i` in `0..n`: values in `[-1, 1]`.
fn pattern(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed) % 61) as f32 / 30.0 - 1.0)
        .collect()
}

/// `values` of `shape` on `like`'s device, in its type.
fn load(like: &CubeTensor, values: Vec<f32>, shape: Vec<usize>) -> CubeTensor {
    use burn::backend::ops::FloatTensorOps;
    use burn::tensor::TensorData;
    let x = CubeBackend::float_from_data(TensorData::new(values, shape), &like.device);
    float_cast_to::<CubeBackend>(x, like.dtype())
}

/// `x`'s values in `f32`, read back.
fn read(x: CubeTensor, what: &str) -> Result<Vec<f32>, String> {
    burn_cubecl::ops::into_data_sync(wide::<CubeBackend>(x))
        .try_to_vec::<f32>()
        .map_err(|e| format!("reading the {what} back: {e:?}"))
}

/// The seed tensor of the checks (`[1]`, `f32`).
fn check_seed(like: &CubeTensor) -> CubeTensor {
    use burn::backend::ops::FloatTensorOps;
    use burn::tensor::TensorData;
    CubeBackend::float_from_data(TensorData::new(vec![0.375_f32], [1]), &like.device)
}

/// cuDNN's two passes (on the device thread, as the op runs them): output, log-sum-exps,
/// gradient.
fn through_cudnn(
    like: &CubeTensor,
    qkv: &CubeTensor,
    grad: &CubeTensor,
    shape: &AttentionShape,
) -> Result<(CubeTensor, CubeTensor, CubeTensor), String> {
    let seed = check_seed(like);
    let (out, lse) = super::on_device_thread(&like.client, || forward(qkv, &seed, shape))
        .flatten()
        .ok_or("the forward pass did not run")?;
    let dqkv = super::on_device_thread(&like.client, || {
        backward(qkv, &seed, &out, &lse, grad, shape)
    })
    .flatten()
    .ok_or("the backward pass did not run")?;
    Ok((out, lse, dqkv))
}

/// The no-dropout comparison of [`agrees`] on `b` sequences of `t` positions, `heads` heads of
/// 64, the graphs with their dropout nodes where `rng`.
fn without_dropout(
    like: &CubeTensor,
    b: usize,
    t: usize,
    heads: usize,
    rng: bool,
) -> Result<String, String> {
    let k = 64;
    let d = heads * k;
    let qkv = load(like, pattern(b * t * 3 * d, 1), vec![b, t, 3 * d]);
    let grad = load(like, pattern(b * t * d, 2), vec![b, t, d]);
    let shape = AttentionShape {
        rng,
        ..takes_unchecked(&qkv, heads, 0.0).ok_or("cuDNN does not take the check's shape")?
    };
    let seed = check_seed(like);
    let fused = || -> Result<[Vec<f32>; 3], String> {
        let (out, lse) = super::attention::fused_forward(
            wide::<CubeBackend>(qkv.clone()),
            seed.clone(),
            heads,
            0.0,
        );
        let dqkv = super::attention::fused_backward(
            wide::<CubeBackend>(qkv.clone()),
            seed.clone(),
            out.clone(),
            lse.clone(),
            wide::<CubeBackend>(grad.clone()),
            heads,
            0.0,
        );
        Ok([
            read(out, "output")?,
            read(lse, "log-sum-exp")?,
            read(dqkv, "gradient")?,
        ])
    };
    let before = fused()?;
    let (out, lse, dqkv) = through_cudnn(like, &qkv, &grad, &shape)?;
    let ours = [
        read(out, "output")?,
        read(lse, "log-sum-exp")?,
        read(dqkv, "gradient")?,
    ];
    let after = fused()?;
    let mut report = Vec::new();
    for (i, what) in ["output", "log-sum-exp", "gradient"]
        .into_iter()
        .enumerate()
    {
        if let Some(e) = difference(&after[i], &before[i], 0.0) {
            return Err(format!(
                "the fused kernels' {what} changed after cuDNN ran: {e}"
            ));
        }
        if let Some(e) = difference(&ours[i], &before[i], 0.02) {
            return Err(format!("{b}x{t}, {heads} heads, {what}: {e}"));
        }
        report.push(format!(
            "{what} within {:.2}%",
            100.0 * largest(&ours[i], &before[i])
        ));
    }
    Ok(format!("{b}x{t}, {heads} heads: {}", report.join(", ")))
}

/// The dropout comparison of [`agrees`].
fn with_dropout(like: &CubeTensor) -> Result<String, String> {
    let (b, t, heads, k, p) = (2usize, 64usize, 2usize, 64usize, 0.25f32);
    let d = heads * k;
    let mut values = pattern(b * t * 3 * d, 3);
    let mut identity = vec![0f32; b * t * d];
    for s in 0..b {
        for i in 0..t {
            for h in 0..heads {
                for c in 0..k {
                    let one = if c == i { 1.0 } else { 0.0 };
                    values[(s * t + i) * 3 * d + 2 * d + h * k + c] = one;
                    identity[(s * t + i) * d + h * k + c] = one;
                }
            }
        }
    }
    let qkv = load(like, values, vec![b, t, 3 * d]);
    let eye = load(like, identity, vec![b, t, d]);
    let shape = takes_unchecked(&qkv, heads, p).ok_or("cuDNN does not take the check's shape")?;
    // The weights themselves: the fused kernels' output with `V = I` and no dropout.
    let (plain, _) = super::attention::fused_forward(
        wide::<CubeBackend>(qkv.clone()),
        check_seed(like),
        heads,
        0.0,
    );
    let plain = read(plain, "weights")?;
    let (out, _, dqkv) = through_cudnn(like, &qkv, &eye, &shape)?;
    let (weights, grads) = (
        read(out, "dropped weights")?,
        read(dqkv, "gradient with dropout")?,
    );
    let rescale = 1.0 / (1.0 - p);
    let (mut kept, mut dropped) = (0usize, 0usize);
    for s in 0..b {
        for h in 0..heads {
            for i in 0..t {
                for j in 0..t {
                    // Output row i, column j: query i's dropped weight of key j; dV row j,
                    // column i: the same weight as the backward pass drops it.
                    let at = (s * t + i) * d + h * k + j;
                    let (forward, weight) = (weights[at], plain[at]);
                    let backward = grads[(s * t + j) * 3 * d + 2 * d + h * k + i];
                    if (forward - backward).abs() > 0.02 * forward.abs().max(0.05) {
                        return Err(format!(
                            "with dropout, query {i}'s weight of key {j} (head {h}) is {forward} forward and {backward} backward"
                        ));
                    }
                    if forward != 0.0
                        && (forward - weight * rescale).abs()
                            > 0.02 * (weight * rescale).abs().max(0.05)
                    {
                        return Err(format!(
                            "with dropout, query {i}'s kept weight of key {j} (head {h}) is {forward}, the fused kernels' {} after rescaling",
                            weight * rescale
                        ));
                    }
                    if j <= i {
                        match forward == 0.0 {
                            true => dropped += 1,
                            false => kept += 1,
                        }
                    } else if forward != 0.0 {
                        return Err(format!("query {i} sees the later key {j} ({forward})"));
                    }
                }
            }
        }
    }
    let share = dropped as f64 / (kept + dropped) as f64;
    if !(0.2..0.3).contains(&share) {
        return Err(format!(
            "dropout 0.25 dropped {:.1}% of the weights",
            100.0 * share
        ));
    }
    Ok(format!(
        "dropout: kept weights rescaled, the same masks forward and backward ({:.1}% dropped)",
        100.0 * share
    ))
}

/// Where `ours` differs from `reference` by more than `tolerance` times the reference's largest
/// magnitude (at least 1): how many values, the first and the largest.
fn difference(ours: &[f32], reference: &[f32], tolerance: f32) -> Option<String> {
    let scale = reference.iter().fold(1f32, |m, v| m.max(v.abs()));
    let bad: Vec<usize> = (0..ours.len().min(reference.len()))
        // A NaN is never close.
        .filter(|&i| {
            let close = (ours[i] - reference[i]).abs() <= tolerance * scale;
            !close
        })
        .collect();
    let &first = bad.first()?;
    Some(format!(
        "{} of {} values differ, the first at {first}: {} against {}; the largest difference {:.3} of the largest value",
        bad.len(),
        ours.len(),
        ours[first],
        reference[first],
        largest(ours, reference)
    ))
}

/// The largest difference of `ours` from `reference`, relative to the reference's largest
/// magnitude (at least 1).
fn largest(ours: &[f32], reference: &[f32]) -> f32 {
    let scale = reference.iter().fold(1f32, |m, v| m.max(v.abs()));
    (ours.iter().zip(reference)).fold(0f32, |m, (a, b)| m.max((a - b).abs() / scale))
}

/// [`takes`] without the start-up check (for the check itself).
fn takes_unchecked(qkv: &CubeTensor, heads: usize, dropout: f32) -> Option<AttentionShape> {
    CHECKING.with(|c| {
        let before = c.replace(true);
        let shape = takes(qkv, heads, dropout);
        c.set(before);
        shape
    })
}
