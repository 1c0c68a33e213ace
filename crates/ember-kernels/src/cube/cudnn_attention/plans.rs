//! cuDNN's execution plans for the attention's graphs, built once per CUDA context and shape
//! and kept, and the cuDNN handle of each context.

use super::{CudaServer, warn_once};
use crate::cudnn::attention_graph::{AttentionShape, backward_graph, forward_graph};
use crate::cudnn::graph::DataType;
use crate::cudnn::library;
use crate::cudnn::lowering::{self, CudnnError, Plan};
use burn_cubecl::tensor::CubeTensor;
use cudarc::cudnn::sys as dnn;
use cudarc::driver::sys as driver;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A device's plans for one shape.
pub(super) struct Plans {
    pub(super) forward: Plan,
    pub(super) backward: Plan,
}

/// What a pair of plans is built for: the device (CubeCL keeps one CUDA context per device)
/// and the shape (the dropout by its bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    device: cubecl_common::device::DeviceId,
    dims: [i64; 4],
    dtype: DataType,
    dropout: u32,
    rng: bool,
    causal: bool,
}

impl Key {
    fn of(like: &CubeTensor, shape: &AttentionShape) -> Self {
        Key {
            device: like.client.service_id().device,
            dims: [shape.b, shape.h, shape.t, shape.k],
            dtype: shape.dtype,
            dropout: shape.dropout.to_bits(),
            rng: shape.rng,
            causal: shape.causal,
        }
    }
}

/// The plans of each device and shape: `None` where cuDNN refused one of the graphs.
fn cache() -> &'static Mutex<HashMap<Key, Option<Arc<Plans>>>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Option<Arc<Plans>>>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// `shape`'s plans on `like`'s device, built on first use (both passes: a forward pass cuDNN
/// takes always has its backward pass); `None` where cuDNN refuses either graph (said once).
pub(super) fn plans_for(like: &CubeTensor, shape: &AttentionShape) -> Option<Arc<Plans>> {
    let key = Key::of(like, shape);
    if let Some(found) = cache().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return found.clone();
    }
    let on = with_handle(like, |handle, _| {
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

/// `shape`'s plans on `like`'s device where [`plans_for`] has built them, without building or
/// looking up anything on the device: what a pass handed over without waiting takes
/// ([`super::without_waiting`]).
pub(super) fn built_plans(like: &CubeTensor, shape: &AttentionShape) -> Option<Arc<Plans>> {
    let cache = cache().lock().unwrap_or_else(|e| e.into_inner());
    cache.get(&Key::of(like, shape)).cloned().flatten()
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
pub(super) fn with_handle<R>(
    like: &CubeTensor,
    f: impl FnOnce(dnn::cudnnHandle_t, usize) -> R,
) -> Option<R> {
    let resource = like
        .client
        .get_resource::<CudaServer>(like.handle.clone())
        .ok()?;
    // SAFETY: the stream is CubeCL's.
    unsafe { with_stream_handle(resource.resource().stream, f) }
}

/// [`with_handle`] for the context of `stream`, set as the handle's stream.
///
/// # Safety
/// `stream` is a live CUDA stream (CubeCL's).
pub(super) unsafe fn with_stream_handle<R>(
    stream: driver::CUstream,
    f: impl FnOnce(dnn::cudnnHandle_t, usize) -> R,
) -> Option<R> {
    let api = library::api().ok()?;
    let mut handles = handles().lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: the stream is CubeCL's (the caller's); its context is made current before cuDNN
    // is called.
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
