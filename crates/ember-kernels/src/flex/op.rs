//! The plumbing every flex op shares: where a tensor lives decides whether ember's kernel runs
//! (plain flex `f32`), its autodiff op runs (flex `f32` under autodiff, for either
//! checkpointing strategy), or the tensor goes back to the caller for the reference
//! implementation. An op writes its two paths once, as a [`Unary`] or [`Binary`].

use burn::backend::GradientCheckpointingStrategy::{Balanced, Disabled};
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::flex::FlexTensor;
use burn::tensor::Tensor;

use super::tensor::{Route, Tracked, map_plain, map_plain2, map_tracked, map_tracked2, route};

/// An op of one flex tensor: its kernel, and its autodiff op for checkpointing strategy `C`.
pub(crate) trait Unary {
    fn plain(self, x: FlexTensor) -> FlexTensor;
    fn tracked<C: CheckpointStrategy>(self, x: Tracked) -> Tracked;
}

/// An op of two flex tensors, both plain or both tracked with one strategy.
pub(crate) trait Binary {
    fn plain(self, a: FlexTensor, b: FlexTensor) -> FlexTensor;
    fn tracked<C: CheckpointStrategy>(self, a: Tracked, b: Tracked) -> Tracked;
}

/// `op` on `x` where ember's flex kernels take it; otherwise `x` back, untouched.
pub(crate) fn unary<const D: usize, const E: usize>(
    x: Tensor<D>,
    op: impl Unary,
) -> Result<Tensor<E>, Tensor<D>> {
    let x = x.into_dispatch();
    let out = match route(&x) {
        Route::Flex => map_plain(x, |x| op.plain(x)),
        Route::Autodiff(Disabled) => {
            map_tracked::<NoCheckpointing>(x, |x| op.tracked::<NoCheckpointing>(x))
        }
        Route::Autodiff(Balanced) => {
            map_tracked::<BalancedCheckpointing>(x, |x| op.tracked::<BalancedCheckpointing>(x))
        }
        Route::Other => return Err(Tensor::from_dispatch(x)),
    };
    Ok(Tensor::from_dispatch(out))
}

/// `op` on `a` and `b` where ember's flex kernels take both alike; otherwise both back.
pub(crate) fn binary<const D: usize, const E: usize>(
    a: Tensor<D>,
    b: Tensor<E>,
    op: impl Binary,
) -> Result<Tensor<D>, (Tensor<D>, Tensor<E>)> {
    let (a, b) = (a.into_dispatch(), b.into_dispatch());
    let out = match (route(&a), route(&b)) {
        (Route::Flex, Route::Flex) => map_plain2(a, b, |a, b| op.plain(a, b)),
        (Route::Autodiff(Disabled), Route::Autodiff(Disabled)) => {
            map_tracked2::<NoCheckpointing>(a, b, |a, b| op.tracked::<NoCheckpointing>(a, b))
        }
        (Route::Autodiff(Balanced), Route::Autodiff(Balanced)) => {
            map_tracked2::<BalancedCheckpointing>(a, b, |a, b| {
                op.tracked::<BalancedCheckpointing>(a, b)
            })
        }
        _ => return Err((Tensor::from_dispatch(a), Tensor::from_dispatch(b))),
    };
    Ok(Tensor::from_dispatch(out))
}
