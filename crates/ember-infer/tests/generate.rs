//! Generation: determinism, cache equivalence, and long prompts.

use burn::module::Param;
use burn::tensor::{Device, Distribution, Tensor};
use ember_infer::{GenerateOptions, Sampling, generate, generate_batch};
use ember_model::{DecoderOnly, DecoderOnlyConfig, PositionalKind};

/// A random model with unit-scale embeddings, so its logits are far apart and greedy choices
/// are decisive (at init scale they differ by less than rounding).
fn model(positional: PositionalKind) -> DecoderOnly {
    let device = Device::flex();
    let config = DecoderOnlyConfig {
        vocab_size: 17,
        d_model: 32,
        n_heads: 4,
        n_layers: 2,
        context_len: 16,
        positional,
        ..Default::default()
    };
    let mut model = config.init(&device).unwrap();
    model.wte.weight = Param::from_tensor(Tensor::random(
        [17, 32],
        Distribution::Normal(0.0, 1.0),
        &device,
    ));
    model
}

fn options(use_cache: bool, sampling: Sampling, max_new_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        sampling,
        seed: 5,
        use_cache,
        context_len: 16,
    }
}

#[test]
fn greedy_with_cache_equals_greedy_without() {
    let greedy = Sampling {
        greedy: true,
        ..Default::default()
    };
    for positional in [PositionalKind::Learned, PositionalKind::Rotary] {
        let m = model(positional);
        // Prompt 3 + 13 new = 16 tokens: all inside the context.
        let cached = generate(&m, &[1, 2, 3], &options(true, greedy, 13), |_| true);
        let full = generate(&m, &[1, 2, 3], &options(false, greedy, 13), |_| true);
        assert_eq!(cached, full, "{positional:?}");
    }
}

#[test]
fn same_seed_same_tokens_other_seed_other_tokens() {
    let m = model(PositionalKind::Learned);
    // Tied unit-scale embeddings make "repeat the token" very likely; a high temperature
    // spreads the choice so different seeds show.
    let s = Sampling {
        temperature: 30.0,
        ..Default::default()
    };
    let a = generate(&m, &[4], &options(true, s, 40), |_| true);
    let b = generate(&m, &[4], &options(true, s, 40), |_| true);
    assert_eq!(a, b);
    let mut other = options(true, s, 40);
    other.seed = 6;
    assert_ne!(generate(&m, &[4], &other, |_| true), a);
}

#[test]
fn long_prompts_and_long_outputs_stay_within_the_context() {
    let m = model(PositionalKind::Learned);
    let prompt: Vec<u32> = (0..50).map(|i| i % 17).collect();
    for use_cache in [true, false] {
        let out = generate(
            &m,
            &prompt,
            &options(use_cache, Sampling::default(), 40),
            |_| true,
        );
        assert_eq!(out.len(), 40);
        assert!(out.iter().all(|&t| t < 17));
    }
}

#[test]
fn the_callback_can_stop_generation() {
    let m = model(PositionalKind::Learned);
    let mut seen = 0;
    let out = generate(&m, &[1], &options(true, Sampling::default(), 30), |_| {
        seen += 1;
        seen < 5
    });
    assert_eq!(out.len(), 5);
}

/// Three prompts of different lengths in one left-padded batch: each row gets the tokens the
/// prompt gets alone with the row's seed (greedy and sampled, with and without the cache, for
/// learned, sinusoidal and rotary positions), and a row that stops early stops alone.
#[test]
fn a_batch_of_prompts_gives_each_prompt_its_own_tokens() {
    let prompts: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![9], vec![4, 4, 8, 2, 11]];
    let seeds = [5, 6, 7];
    let hot = Sampling {
        temperature: 2.0,
        ..Default::default()
    };
    let greedy = Sampling {
        greedy: true,
        ..Default::default()
    };
    for positional in [
        PositionalKind::Learned,
        PositionalKind::Sinusoidal,
        PositionalKind::Rotary,
    ] {
        let m = model(positional);
        for (sampling, use_cache) in [(greedy, true), (greedy, false), (hot, true), (hot, false)] {
            // The longest prompt (5) + 11 new = 16 tokens: all inside the context.
            let opts = options(use_cache, sampling, 11);
            let batch = generate_batch(&m, &prompts, &seeds, &opts, |_, _| true);
            for (i, prompt) in prompts.iter().enumerate() {
                let alone = generate(
                    &m,
                    prompt,
                    &GenerateOptions {
                        seed: seeds[i],
                        ..opts
                    },
                    |_| true,
                );
                assert_eq!(
                    batch[i], alone,
                    "{positional:?}, {sampling:?}, cache {use_cache}, prompt {i}"
                );
            }
        }
        // Row 1 stops after its third token; the others go on.
        let mut seen = [0; 3];
        let opts = options(true, greedy, 8);
        let batch = generate_batch(&m, &prompts, &seeds, &opts, |row, _| {
            seen[row] += 1;
            !(row == 1 && seen[row] == 3)
        });
        assert_eq!(batch.iter().map(Vec::len).collect::<Vec<_>>(), [8, 3, 8]);
    }
}

/// Past the context the batch rebuilds its window and goes on, within the model's positions.
#[test]
fn a_batch_runs_past_the_context() {
    let m = model(PositionalKind::Learned);
    let prompts: Vec<Vec<u32>> = vec![(0..20).map(|i| i % 17).collect(), vec![3]];
    for use_cache in [true, false] {
        let out = generate_batch(
            &m,
            &prompts,
            &[1, 2],
            &options(use_cache, Sampling::default(), 40),
            |_, _| true,
        );
        assert!(
            out.iter()
                .all(|r| r.len() == 40 && r.iter().all(|&t| t < 17))
        );
    }
}
