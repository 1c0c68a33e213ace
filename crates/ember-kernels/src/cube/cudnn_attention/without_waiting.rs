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
//! check of the loss ([`submit_without_waiting`]).

use super::{
    Bound, CudaServer, Plans, accumulator_to_zero, backward_bound, forward_bound, run,
    synchronizes, workspace,
};
use crate::cudnn::attention_graph::{AttentionShape, uid};
use crate::cudnn::graph::Uid;
use crate::products::cublas::{asynchronous, submit_without_waiting};
use burn_cubecl::tensor::CubeTensor;
use cubecl_common::device_handle::DeviceHandle;
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
    let workspace = workspace(qkv, plans.forward.workspace);
    let outputs = [uid::O, uid::STATS];
    submit(
        device,
        "cudnnSdpaForward",
        plans,
        false,
        bound,
        workspace,
        None,
        &outputs,
    );
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
    let workspace = workspace(qkv, plans.backward.workspace);
    let zero = accumulator_to_zero(shape);
    submit(
        device,
        "cudnnSdpaBackward",
        plans,
        true,
        bound,
        workspace,
        zero,
        &[uid::DQ],
    );
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

/// The forward (or `backward`) plan of `plans` on `bound`'s buffers and `workspace`, handed to
/// `device`'s thread ([`submit_without_waiting`]); the buffers of the `outputs` uids are filled
/// with NaN where it fails there.
#[allow(clippy::too_many_arguments)]
fn submit(
    device: DeviceHandle<CudaServer>,
    name: &'static str,
    plans: Arc<Plans>,
    backward: bool,
    bound: Bound,
    workspace: CubeTensor,
    zero: Option<(Uid, usize)>,
    outputs: &[Uid],
) {
    let outputs = outputs
        .iter()
        .filter_map(|uid| bound.iter().position(|(u, ..)| u == uid))
        .collect();
    let mut buffers: Vec<CubeTensor> = bound.iter().map(|(_, x, _)| x.clone()).collect();
    buffers.push(workspace);
    submit_without_waiting(
        device,
        name,
        FALLBACK,
        buffers,
        outputs,
        move |at, stream| {
            let plan = match backward {
                true => &plans.backward,
                false => &plans.forward,
            };
            let bound_at: Vec<(Uid, u64)> = bound
                .iter()
                .zip(at)
                .map(|((uid, _, offset), address)| (*uid, address + *offset as u64))
                .collect();
            // SAFETY: the addresses are the live buffers the task holds, on this CubeCL stream's
            // device, allocated by the caller from the plan's shape; the workspace is the last.
            unsafe { run(plan, name, &bound_at, at[bound.len()], zero, stream) }.map_err(|e| e.0)
        },
    );
}
