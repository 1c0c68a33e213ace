//! The replayed passes on wgpu (lavapipe records wgpu's graphs): the sum of the passes launched
//! one by one, and the same sum where a replay is refused or the check disagrees.

use super::tests::{batch, model};
use super::*;
use burn::tensor::DeviceKind;
use ember_model::DecoderOnly;

const SHAPE: [usize; 2] = [3, 16];

/// Each batch's loss, its pass launched and read on its own.
fn losses(m: &DecoderOnly, count: usize) -> Vec<f64> {
    let device = m.wte.weight.device();
    (0..count)
        .map(|i| {
            let (x, y) = batch(i, SHAPE, 23);
            m.loss(ids(x, SHAPE, &device), ids(y, SHAPE, &device))
                .into_scalar::<f32>() as f64
        })
        .collect()
}

fn launched(m: &DecoderOnly, count: usize) -> f64 {
    losses(m, count).iter().sum()
}

fn summed(m: &DecoderOnly, count: usize) -> SummedLosses {
    let device = m.wte.weight.device();
    summed_losses(
        &device,
        SHAPE,
        count,
        |i| batch(i, SHAPE, 23),
        |x, y| m.loss(x, y),
    )
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-5 * b.abs()
}

/// Six batches: the first launched, five replays, the sum of the six losses read one by one.
/// The batches' losses differ, so a replay that read stale inputs or a sum not zeroed after the
/// check would be off by far more than the tolerance.
#[test]
fn replayed_passes_sum_the_launched_passes_losses() {
    let m = model(&Device::wgpu(DeviceKind::DefaultDevice));
    let each = losses(&m, 6);
    let want: f64 = each.iter().sum();
    let spread =
        each.iter().fold(f64::MIN, |a, &b| a.max(b)) - each.iter().fold(f64::MAX, |a, &b| a.min(b));
    assert!(spread > 1e-3, "batches too alike to tell apart: {each:?}");
    let run = summed(&m, 6);
    assert_eq!(run.replays, 5, "{run:?}");
    assert!(close(run.sum, want), "{run:?} vs {want}");
    // Summed twice more: a new recording each time, the same sum.
    for _ in 0..2 {
        let again = summed(&m, 6);
        assert_eq!(again.replays, 5);
        assert!(close(again.sum, want), "{again:?} vs {want}");
    }
    // Fewer than three batches launch every pass.
    let two = summed(&m, 2);
    assert_eq!(two.replays, 0);
    assert!(close(two.sum, launched(&m, 2)), "{two:?}");
}

/// A replay refused (a checking one, or one midway) or a check that disagrees: every pass
/// launched, the same sum.
#[test]
fn refused_or_disagreeing_replays_fall_back_to_launched_passes() {
    let m = model(&Device::wgpu(DeviceKind::DefaultDevice));
    let want = launched(&m, 5);
    for at in [0, 3] {
        REFUSE_REPLAY.with(|r| r.set(Some(at)));
        let run = summed(&m, 5);
        REFUSE_REPLAY.with(|r| r.set(None));
        assert_eq!(run.replays, 0, "refused at {at}");
        assert!(close(run.sum, want), "refused at {at}: {run:?} vs {want}");
    }
    DISAGREE.with(|d| d.set(true));
    let run = summed(&m, 5);
    DISAGREE.with(|d| d.set(false));
    assert_eq!(run.replays, 0);
    assert!(close(run.sum, want), "{run:?} vs {want}");
    // And the replays again after them.
    assert_eq!(summed(&m, 5).replays, 4);
}
