//! Collectives across processes on CUDA devices through NVIDIA's NCCL (feature `nccl`): the sum
//! of a flattened `f32` buffer over every rank (a data-parallel step's gradients) and a copy of
//! rank 0's buffer to every rank, as `torch.distributed` runs them under `torchrun`.
//!
//! Each call is enqueued on the CUDA stream that owns the buffer's memory (the stream CubeCL
//! launches this thread's kernels on, as for cuBLAS: [`crate::products::cublas`]), from
//! CubeCL's device thread, so it runs after the backward pass's kernels and before the
//! optimizer's, and the host does not wait for it. The result is written in place into a
//! packed copy of the input (the input itself where it is already packed and not shared).
//! NCCL is loaded at run time ([`library`]).

mod library;

use burn::backend::{BackendTensor, DispatchAutodiffContext, DispatchTensor, DispatchTensorKind};
use burn::tensor::{DType, Tensor};
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::sys as driver;
use std::ffi::c_void;

/// The CubeCL server of the CUDA runtime, whose buffers' resources carry their stream.
type CudaServer = <CudaRuntime as Runtime>::Server;

/// The 128 bytes naming one communicator, made by rank 0 ([`unique_id`]) and handed to every
/// rank before it joins ([`Communicator::join`]).
pub type UniqueId = [u8; 128];

/// The NCCL library loaded, its version and where it came from (`2.21.5 from ...`), or why it
/// could not be.
pub fn describe() -> Result<String, String> {
    let api = library::api()?;
    Ok(format!(
        "NCCL {} from {}",
        crate::libraries::version_name(api.version as u64),
        api.folder
    ))
}

/// A new communicator's id (rank 0 makes it).
pub fn unique_id() -> Result<UniqueId, String> {
    let api = library::api()?;
    let mut raw = library::RawId { internal: [0; 128] };
    // SAFETY: NCCL writes the 128 bytes of `raw`.
    let status = unsafe { (api.get_unique_id)(&mut raw) };
    check(api, status, "ncclGetUniqueId")?;
    Ok(raw.internal.map(|c| c as u8))
}

/// One rank's membership of a communicator over `world` ranks, on one CUDA device.
pub struct Communicator {
    comm: library::RawComm,
    context: usize,
}

// SAFETY: NCCL allows a communicator's calls from any thread, one at a time; every call here
// holds `&self` on CubeCL's device thread or the thread that owns the value.
unsafe impl Send for Communicator {}
unsafe impl Sync for Communicator {}

impl Communicator {
    /// Joins the communicator `id` as `rank` of `world`, on the CUDA device of `like` (a tensor
    /// there). Blocks until every rank has joined (NCCL's own rendezvous through `id`).
    pub fn join(
        id: &UniqueId,
        world: usize,
        rank: usize,
        like: &Tensor<1>,
    ) -> Result<Self, String> {
        let api = library::api()?;
        let like = cube_tensor(like.clone())?;
        let client = like.client.clone();
        let context = crate::cube::on_device_thread(&client, move || {
            let resource = like
                .client
                .get_resource::<CudaServer>(like.handle.clone())
                .ok()?;
            let mut context = std::ptr::null_mut();
            // SAFETY: asks the driver for a live stream's context.
            unsafe { driver::cuStreamGetCtx(resource.resource().stream, &mut context) }
                .result()
                .ok()?;
            Some(context as usize)
        })
        .flatten()
        .ok_or("the tensor's buffer is not CUDA's")?;
        let raw = library::RawId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm = std::ptr::null_mut();
        // SAFETY: the context is CubeCL's (the device's primary context), made current on this
        // thread for NCCL; `comm` receives the new communicator.
        unsafe {
            driver::cuCtxSetCurrent(context as driver::CUcontext)
                .result()
                .map_err(|e| format!("make the CUDA context current: {e:?}"))?;
            let status = (api.comm_init_rank)(&mut comm, world as i32, raw, rank as i32);
            check(api, status, "ncclCommInitRank")?;
        }
        Ok(Self { comm, context })
    }

    /// The sum over every rank of `x` (`f32`, on this rank's device, not tracked by autodiff),
    /// on every rank.
    pub fn all_reduce_sum(&self, x: Tensor<1>) -> Result<Tensor<1>, String> {
        let mut out = self.all_reduce_sum_each(vec![x])?;
        Ok(out.remove(0))
    }

    /// [`Communicator::all_reduce_sum`] of each of `xs`, in one NCCL group (which NCCL runs as
    /// one collective): a step's gradients summed where they lie, without packing them into
    /// one buffer first. Each result is `xs`' own buffer where nothing else holds it.
    pub fn all_reduce_sum_each(&self, xs: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, String> {
        let comm = self.comm as usize;
        self.in_place(xs, "ncclAllReduce", move |api, ptr, n, stream| unsafe {
            (api.all_reduce)(
                ptr as *const c_void,
                ptr as *mut c_void,
                n,
                library::FLOAT32,
                library::SUM,
                comm as library::RawComm,
                stream,
            )
        })
    }

    /// Rank `root`'s `x` on every rank (`f32`, of one length everywhere).
    pub fn broadcast(&self, x: Tensor<1>, root: usize) -> Result<Tensor<1>, String> {
        let comm = self.comm as usize;
        let mut out = self.in_place(
            vec![x],
            "ncclBroadcast",
            move |api, ptr, n, stream| unsafe {
                (api.broadcast)(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    n,
                    library::FLOAT32,
                    root as i32,
                    comm as library::RawComm,
                    stream,
                )
            },
        )?;
        Ok(out.remove(0))
    }

    /// `call` (with NCCL, a buffer's address, its length and its stream) on each of `xs` (each
    /// made a packed buffer of its own first), in one NCCL group, enqueued on CubeCL's device
    /// thread; timed as one launch named `name` where a profiler observes
    /// ([`crate::external_launches`]).
    fn in_place(
        &self,
        xs: Vec<Tensor<1>>,
        name: &'static str,
        call: impl Fn(&library::Api, u64, usize, *mut c_void) -> library::Status + Send,
    ) -> Result<Vec<Tensor<1>>, String> {
        let api = library::api()?;
        if xs.is_empty() {
            return Ok(Vec::new());
        }
        // Packed buffers of their own: the collective writes into them.
        let mut buffers = Vec::with_capacity(xs.len());
        for x in xs {
            if x.dtype() != DType::F32 {
                return Err(format!("{name} takes f32 buffers, not {:?}", x.dtype()));
            }
            buffers.push(match cube_tensor(x)? {
                t if t.can_mut() && t.is_contiguous() => t,
                other => cube_tensor(plain(other) + 0.0)?,
            });
        }
        let client = buffers[0].client.clone();
        let held = buffers.clone();
        let context = self.context;
        let done = crate::cube::on_device_thread(&client, move || -> Result<(), String> {
            // Resources keep their buffers in place until dropped, after the group is enqueued.
            let resources = held
                .iter()
                .map(|x| x.client.get_resource::<CudaServer>(x.handle.clone()).ok())
                .collect::<Option<Vec<_>>>()
                .ok_or("a buffer is not CUDA's")?;
            let stream = resources[0].resource().stream;
            // SAFETY: every buffer is live (its resource held) and as long as its tensor, on the
            // stream's device, whose context is made current first.
            unsafe {
                driver::cuCtxSetCurrent(context as driver::CUcontext)
                    .result()
                    .map_err(|e| format!("make the CUDA context current: {e:?}"))?;
                let (status, ended) = crate::products::cublas::timed(
                    name,
                    stream,
                    context as driver::CUcontext,
                    || {
                        if let Err(e) = check(api, (api.group_start)(), "ncclGroupStart") {
                            return (Err(e), 0);
                        }
                        let mut status = Ok(());
                        for (x, resource) in held.iter().zip(&resources) {
                            let n = x.meta.shape.num_elements();
                            let code = call(api, resource.resource().ptr, n, stream as *mut c_void);
                            status = check(api, code, name);
                            if status.is_err() {
                                break;
                            }
                        }
                        (status, (api.group_end)())
                    },
                );
                status?;
                check(api, ended, "ncclGroupEnd")
            }
        });
        done.ok_or_else(|| format!("{name} failed on the device thread"))??;
        Ok(buffers.into_iter().map(plain).collect())
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if let Ok(api) = library::api() {
            // SAFETY: created by `join`, destroyed once.
            unsafe {
                let _ = driver::cuCtxSetCurrent(self.context as driver::CUcontext);
                let _ = (api.comm_destroy)(self.comm);
            }
        }
    }
}

/// `x` as a plain tensor (not tracked by autodiff).
fn plain(x: CubeTensor) -> Tensor<1> {
    Tensor::from_dispatch(DispatchTensor {
        kind: DispatchTensorKind::Cube(BackendTensor::Float(x)),
        autodiff: DispatchAutodiffContext::Disabled,
    })
}

/// The CUDA tensor behind `x`, or why it is not one (tracked by autodiff, fused, not CubeCL's).
fn cube_tensor(x: Tensor<1>) -> Result<CubeTensor, String> {
    match x.into_dispatch() {
        DispatchTensor {
            kind: DispatchTensorKind::Cube(BackendTensor::Float(t)),
            autodiff: DispatchAutodiffContext::Disabled,
        } if matches!(t.device, burn_cubecl::CubeDevice::Cuda(_)) => Ok(t),
        _ => Err("NCCL takes plain f32 tensors on CUDA devices".into()),
    }
}

/// `Ok` for NCCL's success, else the call's name and NCCL's words.
fn check(api: &library::Api, status: library::Status, call: &str) -> Result<(), String> {
    match status {
        0 => Ok(()),
        s => Err(format!("{call}: {}", library::describe(api, s))),
    }
}
