//! The causal mask and the score a masked position gets: what the attention ops and their
//! references need of masking (`ember_model::attention::masks` builds on them).

use burn::tensor::{Bool, Tensor};

/// The score given to masked positions before the softmax.
///
/// Finite on purpose: a row whose keys are *all* masked then gets uniform weights and a
/// finite output, where `-inf` would give `0/0 = NaN`. `exp(-1e9 - max)` underflows to exactly
/// zero in f32, so a masked key next to any unmasked one gets weight 0.
pub const MASKED_SCORE: f32 = -1.0e9;

/// The causal mask `[1, 1, T, S]`: query `t` (at absolute position `offset + t`) may look at
/// keys `0..=offset + t`. `S = offset + T` is the number of keys including cached ones.
pub fn causal_mask(t: usize, s: usize, device: &burn::tensor::Device) -> Tensor<4, Bool> {
    let offset = s.saturating_sub(t) as i64;
    // tril_mask is true strictly above diagonal `offset`: the future.
    Tensor::<2, Bool>::tril_mask([t, s], offset, device).reshape([1, 1, t, s])
}
