//! Reaching the `f32` buffers of tensors on Burn's flex backend, for ember's CPU kernels.

use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::{
    BackendTensor, DispatchAutodiffContext, DispatchKindConversion, DispatchTensor,
    DispatchTensorKind, Flex,
};
use burn::tensor::{Bytes, DType, Shape, Tensor};

/// The flex tensor behind `x` (sharing its buffer) when `x` is a plain, untracked flex `f32`
/// tensor; `None` on other backends, under autodiff, or for other dtypes.
pub(crate) fn as_flex<const D: usize>(x: &Tensor<D>) -> Option<FlexTensor> {
    let tensor = x.clone().into_dispatch();
    match (tensor.kind, tensor.autodiff) {
        (DispatchTensorKind::Flex(BackendTensor::Float(t)), DispatchAutodiffContext::Disabled)
            if t.dtype() == DType::F32 =>
        {
            Some(t)
        }
        _ => None,
    }
}

/// Wraps a flex tensor back into a [`Tensor`].
pub(crate) fn from_flex<const D: usize>(t: FlexTensor) -> Tensor<D> {
    Tensor::from_dispatch(
        <DispatchTensor as DispatchKindConversion<Flex>>::from_backend(BackendTensor::Float(t)),
    )
}

/// A contiguous copy of `t` unless it already is contiguous.
pub(crate) fn contiguous(t: FlexTensor) -> FlexTensor {
    if t.is_contiguous() {
        t
    } else {
        t.to_contiguous()
    }
}

/// A new contiguous `f32` tensor of `shape` holding `values`.
pub(crate) fn from_values(values: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::new(
        Bytes::from_elems(values),
        Layout::contiguous(shape),
        DType::F32,
    )
}
