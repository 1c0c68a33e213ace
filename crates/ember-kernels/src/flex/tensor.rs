//! Reaching the `f32` buffers of tensors on Burn's flex backend, for ember's CPU kernels (and,
//! through [`as_flex`], [`from_flex`], [`contiguous`], [`from_values`], [`values`] and
//! [`values_mut`], those of ember's other crates).

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, BackendTensor, DispatchAutodiffContext, DispatchKindConversion, DispatchTensor,
    DispatchTensorKind, Flex, GradientCheckpointingStrategy, TensorMetadata,
};
use burn::tensor::{Bytes, DType, Shape, Tensor};

/// Where an ember kernel finds a tensor.
pub(crate) enum Route {
    /// A plain flex `f32` tensor.
    Flex,
    /// A flex `f32` tensor tracked by autodiff with this checkpointing strategy.
    Autodiff(GradientCheckpointingStrategy),
    /// Anything else: Burn's own operations.
    Other,
}

/// The [`Route`] of a tensor.
pub(crate) fn route(tensor: &DispatchTensor) -> Route {
    match (&tensor.kind, tensor.autodiff) {
        (DispatchTensorKind::Flex(BackendTensor::Float(t)), DispatchAutodiffContext::Disabled)
            if t.dtype() == DType::F32 =>
        {
            Route::Flex
        }
        (DispatchTensorKind::Autodiff(inner), DispatchAutodiffContext::Enabled(strategy)) => {
            match inner.as_ref() {
                DispatchTensorKind::Flex(BackendTensor::Autodiff(t))
                    if t.primitive().dtype() == DType::F32 =>
                {
                    Route::Autodiff(strategy)
                }
                _ => Route::Other,
            }
        }
        _ => Route::Other,
    }
}

/// Whether ember's kernels take `x`: flex `f32`, tracked by autodiff or not.
pub(crate) fn is_flex_f32<const D: usize>(x: &Tensor<D>) -> bool {
    !matches!(route(&x.clone().into_dispatch()), Route::Other)
}

/// The flex tensor behind `x` (sharing its buffer) when `x` is a plain flex `f32` tensor, not
/// tracked by autodiff; `None` otherwise. Dropping `x` afterwards leaves the buffer to the
/// returned tensor alone (when no one else holds it), so it can be written in place.
pub fn as_flex<const D: usize>(x: &Tensor<D>) -> Option<FlexTensor> {
    let tensor = x.clone().into_dispatch();
    let plain = matches!(route(&tensor), Route::Flex);
    plain.then(|| flex_of(tensor))
}

/// The flex tensor inside a [`Route::Flex`] tensor.
fn flex_of(tensor: DispatchTensor) -> FlexTensor {
    <DispatchTensor as DispatchKindConversion<Flex>>::try_into_backend(tensor)
        .expect("routed as flex")
        .float()
}

/// A flex tensor under autodiff (the same type for every checkpointing strategy).
pub(crate) type Tracked = FloatTensor<Autodiff<Flex>>;

/// Applies `f` to the flex tensor inside a [`Route::Flex`] tensor.
pub(crate) fn map_plain(
    tensor: DispatchTensor,
    f: impl FnOnce(FlexTensor) -> FlexTensor,
) -> DispatchTensor {
    let t = f(flex_of(tensor));
    <DispatchTensor as DispatchKindConversion<Flex>>::from_backend(BackendTensor::Float(t))
}

/// Applies `f` to the flex tensors inside two [`Route::Flex`] tensors.
pub(crate) fn map_plain2(
    a: DispatchTensor,
    b: DispatchTensor,
    f: impl FnOnce(FlexTensor, FlexTensor) -> FlexTensor,
) -> DispatchTensor {
    let t = f(flex_of(a), flex_of(b));
    <DispatchTensor as DispatchKindConversion<Flex>>::from_backend(BackendTensor::Float(t))
}

/// Applies `f` to the autodiff tensor inside a [`Route::Autodiff`] tensor whose strategy is `C`.
pub(crate) fn map_tracked<C>(
    tensor: DispatchTensor,
    f: impl FnOnce(Tracked) -> Tracked,
) -> DispatchTensor
where
    C: CheckpointStrategy,
    DispatchTensor: DispatchKindConversion<Autodiff<Flex, C>>,
{
    let t = <DispatchTensor as DispatchKindConversion<Autodiff<Flex, C>>>::try_into_backend(tensor)
        .expect("routed as autodiff flex")
        .float();
    <DispatchTensor as DispatchKindConversion<Autodiff<Flex, C>>>::from_backend(
        BackendTensor::Float(f(t)),
    )
}

/// Applies `f` to the autodiff tensors inside two [`Route::Autodiff`] tensors whose strategy
/// is `C`.
pub(crate) fn map_tracked2<C>(
    a: DispatchTensor,
    b: DispatchTensor,
    f: impl FnOnce(Tracked, Tracked) -> Tracked,
) -> DispatchTensor
where
    C: CheckpointStrategy,
    DispatchTensor: DispatchKindConversion<Autodiff<Flex, C>>,
{
    let inner = |t: DispatchTensor| {
        <DispatchTensor as DispatchKindConversion<Autodiff<Flex, C>>>::try_into_backend(t)
            .expect("routed as autodiff flex")
            .float()
    };
    let t = f(inner(a), inner(b));
    <DispatchTensor as DispatchKindConversion<Autodiff<Flex, C>>>::from_backend(
        BackendTensor::Float(t),
    )
}

/// Wraps a flex tensor back into a [`Tensor`].
pub fn from_flex<const D: usize>(t: FlexTensor) -> Tensor<D> {
    Tensor::from_dispatch(
        <DispatchTensor as DispatchKindConversion<Flex>>::from_backend(BackendTensor::Float(t)),
    )
}

/// A contiguous copy of `t` unless it already is contiguous.
pub fn contiguous(t: FlexTensor) -> FlexTensor {
    if t.is_contiguous() {
        t
    } else {
        t.to_contiguous()
    }
}

/// A new contiguous `f32` tensor of `shape` holding `values`.
pub fn from_values(values: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::new(
        Bytes::from_elems(values),
        Layout::contiguous(shape),
        DType::F32,
    )
}

/// The values of a contiguous flex `f32` tensor.
pub fn values(t: &FlexTensor) -> &[f32] {
    let (start, end) = t.layout().contiguous_offsets().expect("contiguous");
    &t.storage::<f32>()[start..end]
}

/// Writable values of a contiguous flex `f32` tensor: its own buffer when no one else holds it,
/// else a copy swapped in first.
pub fn values_mut(t: &mut FlexTensor) -> &mut [f32] {
    if t.try_storage_mut::<f32>().is_none() {
        *t = from_values(values(t).to_vec(), t.shape());
    }
    let (start, end) = t.layout().contiguous_offsets().expect("contiguous");
    &mut t.try_storage_mut::<f32>().expect("owned")[start..end]
}
