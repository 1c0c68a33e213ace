//! Translation end to end: a tiny Multi30k run, and a toy task the model must learn exactly.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor};
use ember_data::parallel::{EOS, PAD};
use ember_infer::{Seq2SeqScorer, beam_search, greedy, translate_batch};
use ember_model::Memory;
use ember_train::translation::{greedy_options, translate_all};
use ember_train::{Launch, TranslationRunConfig, load_translator, train_translation};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-mt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Weight init draws from Burn's process-wide RNG; trainings in this binary take turns.
fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// `configs/multi30k-tiny.toml` with its data paths made absolute.
fn tiny_multi30k() -> TranslationRunConfig {
    let mut config =
        TranslationRunConfig::load(&repo().join("configs/multi30k-tiny.toml")).unwrap();
    for p in [
        &mut config.data.train_src,
        &mut config.data.train_tgt,
        &mut config.data.val_src,
        &mut config.data.val_tgt,
    ] {
        *p = repo().join(&*p);
    }
    config
}

#[test]
fn tiny_multi30k_run_trains_saves_and_translates() {
    let _rng = rng_lock();
    let config = tiny_multi30k();
    let out = temp("tiny").join("run");
    let summary = train_translation(config, &Launch::new(&out)).unwrap();
    assert_eq!(summary.step, 40);
    let val = summary.val_loss.unwrap();
    assert!(val.is_finite() && val < 7.0, "val loss {val}");
    let t = load_translator(&out, &Device::flex()).unwrap();
    let src = vec![
        t.tokenizers
            .encode_source("Ein Mann fährt Fahrrad.")
            .unwrap(),
    ];
    let out_text = translate_all(&t.model, &t.tokenizers, src, &greedy_options(20));
    assert_eq!(out_text.len(), 1);
}

/// Writes a copy task: sentences of 3-7 words from a small vocabulary, target = source.
fn copy_task(dir: &Path, n: usize, seed: u64) -> (PathBuf, PathBuf) {
    let words = [
        "red", "blue", "green", "cat", "dog", "runs", "jumps", "small", "big", "tree",
    ];
    let mut rng = StdRng::seed_from_u64(seed);
    let lines: Vec<String> = (0..n)
        .map(|_| {
            let len = rng.random_range(3..=7);
            (0..len)
                .map(|_| words[rng.random_range(0..words.len())])
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let text = lines.join("\n") + "\n";
    let (src, tgt) = (
        dir.join(format!("copy{seed}.src")),
        dir.join(format!("copy{seed}.tgt")),
    );
    std::fs::write(&src, &text).unwrap();
    std::fs::write(&tgt, &text).unwrap();
    (src, tgt)
}

#[test]
fn learns_to_copy_and_decodes_consistently() {
    let _rng = rng_lock();
    let dir = temp("copy");
    let (train_src, train_tgt) = copy_task(&dir, 2000, 1);
    let (val_src, val_tgt) = copy_task(&dir, 50, 2);
    let mut config = TranslationRunConfig::default();
    config.model.d_model = 64;
    config.model.n_heads = 4;
    config.model.n_encoder_layers = 2;
    config.model.n_decoder_layers = 2;
    config.model.max_positions = 32;
    config.model.dropout = 0.0;
    config.model.shared_embeddings = true;
    config.data.train_src = train_src;
    config.data.train_tgt = train_tgt;
    config.data.val_src = val_src.clone();
    config.data.val_tgt = val_tgt;
    config.data.vocab_size = 300; // every word becomes one token
    config.data.max_len = 24;
    config.data.batch_tokens = 640;
    config.data.bleu_sentences = 0;
    config.training.max_steps = 500;
    config.training.label_smoothing = 0.0;
    // At 2e-3 the last 150 steps spiked (gradient norms 5-10) and the count of exact copies
    // swung from 49 to 35 with the rounding of a matrix product; at 1e-3 two builds that round
    // differently agree (44 and 45, val loss 0.151 and 0.150).
    config.training.lr = 1e-3;
    config.training.warmup_steps = 50;
    config.training.eval_interval = 500;
    config.training.checkpoint_interval = 500;
    let out = dir.join("run");
    train_translation(config, &Launch::new(&out)).unwrap();

    let t = load_translator(&out, &Device::flex()).unwrap();
    let lines: Vec<String> = std::fs::read_to_string(&val_src)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let sources: Vec<Vec<u32>> = lines
        .iter()
        .map(|l| t.tokenizers.encode_source(l).unwrap())
        .collect();
    let got = translate_all(
        &t.model,
        &t.tokenizers,
        sources.clone(),
        &greedy_options(24),
    );
    let exact = got.iter().zip(&lines).filter(|(a, b)| a == b).count();
    assert!(
        exact >= 40,
        "only {exact}/50 copied exactly; e.g. {:?} -> {:?}",
        lines[0],
        got[0]
    );

    // A source decodes the same alone and padded inside a batch with a longer one.
    let options = greedy_options(24);
    let (short, long) = (
        sources[0].clone(),
        vec![sources[0].clone(), sources[1..4].concat()],
    );
    let alone = translate_batch(&t.model, &[short], PAD, &options);
    let padded = translate_batch(&t.model, &long, PAD, &options);
    assert!(long[1].len() > long[0].len());
    assert_eq!(alone[0].tokens, padded[0].tokens);
    assert!((alone[0].log_prob - padded[0].log_prob).abs() < 1e-3);

    // Beam search with a beam of one is greedy decoding.
    let device = Device::flex();
    for src in sources.iter().take(5) {
        let ids: Vec<i32> = src.iter().map(|&i| i as i32).collect();
        let x = Tensor::<1, Int>::from_ints(ids.as_slice(), &device).reshape([1, src.len()]);
        let memory: Memory = t.model.encode(x, None);
        let g = greedy(
            &mut Seq2SeqScorer::new(&t.model, memory.clone()),
            1,
            &options,
        )
        .remove(0);
        let b = beam_search(&mut Seq2SeqScorer::new(&t.model, memory), &options);
        assert_eq!(g.tokens, b.tokens);
        assert!((g.log_prob - b.log_prob).abs() < 1e-4);
        // And a wider beam never scores below greedy.
        let mut wide = options;
        wide.beam = 4;
        let ids_b: Vec<i32> = vec![0; 4];
        let rows = Tensor::<1, Int>::from_ints(ids_b.as_slice(), &device);
        let x = Tensor::<1, Int>::from_ints(ids.as_slice(), &device).reshape([1, src.len()]);
        let m = t.model.encode(x, None);
        let m4 = Memory {
            states: m.states.select(0, rows),
            pad: None,
        };
        let w = beam_search(&mut Seq2SeqScorer::new(&t.model, m4), &wide);
        assert!(
            w.score >= g.score - 1e-4,
            "beam {} < greedy {}",
            w.score,
            g.score
        );
    }
    // Beam search over a batch (all sentences' hypotheses stepped together, padded sources)
    // gives each sentence what it gets alone.
    let mut beam4 = options;
    beam4.beam = 4;
    let batch: Vec<Vec<u32>> = sources[5..11].to_vec();
    assert!(batch.iter().any(|s| s.len() != batch[0].len()), "padding");
    let together = translate_batch(&t.model, &batch, PAD, &beam4);
    for (src, got) in batch.iter().zip(&together) {
        let alone = translate_batch(&t.model, std::slice::from_ref(src), PAD, &beam4).remove(0);
        assert_eq!(got.tokens, alone.tokens);
        assert!((got.log_prob - alone.log_prob).abs() < 1e-3);
    }
    let _ = EOS;
    let _ = std::fs::remove_dir_all(dir);
}

/// The translation task over two CPU workers (`flex,flex`) trains exactly as on one device.
#[test]
fn two_devices_translate_like_one() {
    let _rng = rng_lock();
    let mut config = tiny_multi30k();
    config.model.dropout = 0.0;
    config.training.max_steps = 6;
    config.training.eval_interval = 6;
    config.training.checkpoint_interval = 6;
    config.training.grad_accum = 2;
    let dir = temp("two-devices");
    let one = train_translation(config.clone(), &Launch::new(dir.join("one"))).unwrap();
    let two = train_translation(
        config,
        &Launch {
            device: Some("flex,flex".into()),
            ..Launch::new(dir.join("two"))
        },
    )
    .unwrap();
    let (a, b) = (one.val_loss.unwrap(), two.val_loss.unwrap());
    assert!(a.is_finite());
    assert_eq!(a, b, "val loss on one device {a}, on two {b}");
    assert_eq!(one.train_loss, two.train_loss);
    let _ = std::fs::remove_dir_all(dir);
}
