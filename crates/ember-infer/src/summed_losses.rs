//! The losses of many batches of one shape, summed: an evaluation's forward passes, with one
//! captured pass replayed per batch on GPU backends.
//!
//! An evaluation runs the same forward pass on batch after batch (nanoGPT's GPU config: 200
//! batches of `[64, 256]` per split, 20 evaluations in its 5000 iterations). On a GPU each pass
//! is a hundred-odd kernel launches whose host cost bounds it, as a decoding step's did
//! (`generate::replayed`). So the pass is captured once as a graph (CUDA graphs; on wgpu the
//! resolved dispatches) and replayed for each batch: the host writes the batch's ids into the
//! two input buffers the graph reads, and the graph adds the batch's loss into a one-value sum
//! it writes in place. The host reads the sum once.
//!
//! The order: the first batch runs for real (it also allocates what the recording reuses) and
//! its loss is read; the same pass is recorded (which runs nothing), library calls included
//! (`ember_kernels::LibraryCallsRecorded`: nothing is allocated between the replays); two
//! replays on the first batch must bring the sum to three times that loss, which says the
//! recording adds into the sum and computes what the real pass did. The sum is then zeroed and
//! the other batches are replayed. A backend that cannot record, a recording or replay it
//! refuses, a library call that failed inside the recording, or a sum that disagrees (said
//! once, in one line) sends the whole sum to the pass-by-pass path, which launches every pass
//! and also sums on the device.

use burn::backend::{Backend, Dispatch};
use burn::tensor::{Device, Int, Tensor, TensorData};
use ember_kernels::{self as ops, GpuStrategy};

/// Relative difference allowed between the checking replays' sum and three times the real
/// pass's loss: the same kernels on the same inputs, up to the sum's rounding (and atomics'
/// order, where a kernel adds with them).
const AGREEMENT: f64 = 1e-5;

/// What [`summed_losses`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SummedLosses {
    /// The sum of the batches' losses.
    pub sum: f64,
    /// Batches whose pass was a replay of the captured one (0 where every pass was launched).
    pub replays: usize,
}

/// The sum over batches `0..count` of `loss(x, y)`, batch `i`'s input and target ids given by
/// `batch(i)` (`shape[0] * shape[1]` each, row-major), computed on `device` and read once.
/// With three batches or more on a GPU backend (and `EMBER_GPU_KERNELS` not turning
/// `eval-graph` off), one captured pass is replayed per batch (the module's documentation);
/// `loss` must then read nothing from the host but its two inputs, which holds for a model's
/// forward pass. `batch` may be called more than once for an index.
///
/// # Shapes
/// - `x`, `y` given to `loss`: `shape`
/// - `loss`'s output: `[1]`
pub fn summed_losses(
    device: &Device,
    shape: [usize; 2],
    count: usize,
    mut batch: impl FnMut(usize) -> (Vec<i32>, Vec<i32>),
    loss: impl Fn(Tensor<2, Int>, Tensor<2, Int>) -> Tensor<1>,
) -> SummedLosses {
    let replayable =
        count >= 3 && ops::gpu_kernels::applies(GpuStrategy::EvalGraph) && ops::on_cubecl(device);
    if replayable && let Some(sum) = replayed(device, shape, count, &mut batch, &loss) {
        return sum;
    }
    let sum = (0..count)
        .map(|i| {
            let (x, y) = batch(i);
            loss(ids(x, shape, device), ids(y, shape, device))
        })
        .reduce(|a, b| a + b)
        .map_or(0.0, |sum| sum.into_scalar::<f32>() as f64);
    SummedLosses { sum, replays: 0 }
}

/// `ids` as a `[shape]` tensor on `device`.
fn ids(ids: Vec<i32>, shape: [usize; 2], device: &Device) -> Tensor<2, Int> {
    Tensor::<1, Int>::from_ints(ids.as_slice(), device).reshape(shape)
}

/// The replayed path; `None` where the backend cannot record or replay the pass, or its sum
/// disagrees with the real pass's (nothing of it is then used).
fn replayed(
    device: &Device,
    shape: [usize; 2],
    count: usize,
    batch: &mut impl FnMut(usize) -> (Vec<i32>, Vec<i32>),
    loss: &impl Fn(Tensor<2, Int>, Tensor<2, Int>) -> Tensor<1>,
) -> Option<SummedLosses> {
    let (first_x, first_y) = batch(0);
    let x = ids(first_x.clone(), shape, device);
    let y = ids(first_y, shape, device);
    // The backend must write the inputs in place (Burn's fusion, which owns its buffers, does
    // not): tried on the first batch's own ids.
    if !ops::write_in_place(&x, TensorData::new(first_x, shape)) {
        return None;
    }
    let dispatch = device.as_dispatch();
    Dispatch::graph_prepare(dispatch).ok()?;
    // The pass run for real, into a sum held here alone: the addition writes it in place.
    let mut sum = Tensor::<1>::zeros([1], device) + loss(x.clone(), y.clone());
    let first = sum.clone().into_scalar::<f32>() as f64;
    // A loss that is not finite cannot be checked against: every pass is launched.
    if !first.is_finite() || Dispatch::graph_start_capture(dispatch).is_err() {
        // Closing the prepared capture is what releases the stream.
        let _ = Dispatch::graph_stop_capture(dispatch);
        return None;
    }
    // The recording takes the library calls (cuBLAS's products, cuDNN's attention) the real
    // pass made: the same pass, and so the same sum.
    let libraries = ops::LibraryCallsRecorded::new();
    sum = sum + loss(x.clone(), y.clone());
    let graph = Dispatch::graph_stop_capture(dispatch).ok()?;
    // A library call that failed inside the recording may have left its output unwritten.
    if libraries.a_call_failed() {
        return None;
    }
    drop(libraries);
    // SAFETY (each replay): every buffer the recording read is alive while `graph` is: the
    // model's weights (borrowed by `loss` for this call), `x`, `y` and `sum`; its intermediates
    // lie in pools whose pages no allocation takes while it lives (CubeCL guards those its own
    // kernels touched, and nothing is allocated on the device between the replays, which keeps
    // the buffers only library calls touched where they were). One thread issues everything.
    let replay = |at: usize| {
        unsafe { Dispatch::graph_replay(dispatch, &graph) }.is_ok() && !tests_refuse(at)
    };
    if !(replay(0) && replay(0)) {
        return None;
    }
    let checked = sum.clone().into_scalar::<f32>() as f64;
    if !agrees(checked, 3.0 * first) || tests_disagree() {
        disagreed(checked, 3.0 * first);
        return None;
    }
    if !ops::write_in_place(&sum, TensorData::new(vec![0f32], [1])) {
        return None;
    }
    for i in 1..count {
        let (xi, yi) = batch(i);
        let written = ops::write_in_place(&x, TensorData::new(xi, shape))
            && ops::write_in_place(&y, TensorData::new(yi, shape));
        if !(written && replay(i)) {
            return None;
        }
    }
    let rest = sum.into_scalar::<f32>() as f64;
    // (The graph, declared after `x` and `y`, is dropped before them.)
    Some(SummedLosses {
        sum: first + rest,
        replays: count - 1,
    })
}

/// Whether the checking replays' sum is `expected` (a NaN agrees with nothing: a library call
/// that failed inside the recording may have left one).
fn agrees(sum: f64, expected: f64) -> bool {
    (sum - expected).abs() <= AGREEMENT * expected.abs().max(1.0)
}

/// Says once that a recorded pass's sum disagreed with the real pass's.
fn disagreed(replayed: f64, expected: f64) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        eprintln!(
            "warning: two replays of a recorded evaluation pass summed {replayed} where three \
             times the pass run gives {expected}; such evaluations launch every pass instead \
             (EMBER_GPU_KERNELS=-eval-graph never records them)"
        )
    });
}

#[cfg(test)]
thread_local! {
    /// The replay [`tests_refuse`] refuses on this thread (its batch index).
    static REFUSE_REPLAY: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    /// Whether [`tests_disagree`] says the check disagreed on this thread.
    static DISAGREE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether a test asks the replay of batch `at` to be taken as refused.
fn tests_refuse(at: usize) -> bool {
    #[cfg(test)]
    {
        REFUSE_REPLAY.with(|r| r.get() == Some(at))
    }
    #[cfg(not(test))]
    {
        let _ = at;
        false
    }
}

/// Whether a test asks the check to be taken as disagreeing.
fn tests_disagree() -> bool {
    #[cfg(test)]
    {
        DISAGREE.with(std::cell::Cell::get)
    }
    #[cfg(not(test))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_model::{DecoderOnly, DecoderOnlyConfig};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Batch `i` of `shape`: ids below `vocab` drawn from `i`.
    pub(super) fn batch(i: usize, shape: [usize; 2], vocab: i32) -> (Vec<i32>, Vec<i32>) {
        let mut rng = StdRng::seed_from_u64(i as u64 + 100);
        let mut draw = || {
            (0..shape[0] * shape[1])
                .map(|_| rng.random_range(0..vocab))
                .collect()
        };
        (draw(), draw())
    }

    pub(super) fn model(device: &Device) -> DecoderOnly {
        let config = DecoderOnlyConfig {
            vocab_size: 23,
            d_model: 32,
            n_heads: 4,
            n_layers: 2,
            context_len: 16,
            ..Default::default()
        };
        config.init(device).unwrap()
    }

    /// The check: within its tolerance, not beyond, never with a NaN.
    #[test]
    fn the_check_agrees_within_its_tolerance_and_never_with_nan() {
        assert!(agrees(6.0, 6.0));
        assert!(agrees(6.0 + 5e-5, 6.0));
        assert!(!agrees(6.0 + 1e-3, 6.0));
        assert!(!agrees(f64::NAN, 6.0));
        assert!(!agrees(6.0, f64::NAN));
    }

    /// On flex (no graphs): every pass launched, their losses summed, equal to the losses
    /// read one by one; no batches, a sum of 0.
    #[test]
    fn on_flex_every_pass_is_launched() {
        let device = Device::flex();
        let m = model(&device);
        let shape = [3, 16];
        let summed = summed_losses(
            &device,
            shape,
            4,
            |i| batch(i, shape, 23),
            |x, y| m.loss(x, y),
        );
        let by_hand: f64 = (0..4)
            .map(|i| {
                let (x, y) = batch(i, shape, 23);
                m.loss(ids(x, shape, &device), ids(y, shape, &device))
                    .into_scalar::<f32>() as f64
            })
            .sum();
        assert_eq!(summed.replays, 0);
        assert!(
            (summed.sum - by_hand).abs() < 1e-5 * by_hand,
            "{summed:?} vs {by_hand}"
        );
        let none = summed_losses(
            &device,
            shape,
            0,
            |i| batch(i, shape, 23),
            |x, y| m.loss(x, y),
        );
        assert_eq!(
            none,
            SummedLosses {
                sum: 0.0,
                replays: 0
            }
        );
    }
}

#[cfg(all(test, feature = "wgpu"))]
#[path = "summed_losses_wgpu_tests.rs"]
mod wgpu_tests;
