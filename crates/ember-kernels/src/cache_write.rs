//! The cache-write op: a decoding step's keys and values written into the KV cache's buffers.
//!
//! Reference: two `slice_assign`s (in place where a buffer is not shared). Kernel (GPU backends,
//! plain `f32` tensors): one launch writes both buffers, in place under the same condition
//! (`cube/cache_write`): one launch fewer per layer and token.
//!
//! [`write_cache_rows_at`] takes the position from a device tensor instead, so that a captured
//! decoding step (a graph replayed once per token) writes where the current token goes.

use burn::tensor::{Int, Tensor};

/// The buffers with `k` written at positions `start..start + T` of `k_buffer`, and `v` of
/// `v_buffer`.
///
/// # Shapes
/// - k_buffer, v_buffer: `[B, H, C, K]`
/// - k, v: `[B, H, T, K]` with `start + T <= C`
/// - output: `[B, H, C, K]` each
pub fn write_cache_rows(
    k_buffer: Tensor<4>,
    v_buffer: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    start: usize,
) -> (Tensor<4>, Tensor<4>) {
    #[cfg(feature = "cube")]
    let (k_buffer, v_buffer, k, v) =
        match super::cube::cache_write::write_cache_rows(k_buffer, v_buffer, k, v, start) {
            Ok(buffers) => return buffers,
            Err(parts) => parts,
        };
    write_cache_rows_reference(k_buffer, v_buffer, k, v, start)
}

/// [`write_cache_rows`] at the position held by `position` `[1]` on the device (written there
/// between replays of a captured decoding step); the position is not read back to the host on
/// GPU backends.
///
/// # Shapes
/// - k_buffer, v_buffer: `[B, H, C, K]`
/// - k, v: `[B, H, T, K]` with `position + T <= C`
/// - position: `[1]`
/// - output: `[B, H, C, K]` each
pub fn write_cache_rows_at(
    k_buffer: Tensor<4>,
    v_buffer: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    position: &Tensor<1, Int>,
) -> (Tensor<4>, Tensor<4>) {
    #[cfg(feature = "cube")]
    let (k_buffer, v_buffer, k, v) =
        match super::cube::cache_write::write_cache_rows_at(k_buffer, v_buffer, k, v, position) {
            Ok(buffers) => return buffers,
            Err(parts) => parts,
        };
    let start = super::read_position(position);
    write_cache_rows_reference(k_buffer, v_buffer, k, v, start)
}

/// [`write_cache_rows`] in Burn's tensor ops, on every backend.
pub fn write_cache_rows_reference(
    k_buffer: Tensor<4>,
    v_buffer: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    start: usize,
) -> (Tensor<4>, Tensor<4>) {
    let [b, h, t, d] = k.dims();
    let range = [0..b, 0..h, start..start + t, 0..d];
    (
        k_buffer.slice_assign(range.clone(), k),
        v_buffer.slice_assign(range, v),
    )
}
