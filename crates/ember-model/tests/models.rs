//! Whole-model properties: masks, the KV cache, learning, and config validation.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Bool, Device, Distribution, Int, Tensor};
use ember_model::{
    Activation, DecoderOnly, DecoderOnlyConfig, EncoderDecoder, EncoderDecoderConfig, NormKind,
    PositionInit, PositionalKind,
};

fn max_diff<const N: usize>(a: Tensor<N>, b: Tensor<N>) -> f32 {
    (a - b).abs().max().into_scalar::<f32>()
}

fn lm_config(positional: PositionalKind, norm_first: bool) -> DecoderOnlyConfig {
    DecoderOnlyConfig {
        vocab_size: 11,
        d_model: 16,
        n_heads: 2,
        n_layers: 2,
        context_len: 12,
        positional,
        norm_first,
        ..Default::default()
    }
}

fn lm(positional: PositionalKind, norm_first: bool, device: &Device) -> DecoderOnly {
    lm_config(positional, norm_first).init(device).unwrap()
}

fn mt_config(positional: PositionalKind, norm_first: bool) -> EncoderDecoderConfig {
    EncoderDecoderConfig {
        src_vocab_size: 13,
        tgt_vocab_size: 9,
        d_model: 16,
        n_heads: 4,
        n_encoder_layers: 2,
        n_decoder_layers: 2,
        max_positions: 16,
        dropout: 0.0,
        positional,
        norm_first,
        ..Default::default()
    }
}

fn mt(positional: PositionalKind, norm_first: bool, device: &Device) -> EncoderDecoder {
    mt_config(positional, norm_first).init(device).unwrap()
}

fn tokens(rows: &[&[i32]], device: &Device) -> Tensor<2, Int> {
    let t = rows[0].len();
    let flat: Vec<i32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::<1, Int>::from_ints(flat.as_slice(), device).reshape([rows.len(), t])
}

const ALL_POSITIONS: [PositionalKind; 4] = [
    PositionalKind::Learned,
    PositionalKind::Sinusoidal,
    PositionalKind::Rotary,
    PositionalKind::None,
];

#[test]
fn causal_outputs_ignore_future_tokens() {
    let device = Device::flex();
    for positional in ALL_POSITIONS {
        let model = lm(positional, true, &device);
        let a = tokens(&[&[1, 2, 3, 4, 5, 6, 7, 8]], &device);
        let b = tokens(&[&[1, 2, 3, 4, 9, 0, 10, 3]], &device);
        let la = model.forward(a).slice([0..1, 0..4, 0..11]);
        let lb = model.forward(b);
        let (prefix, rest) = (
            lb.clone().slice([0..1, 0..4, 0..11]),
            lb.slice([0..1, 4..8, 0..11]),
        );
        assert!(
            max_diff(la.clone(), prefix) < 1e-5,
            "{positional:?}: past changed"
        );
        // And the future does change: the test would notice a model that ignores its input.
        let la_rest = model
            .forward(tokens(&[&[1, 2, 3, 4, 5, 6, 7, 8]], &device))
            .slice([0..1, 4..8, 0..11]);
        assert!(max_diff(la_rest, rest) > 1e-4);
    }
}

#[test]
fn padded_keys_get_zero_weight_and_padding_changes_nothing() {
    let device = Device::flex();
    for norm_first in [true, false] {
        let model = mt(PositionalKind::Sinusoidal, norm_first, &device);
        let src = tokens(&[&[3, 4, 5, 6]], &device);
        let padded = tokens(&[&[3, 4, 5, 6, 0, 0]], &device);
        let pad = Tensor::<2, Bool>::from_bool([[false, false, false, false, true, true]], &device);
        let (plain, _) = model.encode_with(src, None, false);
        let (with_pad, weights) = model.encode_with(padded, Some(pad.clone()), true);
        let real = with_pad.states.clone().slice([0..1, 0..4, 0..16]);
        assert!(
            max_diff(plain.states.clone(), real) < 1e-5,
            "encoder output changed"
        );
        for w in weights {
            let padded_weight = w
                .slice([0..1, 0..4, 0..6, 4..6])
                .abs()
                .max()
                .into_scalar::<f32>();
            assert_eq!(padded_weight, 0.0, "a padded key got weight");
        }
        // The decoder reads the memory through the same mask: same logits.
        let tgt = tokens(&[&[1, 2, 3]], &device);
        let a = model.decode(tgt.clone(), None, &plain, None, false).logits;
        let b = model.decode(tgt, None, &with_pad, None, false).logits;
        assert!(max_diff(a, b) < 1e-5, "decoder output changed");
    }
}

#[test]
fn positions_break_permutation_equivariance_of_the_encoder() {
    let device = Device::flex();
    let perm = Tensor::<1, Int>::from_ints([2, 0, 3, 1], &device);
    let src = tokens(&[&[3, 4, 5, 6]], &device);
    let gap = |positional| {
        let model = mt(positional, true, &device);
        let out = model
            .encode(src.clone(), None)
            .states
            .select(1, perm.clone());
        let out_of_permuted = model
            .encode(src.clone().select(1, perm.clone()), None)
            .states;
        max_diff(out, out_of_permuted)
    };
    assert!(gap(PositionalKind::None) < 1e-5);
    assert!(gap(PositionalKind::Sinusoidal) > 1e-3);
    assert!(gap(PositionalKind::Learned) > 1e-3);
}

/// The embedded input is dropped in training, as GPT-2's and nanoGPT's `drop(wte + wpe)`: with
/// every other dropout at 0, a training forward pass (autodiff device) differs from the
/// evaluation pass of the same weights; with the input's dropout at 0 it equals it.
#[test]
fn the_embedded_input_is_dropped_in_training_only() {
    use burn::nn::DropoutConfig;
    let device = Device::flex().autodiff();
    let mut model = lm(PositionalKind::Learned, true, &device);
    let x = tokens(
        &[&[1, 2, 3, 4, 5, 6, 7, 8], &[8, 7, 6, 5, 4, 3, 2, 1]],
        &device,
    );
    let eval = model.valid().forward(x.clone().inner());
    device.seed(3);
    let undropped = model.forward(x.clone());
    assert!(max_diff(undropped.inner(), eval.clone()) < 1e-6);

    model.drop = DropoutConfig::new(0.5).init();
    device.seed(3);
    let dropped = model.forward(x.clone());
    assert!(
        max_diff(dropped.inner(), eval.clone()) > 1e-3,
        "a training pass with the input's dropout at 0.5 equals the evaluation pass"
    );
    // Evaluation never drops.
    assert!(max_diff(model.valid().forward(x.inner()), eval) < 1e-6);
}

#[test]
fn kv_cache_gives_the_logits_of_full_recomputation_decoder_only() {
    let device = Device::flex();
    for positional in ALL_POSITIONS {
        for norm_first in [true, false] {
            let model = lm(positional, norm_first, &device);
            let seq = tokens(
                &[
                    &[1, 5, 2, 8, 3, 3, 9, 0, 4, 7],
                    &[2, 2, 6, 1, 0, 10, 4, 4, 1, 3],
                ],
                &device,
            );
            let full = model.forward(seq.clone());
            let mut cache = model.new_cache();
            // Prefill three tokens at once, then one at a time.
            let mut pieces = vec![
                model
                    .forward_with(
                        seq.clone().slice([0..2, 0..3]),
                        None,
                        Some(&mut cache),
                        false,
                    )
                    .logits,
            ];
            for t in 3..10 {
                let step = seq.clone().slice([0..2, t..t + 1]);
                pieces.push(
                    model
                        .forward_with(step, None, Some(&mut cache), false)
                        .logits,
                );
            }
            assert_eq!(cache.len(), 10);
            let incremental = Tensor::cat(pieces, 1);
            let diff = max_diff(full, incremental);
            assert!(
                diff < 1e-4,
                "{positional:?} norm_first={norm_first}: {diff}"
            );
        }
    }
}

#[test]
fn a_whole_buffer_cache_gives_the_logits_of_the_valid_rows_cache() {
    // 70 positions: the buffers start at 64 and double once on the way, so the whole-buffer
    // reading attends over 64, then 128 positions, most of them masked.
    let device = Device::flex();
    for positional in ALL_POSITIONS {
        let model = DecoderOnlyConfig {
            context_len: 80,
            ..lm_config(positional, true)
        }
        .init(&device)
        .unwrap();
        let ids: Vec<i32> = (0..140).map(|i| (i * 7 + i / 3) % 11).collect();
        let rows: [&[i32]; 2] = [&ids[..70], &ids[70..]];
        let seq = tokens(&rows, &device);
        let (mut valid, mut whole) = (model.new_cache(), model.new_whole_buffer_cache());
        let run = |cache: &mut ember_model::DecoderCache| -> Vec<Tensor<3>> {
            let mut out = vec![
                model
                    .forward_with(seq.clone().slice([0..2, 0..5]), None, Some(cache), false)
                    .logits,
            ];
            for t in 5..70 {
                let step = seq.clone().slice([0..2, t..t + 1]);
                out.push(model.forward_with(step, None, Some(cache), false).logits);
            }
            out
        };
        let (a, b) = (run(&mut valid), run(&mut whole));
        assert_eq!(whole.len(), 70);
        for (t, (a, b)) in a.into_iter().zip(b).enumerate() {
            let diff = max_diff(a, b);
            assert!(diff < 1e-5, "{positional:?}, piece {t}: {diff}");
        }
    }
}

/// One-token steps that read their position from a device tensor
/// (`DecoderCache::read_position_from`, what a replayed step does) give the logits of the
/// valid-rows cache, across a doubling of the buffers, for every kind of position (learned: the
/// table's row looked up; sinusoidal and rotary: rows of tables of every position).
#[test]
fn steps_reading_their_position_from_the_device_give_the_cached_logits() {
    let device = Device::flex();
    for positional in ALL_POSITIONS {
        let model = DecoderOnlyConfig {
            context_len: 80,
            ..lm_config(positional, true)
        }
        .init(&device)
        .unwrap();
        let ids: Vec<i32> = (0..140).map(|i| (i * 5 + i / 4) % 11).collect();
        let rows: [&[i32]; 2] = [&ids[..70], &ids[70..]];
        let seq = tokens(&rows, &device);
        let (mut valid, mut at) = (model.new_cache(), model.new_whole_buffer_cache());
        let prompt = seq.clone().slice([0..2, 0..5]);
        let _ = model.forward_with(prompt.clone(), None, Some(&mut valid), false);
        let _ = model.forward_with(prompt, None, Some(&mut at), false);
        for t in 5..70 {
            let step = seq.clone().slice([0..2, t..t + 1]);
            let want = model
                .forward_with(step.clone(), None, Some(&mut valid), false)
                .logits;
            // A position the host did not pass: the model reads it from the tensor.
            let position = Tensor::<1, Int>::from_ints([t], &device);
            at.read_position_from(Some(model.step_position(position)));
            let got = model.forward_with(step, None, Some(&mut at), false).logits;
            let diff = max_diff(want, got);
            assert!(diff < 1e-5, "{positional:?}, step {t}: {diff}");
        }
        assert_eq!(at.len(), 70);
        assert!(at.capacity() >= 70);
        // Back to the host's count.
        at.read_position_from(None);
        assert!(at.position().is_none());
    }
}

/// Prompts of different lengths left-padded into one batch, decoded with a
/// `DecoderCache::left_padded` cache: each row's logits, at the prompt's last position and at
/// every step after, equal those of the prompt decoded alone (for every kind of position).
#[test]
fn a_left_padded_batch_gives_each_prompt_its_own_logits() {
    let device = Device::flex();
    for positional in ALL_POSITIONS {
        let model = DecoderOnlyConfig {
            context_len: 20,
            ..lm_config(positional, true)
        }
        .init(&device)
        .unwrap();
        let prompts: [&[i32]; 3] = [&[3, 1, 4, 1, 5], &[9, 2], &[6, 5, 3, 5]];
        let longest = 5;
        let pads: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
        // The padding's token id does not matter; 7 shows it.
        let padded: Vec<Vec<i32>> = prompts
            .iter()
            .map(|p| [vec![7; longest - p.len()], p.to_vec()].concat())
            .collect();
        let rows: Vec<&[i32]> = padded.iter().map(Vec::as_slice).collect();
        let mut cache = ember_model::DecoderCache::left_padded(2, pads);
        let first = model
            .forward_with(tokens(&rows, &device), None, Some(&mut cache), false)
            .logits
            .slice([0..3, longest - 1..longest, 0..11]);
        let next: [i32; 3] = [2, 8, 0];
        let steps: Vec<Tensor<3>> = (0..6)
            .map(|_| {
                let step: Vec<&[i32]> = next.iter().map(std::slice::from_ref).collect();
                model
                    .forward_with(tokens(&step, &device), None, Some(&mut cache), false)
                    .logits
            })
            .collect();
        for (row, prompt) in prompts.iter().enumerate() {
            let mut alone = model.new_cache();
            let want = model
                .forward_with(tokens(&[prompt], &device), None, Some(&mut alone), false)
                .logits;
            let t = prompt.len();
            let got = first.clone().slice([row..row + 1, 0..1, 0..11]);
            let diff = max_diff(got, want.slice([0..1, t - 1..t, 0..11]));
            assert!(diff < 1e-5, "{positional:?}, row {row}, prompt: {diff}");
            for (s, step) in steps.iter().enumerate() {
                let token = [next[row]];
                let want = model
                    .forward_with(tokens(&[&token], &device), None, Some(&mut alone), false)
                    .logits;
                let got = step.clone().slice([row..row + 1, 0..1, 0..11]);
                let diff = max_diff(got, want);
                assert!(diff < 1e-5, "{positional:?}, row {row}, step {s}: {diff}");
            }
        }
    }
}

#[test]
fn kv_cache_gives_the_logits_of_full_recomputation_encoder_decoder() {
    let device = Device::flex();
    for positional in ALL_POSITIONS {
        let model = mt(positional, true, &device);
        let src = tokens(&[&[3, 4, 5, 6, 0], &[7, 8, 9, 0, 0]], &device);
        let src_pad = src.clone().equal_elem(0);
        let memory = model.encode(src, Some(src_pad));
        let tgt = tokens(&[&[1, 4, 2, 7, 5, 3], &[1, 8, 8, 2, 6, 6]], &device);
        let full = model.decode(tgt.clone(), None, &memory, None, false).logits;
        let mut cache = model.new_cache();
        let pieces: Vec<_> = (0..6)
            .map(|t| {
                let step = tgt.clone().slice([0..2, t..t + 1]);
                model
                    .decode(step, None, &memory, Some(&mut cache), false)
                    .logits
            })
            .collect();
        let diff = max_diff(full, Tensor::cat(pieces, 1));
        assert!(diff < 1e-4, "{positional:?}: {diff}");
    }
}

/// Counts parameters whose gradient is missing or all zeros.
struct GradCheck<'a> {
    grads: &'a GradientsParams,
    dead: Vec<String>,
    seen: usize,
}

impl ModuleVisitor for GradCheck<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.seen += 1;
        let alive = self
            .grads
            .get::<D>(param.id)
            .map(|g| g.abs().sum().into_scalar::<f32>() > 0.0)
            .unwrap_or(false);
        if !alive {
            self.dead
                .push(format!("{:?} {:?}", param.id, param.val().dims()));
        }
    }
}

fn assert_all_params_get_gradients<M: Module>(model: &M, grads: &GradientsParams) {
    let mut check = GradCheck {
        grads,
        dead: vec![],
        seen: 0,
    };
    model.visit(&mut check);
    assert!(check.seen > 10, "visited only {} parameters", check.seen);
    assert!(check.dead.is_empty(), "no gradient for: {:?}", check.dead);
}

#[test]
fn one_step_lowers_the_loss_of_the_language_model() {
    let device = Device::flex().autodiff();
    device.seed(7);
    for (positional, tie, llama) in [
        (PositionalKind::Learned, true, false),
        (PositionalKind::Rotary, false, false),
        (PositionalKind::Rotary, false, true),
    ] {
        let mut config = match llama {
            true => llama_config(),
            false => lm_config(positional, true),
        };
        config.tie_weights = tie;
        let model = config.init(&device).unwrap();
        let x = Tensor::<2, Int>::random([4, 12], Distribution::Uniform(0.0, 11.0), &device);
        let y = Tensor::<2, Int>::random([4, 12], Distribution::Uniform(0.0, 11.0), &device);
        let loss = model.loss(x.clone(), y.clone());
        let before = loss.clone().into_scalar::<f32>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        assert_all_params_get_gradients(&model, &grads);
        let mut optim = AdamWConfig::new().init();
        let model = optim.step(1e-2, model, grads);
        let after = model.loss(x, y).into_scalar::<f32>();
        assert!(after < before, "{positional:?}: loss {before} -> {after}");
    }
}

#[test]
fn one_step_lowers_the_loss_of_the_translation_model() {
    let device = Device::flex().autodiff();
    device.seed(7);
    for (norm_first, shared) in [(true, false), (false, true)] {
        let mut config = mt_config(PositionalKind::Learned, norm_first);
        config.shared_embeddings = shared;
        config.tgt_vocab_size = if shared { 13 } else { 9 };
        config.tie_output = !shared;
        let model = config.init(&device).unwrap();
        let src = Tensor::<2, Int>::random([3, 7], Distribution::Uniform(0.0, 13.0), &device);
        let tgt = Tensor::<2, Int>::random([3, 6], Distribution::Uniform(0.0, 9.0), &device);
        let out = Tensor::<2, Int>::random([3, 6], Distribution::Uniform(0.0, 9.0), &device);
        let loss_of = |m: &EncoderDecoder| {
            ember_model::loss::cross_entropy(
                m.forward(src.clone(), None, tgt.clone(), None),
                out.clone(),
                None,
                0.1,
            )
        };
        let loss = loss_of(&model);
        let before = loss.clone().into_scalar::<f32>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        assert_all_params_get_gradients(&model, &grads);
        let mut optim = AdamWConfig::new().init();
        let model = optim.step(1e-2, model, grads);
        let after = loss_of(&model).into_scalar::<f32>();
        assert!(
            after < before,
            "norm_first={norm_first}: loss {before} -> {after}"
        );
    }
}

#[test]
fn cross_entropy_matches_hand_computed_value() {
    let device = Device::flex();
    // Two positions over a 3-word vocabulary; the second target is padding (id 0).
    let logits =
        Tensor::<1>::from_floats([1.0, 2.0, 0.5, 0.0, 0.0, 3.0], &device).reshape([1, 2, 3]);
    let targets = tokens(&[&[1, 0]], &device);
    let lse = (1f64.exp() + 2f64.exp() + 0.5f64.exp()).ln();
    let want = lse - 2.0;
    let got = ember_model::loss::cross_entropy(logits.clone(), targets.clone(), Some(0), 0.0)
        .into_scalar::<f32>();
    assert!((got as f64 - want).abs() < 1e-5, "{got} vs {want}");
    // Label smoothing 0.3: 0.7 * nll + 0.3 * mean over words of -log p.
    let mean_nll = (3.0 * lse - (1.0 + 2.0 + 0.5)) / 3.0;
    let want = 0.7 * want + 0.3 * mean_nll;
    let got = ember_model::loss::cross_entropy(logits, targets, Some(0), 0.3).into_scalar::<f32>();
    assert!((got as f64 - want).abs() < 1e-5, "{got} vs {want}");
}

#[test]
fn invalid_configs_are_errors_naming_the_field() {
    let device = Device::flex();
    let base = lm_config(PositionalKind::Learned, true);
    let cases: Vec<(DecoderOnlyConfig, &str)> = vec![
        (
            DecoderOnlyConfig {
                n_heads: 3,
                ..base.clone()
            },
            "n_heads",
        ),
        (
            DecoderOnlyConfig {
                d_model: 0,
                ..base.clone()
            },
            "d_model",
        ),
        (
            DecoderOnlyConfig {
                n_layers: 0,
                ..base.clone()
            },
            "n_layers",
        ),
        (
            DecoderOnlyConfig {
                vocab_size: 0,
                ..base.clone()
            },
            "vocab_size",
        ),
        (
            DecoderOnlyConfig {
                max_positions: Some(8),
                ..base.clone()
            },
            "context_len",
        ),
        (
            DecoderOnlyConfig {
                dropout: 1.5,
                ..base.clone()
            },
            "dropout",
        ),
        (
            DecoderOnlyConfig {
                dropout: f64::NAN,
                ..base.clone()
            },
            "dropout",
        ),
        (
            DecoderOnlyConfig {
                d_model: 6,
                n_heads: 2,
                positional: PositionalKind::Rotary,
                ..base.clone()
            },
            "positional",
        ),
        (
            DecoderOnlyConfig {
                positional: PositionalKind::Rotary,
                position_init: PositionInit::Sinusoidal,
                ..base.clone()
            },
            "position_init",
        ),
        (
            DecoderOnlyConfig {
                rotary_dims: Some(2),
                ..base.clone()
            },
            "rotary_dims",
        ),
        (
            DecoderOnlyConfig {
                positional: PositionalKind::Rotary,
                rotary_dims: Some(3),
                ..base.clone()
            },
            "rotary_dims",
        ),
        (
            DecoderOnlyConfig {
                positional: PositionalKind::Rotary,
                rotary_dims: Some(64),
                ..base.clone()
            },
            "rotary_dims",
        ),
        (
            DecoderOnlyConfig {
                norm_first: false,
                parallel_blocks: true,
                ..base.clone()
            },
            "parallel_blocks",
        ),
        (
            DecoderOnlyConfig {
                n_kv_heads: Some(3),
                ..base.clone()
            },
            "n_kv_heads",
        ),
        (
            DecoderOnlyConfig {
                n_kv_heads: Some(0),
                ..base.clone()
            },
            "n_kv_heads",
        ),
    ];
    for (config, field) in cases {
        let err = config.init(&device).unwrap_err();
        assert_eq!(err.field, field, "{err}");
        assert!(err.to_string().contains(field));
    }
    let bad = EncoderDecoderConfig {
        shared_embeddings: true,
        ..mt_config(PositionalKind::Sinusoidal, true)
    };
    assert_eq!(bad.init(&device).unwrap_err().field, "shared_embeddings");
}

#[test]
fn configs_parse_from_toml_and_reject_unknown_keys() {
    let config: DecoderOnlyConfig =
        toml::from_str("d_model = 32\nactivation = \"gelu_tanh\"\npositional = \"rotary\"")
            .unwrap();
    assert_eq!(config.position_init, PositionInit::Normal);
    let init: DecoderOnlyConfig = toml::from_str("position_init = \"sinusoidal\"").unwrap();
    assert_eq!(init.position_init, PositionInit::Sinusoidal);
    assert_eq!(config.d_model, 32);
    assert_eq!(config.activation, Activation::GeluTanh);
    assert_eq!(config.positional, PositionalKind::Rotary);
    assert_eq!(config.n_heads, DecoderOnlyConfig::default().n_heads);
    let err = toml::from_str::<DecoderOnlyConfig>("d_modle = 32").unwrap_err();
    assert!(err.to_string().contains("d_modle"), "{err}");
}

#[test]
fn summary_reports_the_parameter_count() {
    let device = Device::flex();
    let model = lm(PositionalKind::Learned, true, &device);
    // wte 11*16 + wpe 12*16 + 2 blocks + ln_f 32, tied head.
    let block = 2 * 32 + (16 * 48 + 48) + (16 * 16 + 16) + (16 * 64 + 64) + (64 * 16 + 16);
    let want = 11 * 16 + 12 * 16 + 2 * block + 32;
    assert_eq!(model.num_params(), want);
    let summary = model.summary();
    assert!(
        summary.contains(&ember_model::summary::thousands(want)),
        "{summary}"
    );
    assert!(summary.contains("tied to wte"));
}

/// Pythia's block (GPT-NeoX's): attention and MLP side by side, 2 of each head's 8 dimensions
/// rotated. Its transformers twin is checked in ember-train's tests (`tiny-pythia`); here, that
/// it decodes as it computes: the causal mask, the valid-rows cache, a whole-buffer cache read
/// at a position held on the device (the rotation's tables as wide as the part it turns), and
/// a left-padded batch (rotated from negative positions) all give the full forward's logits.
#[test]
fn parallel_blocks_with_a_partial_rotation_decode_as_they_compute() {
    let device = Device::flex();
    let config = DecoderOnlyConfig {
        context_len: 80,
        rotary_dims: Some(2),
        parallel_blocks: true,
        ..lm_config(PositionalKind::Rotary, true)
    };
    let model = config.init(&device).unwrap();
    // The rotation and the block are the variants': the model differs from the plain one with
    // the same weights.
    let plain = DecoderOnlyConfig {
        rotary_dims: None,
        parallel_blocks: false,
        ..config.clone()
    }
    .init(&device)
    .unwrap()
    .load_record(model.clone().into_record());
    let seq = long_rows(&device);
    assert!(max_diff(model.forward(seq.clone()), plain.forward(seq)) > 1e-3);
    decodes_as_it_computes(&model, &device);
}

/// Two rows of 70 tokens of a vocabulary of 11.
fn long_rows(device: &Device) -> Tensor<2, Int> {
    let ids: Vec<i32> = (0..140).map(|i| (i * 5 + i / 4) % 11).collect();
    let rows: [&[i32]; 2] = [&ids[..70], &ids[70..]];
    tokens(&rows, device)
}

/// `model` (context at least 70, vocabulary 11) is causal, and its valid-rows cache, a
/// whole-buffer cache read at a position held on the device and a left-padded batch all give
/// the full forward's logits.
fn decodes_as_it_computes(model: &DecoderOnly, device: &Device) {
    let device = device.clone();
    let seq = long_rows(&device);
    let ids: Vec<i32> = (0..140).map(|i| (i * 5 + i / 4) % 11).collect();
    let full = model.forward(seq.clone());
    // Causal: a changed future leaves the past's logits.
    let mut changed = ids[..70].to_vec();
    changed[40] = (changed[40] + 1) % 11;
    let other = model.forward(tokens(&[&changed], &device));
    let same = |x: Tensor<3>| x.slice([0..1, 0..40, 0..11]);
    assert!(max_diff(same(full.clone()), same(other)) < 1e-6);

    let (mut valid, mut at) = (model.new_cache(), model.new_whole_buffer_cache());
    let prompt = seq.clone().slice([0..2, 0..5]);
    let first = model
        .forward_with(prompt.clone(), None, Some(&mut valid), false)
        .logits;
    let _ = model.forward_with(prompt, None, Some(&mut at), false);
    assert!(max_diff(first, full.clone().slice([0..2, 0..5, 0..11])) < 1e-4);
    for t in 5..70 {
        let step = seq.clone().slice([0..2, t..t + 1]);
        let want = full.clone().slice([0..2, t..t + 1, 0..11]);
        let cached = model
            .forward_with(step.clone(), None, Some(&mut valid), false)
            .logits;
        assert!(max_diff(cached, want.clone()) < 1e-4, "step {t}");
        let position = Tensor::<1, Int>::from_ints([t], &device);
        at.read_position_from(Some(model.step_position(position)));
        let replayed = model.forward_with(step, None, Some(&mut at), false).logits;
        assert!(
            max_diff(replayed, want) < 1e-4,
            "step {t}, position on the device"
        );
    }

    // Left-padded: the shorter prompt's last logits are its own.
    let prompts: [&[i32]; 2] = [&[3, 1, 4, 1, 5], &[9, 2]];
    let padded: [&[i32]; 2] = [&[3, 1, 4, 1, 5], &[7, 7, 7, 9, 2]];
    let mut cache = ember_model::DecoderCache::left_padded(2, vec![0, 3]);
    let batch = model
        .forward_with(tokens(&padded, &device), None, Some(&mut cache), false)
        .logits;
    for (row, prompt) in prompts.iter().enumerate() {
        let alone = model.forward(tokens(&[prompt], &device));
        let t = prompt.len();
        let want = alone.slice([0..1, t - 1..t, 0..11]);
        let got = batch.clone().slice([row..row + 1, 4..5, 0..11]);
        assert!(max_diff(got, want) < 1e-4, "prompt {row}");
    }
}

/// LLaMA's parts: RMSNorm, a gated SiLU MLP (SwiGLU), 4 query heads sharing 2 key/value heads,
/// no biases, an untied head.
fn llama_config() -> DecoderOnlyConfig {
    DecoderOnlyConfig {
        context_len: 80,
        n_heads: 4,
        n_kv_heads: Some(2),
        gated_mlp: true,
        activation: Activation::Silu,
        norm: NormKind::RmsNorm,
        bias: false,
        tie_weights: false,
        ..lm_config(PositionalKind::Rotary, true)
    }
}

/// Its transformers twin is checked in ember-train's tests (`tiny-llama`); here, that a model of
/// LLaMA's parts decodes as it computes (its cache one head per group), and that its gate's
/// activation changes what it computes.
#[test]
fn llama_blocks_decode_as_they_compute() {
    let device = Device::flex();
    let model = unit_scale(llama_config().init(&device).unwrap());
    decodes_as_it_computes(&model, &device);
    // The cache keeps one key and value head per group: 2 of the 4 heads' width.
    let mut cache = model.new_cache();
    let _ = model.forward_with(long_rows(&device), None, Some(&mut cache), false);
    let (k, v) = cache.self_attn[0].get().unwrap();
    assert_eq!((k.dims(), v.dims()), ([2, 2, 70, 4], [2, 2, 70, 4]));
    // The same weights with another activation for the gate compute something else.
    let seq = long_rows(&device);
    let twin = DecoderOnlyConfig {
        activation: Activation::Gelu,
        ..llama_config()
    }
    .init(&device)
    .unwrap()
    .load_record(model.clone().into_record());
    assert!(max_diff(twin.forward(seq.clone()), model.forward(seq)) > 1e-2);
    // Parameters: per block two norms of 16, c_attn 16 x (16 + 2 * 8), c_proj 16 x 16, the MLP
    // 16 x 2F and F x 16 with F = 64; the embedding, the final norm and the head.
    let per_block = 2 * 16 + 16 * 32 + 16 * 16 + 16 * 128 + 64 * 16;
    let want = 2 * per_block + 11 * 16 + 16 + 16 * 11;
    assert_eq!(model.num_params(), want);
}

/// Grouped-query attention is multi-head attention whose heads share keys and values: a model
/// with 2 key/value heads for 4 query heads gives the logits of a multi-head model whose key and
/// value columns (and biases) are those of its group, and the gradient of a shared column is
/// the sum of the multi-head model's over the heads that share it.
#[test]
fn grouped_keys_and_values_are_heads_sharing_them() {
    let device = Device::flex().autodiff();
    let config = DecoderOnlyConfig {
        bias: true,
        ..llama_config()
    };
    let grouped = unit_scale(config.init(&device).unwrap());
    // Column of the multi-head c_attn -> column of the grouped one: head h reads group h / 2.
    let (d, k) = (16, 4);
    let from: Vec<i32> = (0..3 * d)
        .map(|c| match c / d {
            0 => c,
            part => {
                let (head, e) = ((c % d) / k, c % k);
                d + (part - 1) * 2 * k + (head / 2) * k + e
            }
        })
        .collect();
    let index = Tensor::<1, Int>::from_ints(from.as_slice(), &device);
    let mut expanded = grouped.clone();
    for block in &mut expanded.blocks {
        let linear = &mut block.attn.c_attn;
        let weight = linear.weight.val().detach().select(1, index.clone());
        linear.weight = Param::from_tensor(leaf(weight));
        let bias = linear.bias.as_ref().unwrap().val();
        linear.bias = Some(Param::from_tensor(leaf(bias.select(0, index.clone()))));
    }
    let heads = DecoderOnlyConfig {
        n_kv_heads: None,
        ..config.clone()
    }
    .init(&device)
    .unwrap()
    .load_record(expanded.into_record());
    let seq = long_rows(&device);
    let targets = seq.clone().slice([0..2, 1..70]);
    let inputs = seq.slice([0..2, 0..69]);
    let (a, b) = (
        grouped.loss(inputs.clone(), targets.clone()),
        heads.loss(inputs, targets),
    );
    assert!(max_diff(a.clone(), b.clone()) < 1e-5);
    let (ga, gb) = (a.backward(), b.backward());
    let grad = |model: &DecoderOnly, grads: &_| -> Tensor<2> {
        model.blocks[0]
            .attn
            .c_attn
            .weight
            .val()
            .grad(grads)
            .unwrap()
    };
    let (ga, gb) = (grad(&grouped, &ga), grad(&heads, &gb));
    // Summing the multi-head gradient's columns into the grouped ones they came from.
    let summed = Tensor::<2>::zeros([d, d + 4 * k], &gb.device()).select_assign(
        1,
        index.inner(),
        gb,
        burn::tensor::IndexingUpdateOp::Add,
    );
    assert!(max_diff(ga, summed) < 1e-5);
}

/// `model` with its matrices 10 times their initial scale (standard deviation 0.2, where a
/// width of 16 gives each product about unit scale): at the initial 0.02 every logit is near 0,
/// and a comparison of them tells little.
fn unit_scale(model: DecoderOnly) -> DecoderOnly {
    struct Scale;
    impl burn::module::ModuleMapper for Scale {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            match D {
                2 => {
                    let (x, tracked) = (param.val(), param.val().is_require_grad());
                    let device = x.device();
                    let x = Tensor::from_data(x.mul_scalar(10.0).into_data(), &device);
                    Param::initialized(param.id, x.set_require_grad(tracked))
                }
                _ => param,
            }
        }
    }
    model.map(&mut Scale)
}

/// A tensor of `x`'s values that autodiff (where `x` is tracked) tracks as a leaf of its own,
/// as a parameter.
fn leaf<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let (device, tracked) = (x.device(), x.is_require_grad());
    Tensor::from_data(x.into_data(), &device).set_require_grad(tracked)
}
