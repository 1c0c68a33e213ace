//! The replayed path's tests on wgpu: the same tokens as step by step and as the host.

use super::*;
use crate::generate::wgpu_tests::{greedy, model, model_with_context};
use crate::generate::{GenerateOptions, decode_on_device, generate_on_host};
use ember_model::PositionalKind;
use rand::SeedableRng;

fn replayed(
    m: &DecoderOnly,
    prompt: &[u32],
    tokens: usize,
    ctx: usize,
    choice: Choice,
    seed: u64,
    on_token: impl FnMut(u32) -> bool,
) -> Replays {
    let rng = StdRng::seed_from_u64(seed);
    decode_replayed(m, prompt, tokens, ctx, (choice, rng), on_token)
        .unwrap_or_else(|_| panic!("wgpu writes the step's inputs in place"))
}

/// Greedy text from replayed steps against the host's: 45 tokens in a context of 16, so the
/// window is rebuilt twice and a step is captured in each window; the ids reach `on_token`
/// in order, and most steps were replays (lavapipe records wgpu's graphs).
#[test]
fn replayed_greedy_steps_give_the_host_paths_text() {
    let m = model(PositionalKind::Learned);
    assert!(applies(&m.wte.weight.device()));
    let prompt = [1, 2, 3];
    let host = generate_on_host(&m, &prompt, &greedy(true, 45), 16, |_| true);
    let distinct: std::collections::HashSet<_> = host.iter().collect();
    assert!(distinct.len() > 4, "too uniform to compare: {host:?}");
    let mut seen = Vec::new();
    let run = replayed(&m, &prompt, 45, 16, Choice::Greedy, 1, |id| {
        seen.push(id);
        true
    });
    assert_eq!(run.produced, host);
    assert_eq!(seen, host);
    assert!(run.captures >= 3, "{run:?}");
    assert!(run.replays >= 30, "{run:?}");
}

/// Temperature draws from replayed steps, by the uniform numbers the host writes before each
/// replay, against the step-by-step device path of the same seed: the same ids.
#[test]
fn replayed_draws_equal_the_device_paths_of_the_same_seed() {
    let m = model(PositionalKind::Learned);
    for (temperature, seed) in [(1.0, 3), (3.0, 4)] {
        let choice = Choice::Temperature(temperature);
        let rng = StdRng::seed_from_u64(seed);
        let stepwise = decode_on_device(&m, &[1, 2], 45, 16, (choice, rng), |_| true);
        let run = replayed(&m, &[1, 2], 45, 16, choice, seed, |_| true);
        assert_eq!(run.produced, stepwise, "temperature {temperature}");
        assert!(run.replays >= 30, "{run:?}");
        let argmax = replayed(&m, &[1, 2], 45, 16, Choice::Greedy, seed, |_| true);
        assert_ne!(run.produced, argmax.produced, "temperature {temperature}");
    }
}

/// A context longer than the cache's first buffer: the buffers grow from 64 to 128 to 256
/// positions on the way, each growth ends the graph recorded over the old buffers, and the
/// step after it is captured again. The text equals the host's.
#[test]
fn replays_follow_the_cache_as_it_grows() {
    let m = model_with_context(PositionalKind::Learned, 160);
    let options = GenerateOptions {
        context_len: 160,
        ..greedy(true, 170)
    };
    let host = generate_on_host(&m, &[5], &options, 160, |_| true);
    let run = replayed(&m, &[5], 170, 160, Choice::Greedy, 1, |_| true);
    assert_eq!(run.produced, host);
    // 64, 128, 256 in the first window, then the rebuilt one.
    assert!(run.captures >= 4, "{run:?}");
    assert!(run.replays >= 150, "{run:?}");
}

/// A stop asked for inside a burst of unread ids: the ids up to it, as the host path gives.
#[test]
fn a_stop_ends_the_replayed_path_where_it_ends_the_host_path() {
    let m = model(PositionalKind::Learned);
    for stop in [1, 7, 20] {
        let stop_at = || {
            let mut count = 0;
            move |_| {
                count += 1;
                count < stop
            }
        };
        let run = replayed(&m, &[4], 45, 16, Choice::Greedy, 1, stop_at());
        let host = generate_on_host(&m, &[4], &greedy(true, 45), 16, stop_at());
        assert_eq!(run.produced.len(), stop);
        assert_eq!(run.produced, host);
    }
}

/// A replay the backend refuses (here by the test's say): the tokens not read yet are
/// dropped, the window is rebuilt from the ones read and decoding goes on step by step, so
/// greedy text is still the host's, to the last token.
#[test]
fn a_refused_replay_goes_on_step_by_step_with_the_same_greedy_text() {
    let m = model(PositionalKind::Learned);
    let host = generate_on_host(&m, &[1, 2, 3], &greedy(true, 45), 16, |_| true);
    for at in [0, 5, 11] {
        REFUSE_REPLAY.with(|r| r.set(Some(at)));
        let run = replayed(&m, &[1, 2, 3], 45, 16, Choice::Greedy, 1, |_| true);
        REFUSE_REPLAY.with(|r| r.set(None));
        assert_eq!(run.produced, host, "refused at replay {at}");
        assert_eq!(run.replays, at, "no replay after the refusal");
    }
}

/// Sinusoidal and rotary positions, encoded from tables of every position at the position
/// the device holds: the host's greedy text, most steps replayed.
#[test]
fn sinusoidal_and_rotary_steps_are_replayed_too() {
    for positional in [PositionalKind::Sinusoidal, PositionalKind::Rotary] {
        let m = model(positional);
        let host = generate_on_host(&m, &[1, 2, 3], &greedy(true, 45), 16, |_| true);
        let distinct: std::collections::HashSet<_> = host.iter().collect();
        assert!(distinct.len() > 4, "{positional:?}: too uniform: {host:?}");
        let run = replayed(&m, &[1, 2, 3], 45, 16, Choice::Greedy, 1, |_| true);
        assert_eq!(run.produced, host, "{positional:?}");
        assert!(run.replays >= 30, "{positional:?}: {run:?}");
    }
}
