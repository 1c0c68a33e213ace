//! Attention masks: which keys a query may not look at. `true` means hidden.

use burn::tensor::{Bool, Tensor};

// The causal mask and the masked score live with the ops that use them.
pub use crate::ops::masks::{MASKED_SCORE, causal_mask};

/// The padding mask `[B, 1, 1, S]` from a `[B, S]` mask that is `true` at padding.
pub fn padding_mask(pad: Tensor<2, Bool>) -> Tensor<4, Bool> {
    let [b, s] = pad.dims();
    pad.reshape([b, 1, 1, s])
}

/// Combines two optional masks with a logical OR, broadcasting.
pub fn combine_masks(
    a: Option<Tensor<4, Bool>>,
    b: Option<Tensor<4, Bool>>,
) -> Option<Tensor<4, Bool>> {
    match (a, b) {
        (Some(a), Some(b)) => {
            let shape = broadcast_shape(a.dims(), b.dims());
            Some(a.expand(shape).bool_or(b.expand(shape)))
        }
        (a, None) => a,
        (None, b) => b,
    }
}

fn broadcast_shape(a: [usize; 4], b: [usize; 4]) -> [usize; 4] {
    std::array::from_fn(|i| a[i].max(b[i]))
}
