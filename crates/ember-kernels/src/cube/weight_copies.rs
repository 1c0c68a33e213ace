//! Mixed precision's weights in the products' type, carried from one step to the next
//! ([`crate::weight_in`]).
//!
//! A bf16 training step reads the weight of every linear layer and embedding table in bf16
//! (`ember_model::precision::products_in`): a cast of the `f32` master weight, one launch and
//! one pass over the weight for every weight and forward pass (26 a step for nanoGPT's GPU
//! config; as many again for every evaluation). Here the first cast of a master is kept beside
//! it, and ember's AdamW kernel, which reads and writes every master anyway, writes the new
//! master's copy as it updates it ([`take`], [`keep`]): the next forward pass reads the copy
//! and launches nothing. The copy holds the same values as the cast (one rounding of the same
//! `f32` value), so training computes what it computed with the casts, bit for bit.
//!
//! A copy is served only for the buffer it was made from: its entry holds the master's handle,
//! so CubeCL neither writes that buffer in place (it does so only into a buffer nothing else
//! holds) nor gives its memory to another tensor (a buffer's id is never reused). An entry
//! whose master nothing else holds any more (the optimizer replaced it without ember's kernel)
//! is dropped at the next insertion; [`crate::forget_weight_copies`] drops them all.

use crate::GpuStrategy;
use crate::cube::autodiff::tracked;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, unary};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, TensorMetadata, backend_extension};
use burn::tensor::{DType, FloatDType, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use std::sync::Mutex;

/// A master weight (`f32`) and its copy in the products' type.
struct Entry {
    master: CubeTensor,
    copy: CubeTensor,
}

/// Every copy kept, on every device.
static COPIES: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

std::thread_local! {
    /// Copies served on this thread (for the tests: that a step read them).
    static SERVED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Whether `a` and `b` are the same view of the same buffer.
fn same(a: &CubeTensor, b: &CubeTensor) -> bool {
    a.handle.memory.descriptor().id == b.handle.memory.descriptor().id
        && a.handle.offset_start == b.handle.offset_start
        && a.shape() == b.shape()
        && a.meta.strides() == b.meta.strides()
        && a.dtype == b.dtype
}

fn copies() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    COPIES.lock().unwrap_or_else(|e| e.into_inner())
}

/// `w` (an `f32` weight, tracked by autodiff or not, on a CubeCL device without fusion) in
/// the float type `dtype` (bf16 or f16): its kept copy, else a cast that is kept; `w` back
/// where this does not apply (`weight-copies` off, another backend or type).
pub(crate) fn weight_in<const D: usize>(
    w: Tensor<D>,
    dtype: DType,
) -> Result<Tensor<D>, Tensor<D>> {
    let applies = crate::gpu_kernels::applies(GpuStrategy::WeightCopies)
        && matches!(dtype, DType::BF16 | DType::F16)
        && w.shape().num_elements() > 0
        && super::cube_f32(&w);
    if !applies {
        return Err(w);
    }
    let y = <Dispatch as WeightCopyKernels>::weight_in(w.into_dispatch(), dtype);
    Ok(Tensor::from_dispatch(y))
}

/// The op on CubeCL's backend and autodiff over it. Fusion's tensors have no buffers yet, so
/// [`weight_in`] never hands them over: its deferred version is there for the dispatch alone.
#[backend_extension(Cube, Fusion: cfg(feature = "fusion"), Autodiff)]
pub trait WeightCopyKernels: Backend {
    /// The `f32` weight `w` in the float type `dtype`: its kept copy, or a cast kept for the
    /// next call.
    #[fusion(meta = copy_spec)]
    fn weight_in(w: FloatTensor<Self>, dtype: DType) -> FloatTensor<Self>;
}

/// The copy: `w`'s shape in `dtype`, for fusion (which defers the op).
#[cfg(feature = "fusion")]
fn copy_spec(
    w: &burn::backend::fusion::custom::TensorSpec,
    dtype: &DType,
) -> burn::backend::fusion::custom::TensorSpec {
    burn::backend::fusion::custom::TensorSpec::new(w.shape.clone(), *dtype)
}

impl WeightCopyKernels for CubeBackend {
    fn weight_in(w: CubeTensor, dtype: DType) -> CubeTensor {
        {
            let kept = copies();
            if let Some(entry) = kept
                .iter()
                .find(|e| same(&e.master, &w) && e.copy.dtype == dtype)
            {
                SERVED.set(SERVED.get() + 1);
                return entry.copy.clone();
            }
        }
        // A weight nothing else holds (a view that replaces its model's weights, as decoding
        // builds once) is gone when the cast returns: nothing to keep.
        let held_elsewhere = !w.handle.can_mut();
        let copy = <CubeBackend as FloatTensorOps<CubeBackend>>::float_cast(
            w.clone(),
            FloatDType::from(dtype),
        );
        if held_elsewhere {
            keep(w, copy.clone());
        }
        copy
    }
}

impl<B: WeightCopyKernels, C: CheckpointStrategy> WeightCopyKernels for Autodiff<B, C> {
    fn weight_in(w: FloatTensor<Self>, dtype: DType) -> FloatTensor<Self> {
        tracked::<B, C, _, _>(Widen, [w], |[w]| (B::weight_in(w, dtype), ()))
    }
}

/// The autodiff node: the gradient widened back to the master's `f32`, as a cast's is.
#[derive(Debug)]
struct Widen;

impl<B: WeightCopyKernels> Backward<B, 1> for Widen {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::float_cast(grad, FloatDType::F32)
        });
    }
}

/// The float type of `master`'s kept copy, its entry removed (so that the caller, an
/// optimizer replacing `master`, can keep the new one's); `None` where none is kept.
pub(crate) fn take(master: &CubeTensor) -> Option<DType> {
    let mut kept = copies();
    let at = kept.iter().position(|e| same(&e.master, master))?;
    Some(kept.swap_remove(at).copy.dtype)
}

/// Keeps `copy` as `master`'s, dropping the entries whose master only this list holds.
pub(crate) fn keep(master: CubeTensor, copy: CubeTensor) {
    let mut kept = copies();
    // A handle held by the list alone (and CubeCL's own count) is free to be written in place.
    kept.retain(|e| !e.master.handle.can_mut());
    kept.push(Entry { master, copy });
}

/// Drops every kept copy.
pub(crate) fn forget() {
    copies().clear();
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use crate::{AdamWStep, GpuPolicy, adamw_step};
    use burn::tensor::{Device, DeviceKind, Distribution};

    type Ops = CubeBackend;

    fn id(x: &CubeTensor) -> usize {
        x.handle.memory.descriptor().id.value
    }

    /// What the copies rest on: a buffer the list holds is not written in place by an op that
    /// writes a buffer nothing else holds in place (Burn's `mul_scalar` here), and its copy is
    /// not served for the op's result; a master nothing else holds any more is dropped at the
    /// next insertion; the cast of a weight the caller alone held is not kept.
    #[test]
    fn a_kept_master_is_neither_written_in_place_nor_served_stale() {
        let w = crate::cube::attention_products::tests::cube(&[1.5, -2.25, 3.0], [1, 1, 3]);
        let alone = <Ops as FloatTensorOps<Ops>>::float_mul_scalar(w.clone(), 1.0.into());
        let before = id(&alone);
        let doubled = <Ops as FloatTensorOps<Ops>>::float_mul_scalar(alone, 2.0.into());
        assert_eq!(id(&doubled), before, "an unheld buffer is written in place");
        let copy = <Ops as WeightCopyKernels>::weight_in(doubled.clone(), DType::F16);
        assert!(!copy.handle.can_mut(), "the list holds the copy");
        let held = id(&doubled);
        // The op takes the model's hold on the master: the list's is the last.
        let again = <Ops as FloatTensorOps<Ops>>::float_mul_scalar(doubled, 2.0.into());
        assert_ne!(id(&again), held, "a kept master is written in place");
        let served = SERVED.get();
        let fresh = <Ops as WeightCopyKernels>::weight_in(again, DType::F16);
        assert_eq!(SERVED.get(), served, "a copy served for another buffer");
        let other = crate::cube::attention_products::tests::cube(&[0.5], [1, 1, 1]);
        let _ = <Ops as WeightCopyKernels>::weight_in(other.clone(), DType::F16);
        assert!(
            copy.handle.can_mut(),
            "the entry of a master held by the list alone outlived the next insertion"
        );
        let read = |x: CubeTensor| {
            let x = <Ops as FloatTensorOps<Ops>>::float_cast(x, FloatDType::F32);
            burn_cubecl::ops::into_data_sync(x)
                .try_to_vec::<f32>()
                .unwrap()
        };
        assert_eq!(read(copy), [3.0, -4.5, 6.0]);
        assert_eq!(read(fresh.clone()), [6.0, -9.0, 12.0]);
        // The op took the last hold on `again`: its cast is not kept.
        assert!(
            fresh.handle.can_mut(),
            "a copy kept for a master nothing holds"
        );
    }

    /// A layer's weight trained by ember's AdamW kernel through mixed precision's products (f16
    /// standing in for bf16, which lavapipe lacks), with the kept copies and with a cast each
    /// step: the same losses and the same weights, bit for bit, after every step; the steps
    /// after the first read the copies (none with `weight-copies` off), also where the AdamW
    /// steps are grouped and the copy is written by the group's launch; the gradient reaches
    /// the `f32` weight in `f32`.
    #[test]
    fn training_with_copies_equals_training_with_casts_on_wgpu() {
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let plain = Device::wgpu(DeviceKind::DefaultDevice);
        let start = Tensor::<2>::random([6, 5], Distribution::Normal(0.0, 1.0), &plain);
        let start = start.into_data();
        let x = Tensor::<2>::random([4, 6], Distribution::Normal(0.0, 1.0), &plain).into_data();
        let run = |copies: bool, grouped: bool| {
            let kernels = crate::gpu_kernels::policy()
                .kernels
                .with_strategy(GpuStrategy::WeightCopies, copies);
            let policy = GpuPolicy {
                kernels,
                ..crate::gpu_kernels::policy()
            };
            crate::gpu_kernels::with_policy(policy, || {
                let served = SERVED.get();
                let mut w = Tensor::<2>::from_data(start.clone(), &plain);
                let mut moments = None;
                let mut trace = Vec::new();
                for step in 1..=4 {
                    let leaf = Tensor::<2>::from_inner(w.clone()).require_grad();
                    let view = crate::weight_in(leaf.clone(), FloatDType::F16);
                    assert_eq!(view.dtype(), DType::F16);
                    let input = Tensor::<2>::from_data(x.clone(), &device).cast(FloatDType::F16);
                    let y = input.matmul(view).cast(FloatDType::F32);
                    let loss = (y.clone() * y).mean();
                    let grads = loss.backward();
                    let grad = leaf.grad(&grads).expect("the weight's gradient");
                    assert_eq!(grad.dtype(), DType::F32, "the gradient in f32");
                    let k = AdamWStep::new(0.9, 0.99, 1e-8, 0.1, 1e-2, step);
                    // Grouped, the step (and the copy it writes) waits for the group's end.
                    let group = grouped.then(crate::AdamWGroups::open);
                    let (p, m1, m2) = adamw_step(w, grad, moments, &k, None)
                        .unwrap_or_else(|_| panic!("the kernel takes wgpu f32 tensors"));
                    drop(group);
                    trace.push(loss.into_scalar::<f32>().to_bits());
                    trace.extend(
                        p.to_data()
                            .try_to_vec::<f32>()
                            .unwrap()
                            .iter()
                            .map(|v| v.to_bits()),
                    );
                    (w, moments) = (p, Some((m1, m2)));
                }
                (trace, SERVED.get() - served)
            })
        };
        let (with_copies, served) = run(true, false);
        let (with_casts, served_off) = run(false, false);
        let (grouped, served_grouped) = run(true, true);
        assert_eq!(served, 3, "steps 2 to 4 read the copies");
        assert_eq!(served_off, 0, "weight-copies off serves none");
        assert_eq!(
            served_grouped, 3,
            "the grouped launches write the copies too"
        );
        assert_eq!(with_copies, with_casts, "losses and weights, bit for bit");
        assert_eq!(
            grouped, with_casts,
            "grouped: losses and weights, bit for bit"
        );
    }
}
