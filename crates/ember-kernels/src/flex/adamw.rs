//! [`crate::adamw_step`] on flex: one loop over each parameter, in place.

use burn::backend::TensorMetadata;
use burn::backend::flex::FlexTensor;
use burn::tensor::Tensor;

use super::tensor::{as_flex, contiguous, from_flex, from_values, values, values_mut};
use crate::adamw::{AdamWInputs, AdamWStep};
use crate::kernels::adamw::adamw_in_place;

/// The step on plain flex `f32` tensors; the inputs back otherwise.
pub(crate) fn step<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    moments: Option<(Tensor<D>, Tensor<D>)>,
    k: &AdamWStep,
) -> Result<(Tensor<D>, Tensor<D>, Tensor<D>), AdamWInputs<D>> {
    let flex = |t: &Tensor<D>| as_flex(t).is_some();
    let moments_fit = moments.as_ref().is_none_or(|(m1, m2)| flex(m1) && flex(m2));
    if !(flex(&param) && flex(&grad) && moments_fit) {
        return Err((param, grad, moments));
    }
    let (mut param, grad) = (take(param), take(grad));
    let g = values(&grad);
    let zeros = || from_values(vec![0.0; g.len()], grad.shape());
    let (mut m1, mut m2) = match moments {
        Some((m1, m2)) => (take(m1), take(m2)),
        None => (zeros(), zeros()),
    };
    adamw_in_place(
        k,
        values_mut(&mut param),
        g,
        values_mut(&mut m1),
        values_mut(&mut m2),
    );
    Ok((from_flex(param), from_flex(m1), from_flex(m2)))
}

/// The flex tensor behind `t` (a plain flex tensor); dropping `t` leaves the buffer to it alone
/// when no one else holds it, so it can be updated in place.
fn take<const D: usize>(t: Tensor<D>) -> FlexTensor {
    let flex = as_flex(&t).expect("checked by the caller");
    drop(t);
    contiguous(flex)
}
