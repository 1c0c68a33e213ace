//! The training attention's two passes through cuDNN's fused flash attention (feature `cudnn`,
//! CUDA; on unless `EMBER_CUDNN_ATTENTION=0`): for mixed precision's bf16 (or f16) projection,
//! the attention that PyTorch runs on a Hopper GPU (`cudnn_generated_fort_native_sdpa_sm90_
//! flash_{fprop,bprop}`), on tensor cores, with no `[B, T, T]` scores stored.
//!
//! The graphs (`cudnn::attention_graph`) read and write ember's buffers in place: the
//! projection, the output, the log-sum-exps ember's own passes keep, the gradient, each densely
//! packed ([`packed`]: CubeCL's CUDA allocator may pad a tensor's rows). Plans are built once per
//! device and shape (`B`, `H`, `T`, `K`, type, dropout, mask) and kept. The dropout mask is
//! cuDNN's (Philox, from a seed made of the op's seed on the device and offset 0): the same in
//! both passes, not the fused kernels' hashed mask, so a pass never mixes the two paths for one
//! op (the backward pass takes cuDNN exactly where the forward pass did).
//!
//! Before it trains anything, a start-up check (`check`) holds cuDNN's passes to ember's fused
//! kernels on the device, with and without dropout. `EMBER_CUDNN_CHECK=report` prints its every
//! comparison and `EMBER_CUDNN_DUMP=FOLDER` writes the inputs and outputs in full (and compares
//! a grid of shapes and every engine cuDNN offers), for diagnosing a disagreement on a GPU;
//! `EMBER_CUDNN_CHECK=skip` skips the check (for measurements only); `EMBER_CUDNN_SYNC=1` waits
//! for the device around each call.
//!
//! Where cuDNN cannot be loaded, refuses a graph, or disagrees with ember's kernels on the
//! start-up check, one warning line says so and ember's own path runs.

use crate::cudnn::attention_graph::{AttentionShape, uid};
use crate::cudnn::graph::{DataType, Uid};
use crate::cudnn::library;
use crate::cudnn::lowering::{CudnnError, Plan};
use burn::backend::TensorMetadata;
use burn::tensor::DType;
use burn_cubecl::cubecl::{CubeCount, CubeDim};
use burn_cubecl::tensor::CubeTensor;
use check::{CHECKING, RNG_WHEN_KEPT, agrees_on};
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::sys as driver;
use plans::{Plans, built_plans, plans_for, with_handle, with_stream_handle};
use std::sync::OnceLock;

mod check;
mod diagnose;
mod plans;
pub(crate) mod without_waiting;

type CudaServer = <CudaRuntime as Runtime>::Server;

/// cuDNN 9.6 and later zero the queries' gradient accumulator themselves (cudnn-frontend stops
/// clearing it there).
const ZEROES_ITS_ACCUMULATOR: usize = 9_06_00;

/// The shape of `qkv`'s attention if cuDNN may take it: a bf16 or f16 projection on a CUDA
/// device, the `cudnn` switch on, head sizes cuDNN's flash kernels take (a multiple of 8, at
/// most 256), a width whose column blocks start 16-byte aligned, no graph being recorded that
/// leaves libraries out ([`crate::recording`]), cuDNN loaded, and the start-up check passed for
/// the type.
pub(crate) fn takes(qkv: &CubeTensor, heads: usize, dropout: f32) -> Option<AttentionShape> {
    let dtype = match qkv.dtype() {
        DType::BF16 => DataType::Bf16,
        DType::F16 => DataType::F16,
        _ => return None,
    };
    if !crate::gpu_kernels::cudnn_attention()
        || !matches!(qkv.device, burn_cubecl::CubeDevice::Cuda(_))
        || crate::recording::leaves_libraries_out(qkv.client.is_capturing())
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
        causal: true,
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
    forward_with(&plans.forward, qkv, seed, shape)
}

/// `x` with exactly the row-major strides of its shape (a copy where it has others). The
/// graphs read and write every buffer as densely packed; CubeCL's CUDA allocator pads the rows
/// of a new tensor (a cast's output, for one) to its pitch alignment where their width in bytes
/// is not a multiple of it, and cuDNN would then read the padding as values.
fn packed(x: &CubeTensor) -> CubeTensor {
    burn_cubecl::kernel::into_contiguous(x.clone())
}

/// Each of a graph's tensors: its uid, the tensor whose buffer holds it, its byte offset there.
type Bound = Vec<(Uid, CubeTensor, usize)>;

/// The forward graph's tensors for the contiguous projection `qkv`: the new output and
/// log-sum-exps, and every tensor of the graph bound (the dropout's seeds launched).
fn forward_bound(
    qkv: &CubeTensor,
    seed: &CubeTensor,
    shape: &AttentionShape,
) -> (CubeTensor, CubeTensor, Bound) {
    let (b, h, t, d) = dims(shape);
    let qkv = packed(qkv);
    let out = super::empty_of(&qkv, [b, t, d], qkv.dtype());
    let lse = super::empty(&qkv, [b, h, t]);
    let mut bound = vec![
        (uid::O, out.clone(), 0),
        (uid::Q, qkv.clone(), offset(shape, uid::Q, &qkv)),
        (uid::K, qkv.clone(), offset(shape, uid::K, &qkv)),
        (uid::V, qkv.clone(), offset(shape, uid::V, &qkv)),
        (uid::STATS, lse.clone(), 0),
    ];
    bound.extend(seeds_bound(seed, shape));
    (out, lse, bound)
}

/// The backward graph's tensors for the forward pass's projection, output and log-sum-exps and
/// the output's gradient: the new projection's gradient and every tensor of the graph bound.
fn backward_bound(
    [qkv, seed, out, lse, grad]: [&CubeTensor; 5],
    shape: &AttentionShape,
) -> (CubeTensor, Bound) {
    let (b, h, t, d) = dims(shape);
    let [qkv, out, lse, grad] = [qkv, out, lse, grad].map(packed);
    let dqkv = super::empty_of(&qkv, [b, t, 3 * d], qkv.dtype());
    let delta = super::empty(&qkv, [b, h, t]);
    let accumulator = super::empty(&qkv, [b, h, t, d / h]);
    let mut bound = vec![
        (uid::DQ, dqkv.clone(), offset(shape, uid::DQ, &qkv)),
        (uid::DK, dqkv.clone(), offset(shape, uid::DK, &qkv)),
        (uid::DV, dqkv.clone(), offset(shape, uid::DV, &qkv)),
        (uid::Q, qkv.clone(), offset(shape, uid::Q, &qkv)),
        (uid::K, qkv.clone(), offset(shape, uid::K, &qkv)),
        (uid::V, qkv.clone(), offset(shape, uid::V, &qkv)),
        (uid::O, out, 0),
        (uid::DO, grad, 0),
        (uid::STATS, lse, 0),
        (uid::DELTA, delta, 0),
        (uid::DQ_ACCUMULATOR, accumulator, 0),
    ];
    bound.extend(seeds_bound(seed, shape));
    (dqkv, bound)
}

/// The dropout's seed and offset bound, where the graph draws (launched from the op's seed).
fn seeds_bound(seed: &CubeTensor, shape: &AttentionShape) -> Bound {
    match shape.dropout > 0.0 || shape.rng {
        true => {
            let (s, o) = philox_seeds(seed);
            vec![(uid::SEED, s, 0), (uid::OFFSET, o, 0)]
        }
        false => Vec::new(),
    }
}

/// A new workspace of `bytes` for a plan, on `like`'s device.
fn workspace(like: &CubeTensor, bytes: usize) -> CubeTensor {
    super::empty(like, [bytes.div_ceil(4).max(1)])
}

/// [`forward`] through `plan` (one of the forward graph's plans for `shape`).
fn forward_with(
    plan: &Plan,
    qkv: &CubeTensor,
    seed: &CubeTensor,
    shape: &AttentionShape,
) -> Option<(CubeTensor, CubeTensor)> {
    let (out, lse, bound) = forward_bound(qkv, seed, shape);
    let workspace = workspace(qkv, plan.workspace);
    match execute(plan, "cudnnSdpaForward", &bound, &workspace, None) {
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
    let (dqkv, bound) = backward_bound([qkv, seed, out, lse, grad], shape);
    let workspace = workspace(qkv, plans.backward.workspace);
    let zero = accumulator_to_zero(shape);
    let plan = &plans.backward;
    match execute(plan, "cudnnSdpaBackward", &bound, &workspace, zero) {
        Ok(()) => Some(dqkv),
        Err(e) => {
            warn_once(&format!("the backward pass failed ({e})"));
            None
        }
    }
}

/// The queries' gradient accumulator (its `f32`s) to clear before a backward pass of `shape`,
/// where the loaded cuDNN does not clear it itself.
fn accumulator_to_zero(shape: &AttentionShape) -> Option<(Uid, usize)> {
    let (b, h, t, d) = dims(shape);
    (library::api().map_or(0, |a| a.version) < ZEROES_ITS_ACCUMULATOR)
        .then_some((uid::DQ_ACCUMULATOR, b * h * t * (d / h)))
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

/// Enqueues `plan` on the stream of the first bound tensor's buffer, each uid of the plan at
/// its tensor's buffer plus its byte offset, `workspace` as its work memory; with `zero`, that
/// uid's first `n` `f32`s are cleared first. Timed as one launch named `name` where a profiler
/// observes ([`crate::external_launches`]).
fn execute(
    plan: &Plan,
    name: &'static str,
    bound: &[(Uid, CubeTensor, usize)],
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
    let at: Vec<(Uid, u64)> = bound
        .iter()
        .zip(&resources)
        .map(|((uid, _, offset), r)| (*uid, r.resource().ptr + *offset as u64))
        .collect();
    let stream = resources[0].resource().stream;
    // SAFETY: the addresses are the live buffers held above, on the stream's device.
    unsafe { run(plan, name, &at, space.resource().ptr, zero, stream) }
}

/// `plan` enqueued on `stream` with each of its uids at its address in `at` and the workspace
/// at `workspace`, after clearing `zero`'s first `n` `f32`s: [`execute`]'s work once the
/// buffers are looked up.
///
/// # Safety
/// The addresses are live buffers on `stream`'s device (a CubeCL stream), each holding its
/// tensor's extent (the callers allocate them from the plan's shape), held until enqueued.
unsafe fn run(
    plan: &Plan,
    name: &'static str,
    at: &[(Uid, u64)],
    workspace: u64,
    zero: Option<(Uid, usize)>,
    stream: driver::CUstream,
) -> Result<(), CudnnError> {
    let address = |uid: Uid| -> Result<u64, CudnnError> {
        at.iter()
            .find(|(u, _)| *u == uid)
            .map(|(_, a)| *a)
            .ok_or_else(|| CudnnError(format!("no buffer for tensor {uid}")))
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
    // SAFETY: the caller's: live buffers on this CubeCL stream.
    let done = unsafe {
        with_stream_handle(stream, |handle, context| {
            if let Some((at, n)) = zero {
                driver::cuMemsetD32Async(at, 0, n, stream)
                    .result()
                    .map_err(|e| CudnnError(format!("clear the accumulator: {e:?}")))?;
            }
            let context = context as driver::CUcontext;
            crate::products::cublas::timed(name, stream, context, || {
                if synchronizes() {
                    driver::cuCtxSynchronize()
                        .result()
                        .map_err(|e| CudnnError(format!("synchronize: {e:?}")))?;
                }
                let ran = plan.execute(handle, &addresses, workspace);
                if synchronizes() {
                    driver::cuCtxSynchronize()
                        .result()
                        .map_err(|e| CudnnError(format!("synchronize: {e:?}")))?;
                }
                ran
            })
        })
    };
    done.unwrap_or_else(|| Err(CudnnError("no cuDNN handle for the device".into())))
}

/// Whether each cuDNN call waits for the device before and after it (`EMBER_CUDNN_SYNC=1`, for
/// diagnosing the order of cuDNN's work and CubeCL's: slower).
fn synchronizes() -> bool {
    static SYNC: OnceLock<bool> = OnceLock::new();
    *SYNC.get_or_init(|| std::env::var("EMBER_CUDNN_SYNC").is_ok_and(|v| v == "1"))
        || SYNCHRONIZING.load(std::sync::atomic::Ordering::Relaxed)
}

/// Set while the diagnostics wait for the device around each call (`check::dump_all`).
static SYNCHRONIZING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

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
