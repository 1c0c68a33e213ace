//! Matrix products through NVIDIA's cuBLAS on the CUDA backend (feature `cublas`): the products a
//! training step's linear layers make, forward and backward ([`crate::products::cube`]), and the
//! attention's per-head products as strided batched calls ([`crate::cube::attention_products`]).
//!
//! cubek's products, which Burn's `matmul` chooses by autotune, reached about 42 TFLOP/s in
//! nanoGPT's GPU config on an H200 where PyTorch's (cuBLAS) reached about 200
//! (docs/benchmarks.md). cuBLAS is part of the CUDA toolkit that the `cuda` device needs anyway,
//! and it is loaded at run time (`libcublas.so`, from the library path or the toolkit's
//! folders), so the binary builds and starts without it; where it is missing, or the device is
//! not CUDA, products stay cubek's.
//!
//! The call is enqueued on the CUDA stream that owns the output's memory, the stream CubeCL
//! launches this thread's kernels on (vendored cubecl-cuda exposes it: vendor/README.md), so it
//! runs after the kernels that wrote its operands and before those that read its result, and
//! the host never waits. Operands are read in place, transposed views included
//! ([`crate::blas`] maps the row-major product to BLAS's column-major call). `f32` products
//! run on TF32 tensor cores (`CUBLAS_COMPUTE_32F_FAST_TF32`: what cubek does for `f32` on CUDA,
//! and PyTorch with TF32 allowed); bf16 and f16 ones accumulate in `f32`.

use crate::blas::{Batched, Gemm, Layout};
use crate::recording::leaves_libraries_out;
use burn::backend::TensorMetadata;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl_common::device_handle::DeviceHandle;
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cubecl_runtime::server::ServerStorage;
use cudarc::cublas::{result as blas, sys};
use cudarc::driver::sys as driver;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::{CString, c_void};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// The CubeCL server of the CUDA runtime, whose buffers' resources carry their stream.
type CudaServer = <CudaRuntime as Runtime>::Server;

/// Whether the cuBLAS library can be loaded (looked for once).
pub(crate) fn loadable() -> bool {
    static LOADABLE: OnceLock<bool> = OnceLock::new();
    *LOADABLE.get_or_init(|| {
        preload_from_toolkit();
        // SAFETY: only tries to open the library, by the names cudarc loads it by.
        unsafe { sys::is_culib_present() }
    })
}

/// Opens `libcublasLt` and `libcublas` from the CUDA toolkit's library folders where they are
/// there, so that loading them by name (cudarc's way) finds them without `LD_LIBRARY_PATH`.
fn preload_from_toolkit() {
    let mut roots: Vec<std::path::PathBuf> = Vec::new();
    if let Some(path) = std::env::var_os("CUDA_PATH") {
        roots.push(path.into());
    }
    // Where the toolkit's libdevice is looked for too (README, "CUDA, built offline").
    roots.extend(["/usr/local/cuda", "/opt/cuda", "/usr/lib/cuda"].map(Into::into));
    for root in roots {
        for dir in ["lib64", "lib", "targets/x86_64-linux/lib"] {
            let dir = root.join(dir);
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            let mut names: Vec<String> = entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with("libcublas") && n.contains(".so"))
                .collect();
            // The Lt library first: the other one needs it.
            names.sort_by_key(|n| !n.starts_with("libcublasLt"));
            for name in names {
                let Ok(path) = CString::new(dir.join(name).into_os_string().into_encoded_bytes())
                else {
                    continue;
                };
                // SAFETY: dlopen of a path; a failure leaves nothing loaded.
                unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            }
        }
    }
}

/// A cuBLAS handle, created in one CUDA context and used under the lock of [`handles`], with the
/// workspace of each stream it has run on, given after each `cublasSetStream` (which resets it
/// to cuBLAS's own pool).
struct Handle(sys::cublasHandle_t, HashMap<usize, Workspace>);

/// Device memory of [`WORKSPACE_BYTES`] for one stream's products, allocated once (outside
/// CubeCL's pools) and never freed: with memory of its own cuBLAS allocates none as it runs,
/// which a recorded graph needs (CubeCL rejects a recording with a memory node, and cuBLAS
/// allocates its pool's workspace with `cudaMallocAsync` inside a capture). One per stream, as
/// two streams' products may run at once.
struct Workspace(driver::CUdeviceptr);

/// The workspace's size: cuBLAS's own default pool on Hopper (32 MiB; 4 MiB on earlier GPUs).
const WORKSPACE_BYTES: usize = 32 << 20;

impl Workspace {
    /// A new workspace in the current context, or `None` (cuBLAS then keeps its own pool).
    fn new() -> Option<Self> {
        let mut ptr = 0;
        // SAFETY: allocates in the context the caller made current.
        unsafe { driver::cuMemAlloc_v2(&mut ptr, WORKSPACE_BYTES) }
            .result()
            .ok()?;
        Some(Self(ptr))
    }

    /// Gives `handle` this workspace (after `cublasSetStream`, which takes it back); where cuBLAS
    /// refuses, it keeps its own pool (the products run, a recording of them may be refused).
    ///
    /// # Safety
    /// `handle` is a live handle of the workspace's context.
    unsafe fn give(&self, handle: sys::cublasHandle_t) {
        // SAFETY: the memory is live for the process (never freed) and of the size given.
        let _ = unsafe {
            sys::cublasSetWorkspace_v2(handle, self.0 as *mut std::ffi::c_void, WORKSPACE_BYTES)
        };
    }
}

// SAFETY: a handle is only used while [`handles`]' lock is held, by one thread at a time.
unsafe impl Send for Handle {}

/// One handle per CUDA context (per device), by the context's address.
fn handles() -> &'static Mutex<HashMap<usize, Handle>> {
    static HANDLES: OnceLock<Mutex<HashMap<usize, Handle>>> = OnceLock::new();
    HANDLES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The cuBLAS type of a tensor's float type, and the compute type its products use.
fn types(dtype: DType) -> Option<(sys::cudaDataType, sys::cublasComputeType_t)> {
    use sys::cublasComputeType_t::{CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32};
    use sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
    match dtype {
        DType::F32 => Some((CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32)),
        DType::BF16 => Some((CUDA_R_16BF, CUBLAS_COMPUTE_32F)),
        DType::F16 => Some((CUDA_R_16F, CUBLAS_COMPUTE_32F)),
        _ => None,
    }
}

/// The layout of a 2-D tensor's buffer, or `None` (tiled storage, or strides of neither kind).
fn layout(x: &CubeTensor) -> Option<Layout> {
    if x.meta.tiling.is_tiled() {
        return None;
    }
    let [rows, cols] = x.shape().dims::<2>();
    let strides = x.meta.strides.as_ref();
    Layout::of([rows, cols], [strides[0], strides[1]])
}

/// `a @ b` (`[M, K] @ [K, N]`, one float type) by cuBLAS into a new contiguous `[M, N]` tensor
/// of type `out` (theirs, or `f32` for bf16 and f16 operands: the `f32` accumulators written
/// as they are, where a product in their type and a cast would round them and launch once
/// more), or `None` where cuBLAS does not take it: not a CUDA device, no cuBLAS, a type it is
/// not used for, operands of neither layout, dimensions past `i32`, or a graph being recorded
/// that leaves libraries out (a replayed decoding step's: [`crate::recording`]).
pub(crate) fn product(a: &CubeTensor, b: &CubeTensor, out: DType) -> Option<CubeTensor> {
    let dtype = a.dtype();
    let (data_type, compute) = types(dtype)?;
    let (out_type, _) = types(out)?;
    let out_taken = out == dtype || out == DType::F32;
    if b.dtype() != dtype
        || !out_taken
        || !loadable()
        || leaves_libraries_out(a.client.is_capturing())
    {
        return None;
    }
    let [m, k] = a.shape().dims::<2>();
    let [_, n] = b.shape().dims::<2>();
    let call = Gemm::row_major(m, k, n, layout(a)?, layout(b)?);
    let dims = [
        call.m,
        call.n,
        call.k,
        call.ld_first,
        call.ld_second,
        call.ldc,
    ];
    if dims.iter().any(|&d| i32::try_from(d).is_err()) {
        return None;
    }
    let [cm, cn, ck, lda, ldb, ldc] = dims.map(|d| d as i32);
    let out = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        a.client.clone(),
        a.device.clone(),
        [m, n].into(),
        out,
    );
    if m == 0 || n == 0 {
        return Some(out);
    }
    let (alpha, beta) = (1f32, 0f32);
    let gemm = move |handle, [c, a, b]: [u64; 3]| {
        // SAFETY (the caller's): the pointers are the operands' live buffers, of their extents.
        unsafe {
            blas::gemm_ex(
                handle,
                op(call.transpose_first),
                op(call.transpose_second),
                cm,
                cn,
                ck,
                &alpha as *const f32 as *const c_void,
                b as *const c_void,
                data_type,
                lda,
                a as *const c_void,
                data_type,
                ldb,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                out_type,
                ldc,
                compute,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .is_ok()
    };
    let done = match asynchronous(&out) {
        Some(device) => enqueue_async(device, "cublasGemmEx", &out, [a, b], gemm),
        None => enqueue("cublasGemmEx", &out, [a, b], gemm),
    };
    done.then_some(out)
}

/// `call` (its matrices in the buffers of `a`, `b` and `c`, in that order) with `alpha`, one
/// `cublasGemmStridedBatchedEx` enqueued as [`product`]'s call is: `a` and `b` of one type, `c`
/// of theirs or `f32` (`f32` products on TF32 tensor cores, as [`product`]'s; bf16 and f16 ones
/// accumulated in `f32` and rounded once to `c`'s type); false where cuBLAS does not take it (as
/// for [`product`]: not CUDA, no cuBLAS, other types, a graph being recorded, a size past
/// `i32`), and then nothing was written. The caller owns `c`'s buffer (nothing else reads it
/// meanwhile) and every matrix of the batch lies inside its tensor's buffer.
pub(crate) fn batched_product(call: &Batched, [a, b, c]: [&CubeTensor; 3], alpha: f32) -> bool {
    let (Some((ab_type, compute)), Some((c_type, _))) = (types(a.dtype()), types(c.dtype())) else {
        return false;
    };
    let taken = b.dtype() == a.dtype() && (c.dtype() == a.dtype() || c.dtype() == DType::F32);
    if !taken || !loadable() || leaves_libraries_out(a.client.is_capturing()) {
        return false;
    }
    let g = call.gemm;
    let dims = [g.m, g.n, g.k, g.ld_first, g.ld_second, g.ldc, call.batch];
    if dims.iter().any(|&d| i32::try_from(d).is_err()) {
        return false;
    }
    let [cm, cn, ck, lda, ldb, ldc, count] = dims.map(|d| d as i32);
    if g.m == 0 || g.n == 0 || call.batch == 0 {
        return true;
    }
    let strides = [call.b.stride, call.a.stride, call.c.stride].map(|s| s as i64);
    let bytes = |x: &CubeTensor, offset: usize| (offset * x.dtype().size()) as u64;
    let offsets = [
        bytes(c, call.c.offset),
        bytes(a, call.a.offset),
        bytes(b, call.b.offset),
    ];
    let beta = 0f32;
    enqueue(
        "cublasGemmStridedBatchedEx",
        c,
        [a, b],
        |handle, [pc, pa, pb]| {
            let [pc, pa, pb] = [pc + offsets[0], pa + offsets[1], pb + offsets[2]];
            // SAFETY (the caller's): every matrix of the batch lies inside its tensor's buffer.
            unsafe {
                blas::gemm_strided_batched_ex(
                    handle,
                    op(g.transpose_first),
                    op(g.transpose_second),
                    cm,
                    cn,
                    ck,
                    &alpha as *const f32 as *const c_void,
                    pb as *const c_void,
                    ab_type,
                    lda,
                    strides[0],
                    pa as *const c_void,
                    ab_type,
                    ldb,
                    strides[1],
                    &beta as *const f32 as *const c_void,
                    pc as *mut c_void,
                    c_type,
                    ldc,
                    strides[2],
                    count,
                    compute,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .is_ok()
        },
    )
}

/// cuBLAS's `transa` / `transb` for an operand read transposed or not.
fn op(transposed: bool) -> sys::cublasOperation_t {
    match transposed {
        true => sys::cublasOperation_t::CUBLAS_OP_T,
        false => sys::cublasOperation_t::CUBLAS_OP_N,
    }
}

/// Runs `call` with this context's cuBLAS handle, set to the CUDA stream of `out`'s buffer,
/// and the device addresses of `out`'s and `inputs`' buffers; false where the buffers are not
/// CUDA's, the driver refuses, or `call` does. With [`crate::external_launches`] observing,
/// the call is timed on the stream as one launch named `name`.
///
/// It runs on CubeCL's device thread, in one blocking round trip: the kernels launched before
/// it (queued for that thread) are on the stream first, so the call runs after them in the
/// stream's order, and the three buffers' lookups run there at once (each is a blocking round
/// trip of its own from another thread). Called on the device thread itself (the attention's
/// passes run there whole), it runs at once.
fn enqueue(
    name: &'static str,
    out: &CubeTensor,
    inputs: [&CubeTensor; 2],
    call: impl FnOnce(sys::cublasHandle_t, [u64; 3]) -> bool + Send,
) -> bool {
    // Where the device thread cannot be taken, the call runs on this thread, each lookup a
    // round trip.
    crate::cube::on_device_thread(&out.client, || enqueue_here(name, out, inputs, call))
        .unwrap_or(false)
}

/// The device thread a call writing `out` (a cuBLAS product, cuDNN's attention) is handed to
/// without waiting for it, where it is: `async-products` on, called from outside a
/// device-thread task (whose client calls run at once: work queued for later would run after
/// the task's next launches), a CUDA server.
pub(crate) fn asynchronous(out: &CubeTensor) -> Option<DeviceHandle<CudaServer>> {
    let applies = crate::gpu_kernels::applies(crate::GpuStrategy::AsyncProducts)
        && !crate::cube::inside_device_task();
    applies.then(|| device_handle(out)).flatten()
}

/// Each device's handle to its CUDA server's thread.
type DeviceHandles = Vec<(cubecl_common::device::DeviceId, DeviceHandle<CudaServer>)>;

/// The handle to the device thread of `x`'s CUDA server (kept per device).
fn device_handle(x: &CubeTensor) -> Option<DeviceHandle<CudaServer>> {
    static HANDLES: OnceLock<Mutex<DeviceHandles>> = OnceLock::new();
    let service = x.client.service_id();
    if service.service != std::any::TypeId::of::<CudaServer>() {
        return None;
    }
    let mut handles = HANDLES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some((_, handle)) = handles.iter().find(|(id, _)| *id == service.device) {
        return Some(handle.clone());
    }
    let handle = DeviceHandle::<CudaServer>::new(service.device);
    handles.push((service.device, handle.clone()));
    Some(handle)
}

/// [`enqueue`] handed to `device`'s thread ([`submit_without_waiting`]), which runs it after
/// the work queued before it (the kernels that write its operands) and before the work queued
/// after it, while this thread goes on: true once handed over. Where cuBLAS or the driver then
/// refuses it, the output is filled with NaN (`-async-products` makes every call wait for its
/// answer, with cubek's products to fall back on).
fn enqueue_async(
    device: DeviceHandle<CudaServer>,
    name: &'static str,
    out: &CubeTensor,
    inputs: [&CubeTensor; 2],
    call: impl FnOnce(sys::cublasHandle_t, [u64; 3]) -> bool + Send + 'static,
) -> bool {
    let buffers = vec![out.clone(), inputs[0].clone(), inputs[1].clone()];
    let fallback = "cubek's products";
    submit_without_waiting(
        device,
        name,
        fallback,
        buffers,
        vec![0],
        move |at, stream| {
            // SAFETY: the buffers are live (held by the task), on the stream's device.
            match unsafe { call_on(name, stream, [at[0], at[1], at[2]], call) } {
                true => Ok(()),
                false => Err("cuBLAS refused it".into()),
            }
        },
    );
    true
}

/// `work` handed to `device`'s thread without waiting for it: run there after the work queued
/// before it, with the addresses of `buffers`' memory and their stream (the buffers held until
/// it returns). A call handed over cannot fall back any more: where a buffer cannot be looked
/// up or `work` fails, one line says so (once; `fallback` is what `-async-products`, which makes
/// each call wait, falls back to) and the buffers at `outputs` (indices into `buffers`) are
/// filled with NaN, so that the run stops at its next check of the loss instead of training on
/// garbage (or, inside a graph recording, so that the recording's check refuses it).
pub(crate) fn submit_without_waiting(
    device: DeviceHandle<CudaServer>,
    name: &'static str,
    fallback: &'static str,
    buffers: Vec<CubeTensor>,
    outputs: Vec<usize>,
    work: impl FnOnce(&[u64], driver::CUstream) -> Result<(), String> + Send + 'static,
) {
    let recording = buffers.first().is_some_and(|x| x.client.is_capturing());
    device.submit(move |server: &mut CudaServer| {
        let stream = cubecl_environment::stream::StreamId::current();
        let resources = buffers
            .iter()
            .map(|x| {
                let binding = x.handle.clone().binding();
                <CudaServer as ServerStorage>::get_resource(server, binding, stream).ok()
            })
            .collect::<Option<Vec<_>>>();
        let Some(resources) = resources else {
            let why = "its buffers could not be looked up";
            poisoned(name, &[], why, fallback, recording);
            return;
        };
        let at: Vec<u64> = resources.iter().map(|r| r.resource().ptr).collect();
        let stream = resources[0].resource().stream;
        if let Err(why) = work(&at, stream) {
            let outputs: Vec<Output> = outputs
                .iter()
                .map(|&i| {
                    let x = &buffers[i];
                    let bytes = x.shape().num_elements() * x.dtype().size();
                    (stream, at[i], bytes, x.dtype())
                })
                .collect();
            poisoned(name, &outputs, &why, fallback, recording);
        }
    });
}

/// An output of a call made without waiting: its stream, address, bytes and type.
type Output = (driver::CUstream, u64, usize, DType);

/// Says once that a call made without waiting (`name`) failed, and why, and fills its
/// `outputs` with NaN; `fallback` is what the call falls back to when it waits
/// (`-async-products`). A call `recording` into a graph (an evaluation's pass) is said apart:
/// the recording's check sees the NaN and its passes run one by one, so the run goes on.
fn poisoned(name: &str, outputs: &[Output], why: &str, fallback: &str, recording: bool) {
    static SAID: std::sync::Once = std::sync::Once::new();
    static SAID_RECORDING: std::sync::Once = std::sync::Once::new();
    if recording {
        crate::recording::call_failed_in_recording();
        SAID_RECORDING.call_once(|| {
            eprintln!(
                "warning: a {name} call recorded into a graph failed ({why}); the recording is \
                 not used, its passes run one by one"
            )
        });
    } else {
        let outcome = match outputs.is_empty() {
            true => {
                "its output is left unwritten (its buffers could not be found to fill with NaN)"
            }
            false => "its output is NaN, so the run stops at its next check",
        };
        SAID.call_once(|| {
            eprintln!(
                "error: a {name} call enqueued without waiting failed ({why}); {outcome}; \
                 EMBER_GPU_KERNELS=-async-products makes each call wait and fall back to {fallback}"
            )
        });
    }
    for &(stream, ptr, bytes, dtype) in outputs {
        // SAFETY: `ptr` is a live buffer of `bytes` bytes on `stream`'s device.
        unsafe {
            let _ = match dtype {
                DType::F32 => driver::cuMemsetD32Async(ptr, 0x7fc0_0000, bytes / 4, stream),
                DType::BF16 => driver::cuMemsetD16Async(ptr, 0x7fc0, bytes / 2, stream),
                _ => driver::cuMemsetD16Async(ptr, 0x7e00, bytes / 2, stream),
            };
        }
    }
}

/// `call` with this context's cuBLAS handle set to `stream`, on the buffers at `pointers`
/// (output first), timed as [`enqueue_here`] times it.
///
/// # Safety
/// The pointers are live buffers on `stream`'s device, held until the call is enqueued.
unsafe fn call_on(
    name: &'static str,
    stream: driver::CUstream,
    pointers: [u64; 3],
    call: impl FnOnce(sys::cublasHandle_t, [u64; 3]) -> bool,
) -> bool {
    let mut handles = handles().lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: the stream is CubeCL's; its context is made current first.
    unsafe {
        let mut context = std::ptr::null_mut();
        let known = driver::cuStreamGetCtx(stream, &mut context)
            .result()
            .is_ok()
            && driver::cuCtxSetCurrent(context).result().is_ok();
        if !known {
            return false;
        }
        let Handle(handle, workspaces) = match handles.entry(context as usize) {
            Entry::Occupied(known) => known.into_mut(),
            Entry::Vacant(new) => {
                let Ok(handle) = blas::create_handle() else {
                    return false;
                };
                new.insert(Handle(handle, HashMap::new()))
            }
        };
        let handle = *handle;
        if !workspaces.contains_key(&(stream as usize))
            && let Some(workspace) = Workspace::new()
        {
            workspaces.insert(stream as usize, workspace);
        }
        let workspace = workspaces.get(&(stream as usize));
        timed(name, stream, context, || {
            if blas::set_stream(handle, stream as sys::cudaStream_t).is_err() {
                return false;
            }
            // Without a workspace of its own (none could be allocated) cuBLAS keeps its pool.
            if let Some(workspace) = workspace {
                workspace.give(handle);
            }
            call(handle, pointers)
        })
    }
}

/// [`enqueue`] on the calling thread.
fn enqueue_here(
    name: &'static str,
    out: &CubeTensor,
    inputs: [&CubeTensor; 2],
    call: impl FnOnce(sys::cublasHandle_t, [u64; 3]) -> bool,
) -> bool {
    // Resources keep their buffers in place until dropped, after the call is enqueued.
    let client = &out.client;
    let resource = |x: &CubeTensor| client.get_resource::<CudaServer>(x.handle.clone()).ok();
    let (Some(c_res), Some(a_res), Some(b_res)) =
        (resource(out), resource(inputs[0]), resource(inputs[1]))
    else {
        return false;
    };
    let stream = c_res.resource().stream;
    let pointers = [
        c_res.resource().ptr,
        a_res.resource().ptr,
        b_res.resource().ptr,
    ];
    // SAFETY: the pointers are live device buffers (held above), the stream is CubeCL's.
    unsafe { call_on(name, stream, pointers, call) }
}

/// `work` (which enqueues on `stream`, in `context`, made current) timed on the stream as one
/// launch named `name` where a profiler observes ([`crate::external_launches`]): cuBLAS's,
/// cuDNN's and NCCL's calls, which CubeCL does not see.
///
/// # Safety
/// `stream` is a live stream of `context`, which is current on this thread.
pub(crate) unsafe fn timed<R>(
    name: &'static str,
    stream: driver::CUstream,
    context: driver::CUcontext,
    work: impl FnOnce() -> R,
) -> R {
    // SAFETY (the caller's): the stream is live and its context current.
    let timing = crate::external_launches::observer()
        .and_then(|observer| Some((observer, unsafe { event_on(stream) }?)));
    let done = work();
    if let Some((observer, start)) = timing
        // SAFETY: as above.
        && let Some(end) = unsafe { event_on(stream) }
    {
        observer.launched(name, elapsed_between(context, start, end));
    }
    done
}

/// A CUDA event recorded on `stream` now, or `None` where the driver refuses (the context is
/// current).
pub(crate) unsafe fn event_on(stream: driver::CUstream) -> Option<Event> {
    let mut event = std::ptr::null_mut();
    // SAFETY: the caller made the stream's context current; the event is destroyed by `Event`.
    unsafe {
        driver::cuEventCreate(&mut event, 0).result().ok()?;
        let event = Event(event);
        driver::cuEventRecord(event.0, stream).result().ok()?;
        Some(event)
    }
}

/// A CUDA event, destroyed when dropped.
pub(crate) struct Event(driver::CUevent);

// SAFETY: an event is a handle the driver lets any thread use, in its context (made current).
unsafe impl Send for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `event_on`, destroyed once.
        unsafe {
            let _ = driver::cuEventDestroy_v2(self.0);
        }
    }
}

/// Reads the device time between `start` and `end` (in `context`) once the device has run
/// what lies between them.
pub(crate) fn elapsed_between(
    context: driver::CUcontext,
    start: Event,
    end: Event,
) -> crate::external_launches::Elapsed {
    let context = context as usize;
    Box::new(move || {
        // The events whole (a closure would capture only their pointers, which are not `Send`),
        // destroyed when it returns.
        let (start, end) = (start, end);
        let mut ms = 0f32;
        // SAFETY: both events were recorded in `context`, made current on this thread first.
        unsafe {
            driver::cuCtxSetCurrent(context as driver::CUcontext)
                .result()
                .ok()?;
            driver::cuEventSynchronize(end.0).result().ok()?;
            driver::cuEventElapsedTime_v2(&mut ms, start.0, end.0)
                .result()
                .ok()?;
        }
        Some(Duration::from_secs_f64(f64::from(ms) / 1000.0))
    })
}
