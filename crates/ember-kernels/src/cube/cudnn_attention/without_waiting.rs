//! cuDNN's attention passes handed to CubeCL's device thread without waiting for it
//! (`async-products`, as cuBLAS's products are): the caller allocates the outputs, launches the
//! dropout's seeds and goes on; the device thread looks the buffers up and enqueues the plan
//! behind the kernels queued before it. Each pass through [`super::forward`] or
//! [`super::backward`] is a blocking round trip into that thread instead (12 a step of nanoGPT's
//! GPU config in bf16, 24 of GPT-2's body), which keeps the host from running ahead.
//!
//! Only shapes whose plans are already built on the device are taken (the first pass of each
//! shape waits, builds them and runs the start-up check), and never while each call waits for
//! the device (`EMBER_CUDNN_SYNC=1`). A call refused on the device thread cannot fall back any
//! more: its outputs are filled with NaN and one line says why, so the run stops at its next
//! check of the loss ([`crate::products::cublas::poisoned`]).

use super::{
    Bound, CudaServer, Plans, accumulator_to_zero, backward_bound, forward_bound, run,
    synchronizes, workspace,
};
use crate::cudnn::attention_graph::{AttentionShape, uid};
use crate::cudnn::graph::Uid;
use crate::products::cublas::{Output, asynchronous, poisoned};
use burn::backend::TensorMetadata;
use burn_cubecl::tensor::CubeTensor;
use cubecl_common::device_handle::DeviceHandle;
use cubecl_runtime::server::ServerStorage;
use std::sync::Arc;

/// What a pass refused without waiting would have fallen back to.
const FALLBACK: &str = "ember's own attention";

/// [`super::forward`] without waiting, where it applies: the output and the log-sum-exps,
/// written once the device thread reaches the call; `None` where it does not apply (nothing
/// was done).
pub(crate) fn forward(
    qkv: &CubeTensor,
    seed: &CubeTensor,
    shape: &AttentionShape,
) -> Option<(CubeTensor, CubeTensor)> {
    let (device, plans) = applies(qkv, shape)?;
    let (out, lse, bound) = forward_bound(qkv, seed, shape);
    let call = Call {
        name: "cudnnSdpaForward",
        workspace: workspace(qkv, plans.forward.workspace),
        plans,
        backward: false,
        bound,
        zero: None,
        outputs: vec![uid::O, uid::STATS],
    };
    call.submit(device);
    Some((out, lse))
}

/// [`super::backward`] without waiting, where it applies: the projection's gradient, written
/// once the device thread reaches the call; `None` where it does not apply.
pub(crate) fn backward(
    qkv: &CubeTensor,
    seed: &CubeTensor,
    out: &CubeTensor,
    lse: &CubeTensor,
    grad: &CubeTensor,
    shape: &AttentionShape,
) -> Option<CubeTensor> {
    let (device, plans) = applies(qkv, shape)?;
    let (dqkv, bound) = backward_bound([qkv, seed, out, lse, grad], shape);
    let call = Call {
        name: "cudnnSdpaBackward",
        workspace: workspace(qkv, plans.backward.workspace),
        plans,
        backward: true,
        bound,
        zero: accumulator_to_zero(shape),
        outputs: vec![uid::DQ],
    };
    call.submit(device);
    Some(dqkv)
}

/// The device thread to hand `qkv`'s pass to and the plans of `shape` built there, where a
/// pass is handed over without waiting.
fn applies(
    qkv: &CubeTensor,
    shape: &AttentionShape,
) -> Option<(DeviceHandle<CudaServer>, Arc<Plans>)> {
    if synchronizes() {
        return None;
    }
    let device = asynchronous(qkv)?;
    Some((device, super::built_plans(qkv, shape)?))
}

/// One pass's plan and buffers, owned until the device thread has enqueued it.
struct Call {
    name: &'static str,
    plans: Arc<Plans>,
    backward: bool,
    bound: Bound,
    workspace: CubeTensor,
    zero: Option<(Uid, usize)>,
    /// The uids whose buffers are filled with NaN where the call fails there.
    outputs: Vec<Uid>,
}

impl Call {
    /// Handed to `device`'s thread, which looks the buffers up and enqueues the plan after the
    /// work queued before it (the kernels that wrote its inputs, the seeds' launch).
    fn submit(self, device: DeviceHandle<CudaServer>) {
        device.submit(move |server: &mut CudaServer| {
            let stream = cubecl_environment::stream::StreamId::current();
            let mut resource = |x: &CubeTensor| {
                <CudaServer as ServerStorage>::get_resource(
                    server,
                    x.handle.clone().binding(),
                    stream,
                )
                .ok()
            };
            // The resources keep their buffers in place until the plan is enqueued.
            let resources = self
                .bound
                .iter()
                .map(|(_, x, _)| resource(x))
                .collect::<Option<Vec<_>>>();
            let (Some(resources), Some(space)) = (resources, resource(&self.workspace)) else {
                poisoned(
                    self.name,
                    &[],
                    "its buffers could not be looked up",
                    FALLBACK,
                );
                return;
            };
            let at: Vec<(Uid, u64)> = self
                .bound
                .iter()
                .zip(&resources)
                .map(|((uid, _, offset), r)| (*uid, r.resource().ptr + *offset as u64))
                .collect();
            let stream = resources[0].resource().stream;
            let plan = match self.backward {
                true => &self.plans.backward,
                false => &self.plans.forward,
            };
            // SAFETY: the addresses are the live buffers held above, on this CubeCL stream's
            // device, allocated by the caller from the plan's shape.
            let ran = unsafe {
                run(
                    plan,
                    self.name,
                    &at,
                    space.resource().ptr,
                    self.zero,
                    stream,
                )
            };
            if let Err(e) = ran {
                let outputs: Vec<Output> = self
                    .outputs
                    .iter()
                    .filter_map(|uid| {
                        let i = self.bound.iter().position(|(u, ..)| u == uid)?;
                        let x = &self.bound[i].1;
                        let bytes = x.shape().num_elements() * x.dtype().size();
                        Some((stream, resources[i].resource().ptr, bytes, x.dtype()))
                    })
                    .collect();
                poisoned(self.name, &outputs, &e.0, FALLBACK);
            }
        });
    }
}
