//! The training loop end to end on the tiny config: learning, resume, checkpoints.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use ember_train::{Launch, Precision, RunConfig, load_lm, train_lm};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tiny() -> RunConfig {
    let mut config = RunConfig::load(&repo().join("configs/tiny.toml")).unwrap();
    config.data.path = repo().join("data/tinyshakespeare.txt");
    config
}

/// Weight init and dropout draw from Burn's process-wide RNG: tests that train hold this lock so
/// a parallel test cannot consume draws between a run's seeding and its use.
fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn tiny_config_learns() {
    let _rng = rng_lock();
    let out = out_dir("learns");
    let summary = train_lm(tiny(), &Launch::new(&out)).unwrap();
    assert_eq!(summary.step, 300);
    // A character model starts at ln(66) = 4.19 nats; unigram statistics alone give ~3.3.
    let val = summary.val_loss.unwrap();
    assert!(val < 2.75, "val loss {val} after 300 steps");
    assert!(out.join("loss.png").is_file());
    assert!(
        !out.join(".loss.tmp.png").exists(),
        "the plot is drawn beside and renamed"
    );
    assert!(out.join("metrics.jsonl").is_file());
    // The checkpoint loads and scores the way training measured it.
    let lm = load_lm(&out, &Device::flex()).unwrap();
    assert_eq!(lm.step, 300);
    let report =
        ember_train::eval::evaluate(&lm, &repo().join("data/tinyshakespeare.txt")).unwrap();
    assert!(
        (report.loss - val).abs() < 0.15,
        "eval {} vs val {val}",
        report.loss
    );
    let _ = std::fs::remove_dir_all(out);
}

/// Every parameter of the newest checkpoint in `dir`, flattened.
fn params(dir: &Path) -> Vec<f32> {
    let lm = load_lm(dir, &Device::flex()).unwrap();
    let mut out = Vec::new();
    struct Collect<'a>(&'a mut Vec<f32>);
    impl burn::module::ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            self.0.extend(p.val().try_into_vec_as::<f32>().unwrap());
        }
    }
    lm.model.visit(&mut Collect(&mut out));
    out
}

/// The largest absolute difference between two parameter lists of the same model.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

/// `config` trained in one go into `{name}whole`, and into `{name}split` stopped after each of
/// `stops` and resumed to the end; the folders and the step each leg of the split run ended at.
fn whole_and_resumed(
    config: &RunConfig,
    name: &str,
    stops: &[u64],
) -> (PathBuf, PathBuf, Vec<u64>) {
    let whole = out_dir(&format!("{name}whole"));
    train_lm(config.clone(), &Launch::new(&whole)).unwrap();
    let split = out_dir(&format!("{name}split"));
    let legs = stops
        .iter()
        .map(|&stop| Some(stop))
        .chain([None])
        .enumerate()
        .map(|(i, stop_after)| {
            let launch = Launch {
                resume: i > 0,
                stop_after,
                ..Launch::new(&split)
            };
            train_lm(config.clone(), &launch).unwrap().step
        })
        .collect();
    (whole, split, legs)
}

#[test]
fn resumed_run_ends_with_the_parameters_of_an_uninterrupted_one() {
    let _rng = rng_lock();
    let mut config = tiny();
    config.training.max_steps = 30;
    config.training.checkpoint_interval = 10;
    config.training.eval_interval = 30;
    config.training.grad_accum = 2;
    config.model.dropout = 0.1;

    let (whole, split, legs) = whole_and_resumed(&config, "", &[10, 20]);
    assert_eq!(legs, [10, 20, 30]);

    let (a, b) = (params(&whole), params(&split));
    let diff = max_diff(&a, &b);
    assert_eq!(diff, 0.0, "resumed parameters differ by up to {diff}");
    // The metrics of the split run were stitched, not duplicated.
    let steps: Vec<u64> = ember_train::metrics::read(&split.join("metrics.jsonl"))
        .iter()
        .filter(|r| r.kind == "log")
        .map(|r| r.step)
        .collect();
    assert_eq!(steps, vec![10, 20, 30]);
    let _ = std::fs::remove_dir_all(whole);
    let _ = std::fs::remove_dir_all(split);
}

#[test]
fn checkpoint_round_trip_reproduces_logits() {
    let _rng = rng_lock();
    let out = out_dir("roundtrip");
    let mut config = tiny();
    config.training.max_steps = 5;
    train_lm(config, &Launch::new(&out)).unwrap();
    let device = Device::flex();
    let lm = load_lm(&out, &device).unwrap();
    let dir = out.join("copy");
    std::fs::create_dir_all(&dir).unwrap();
    lm.model.clone().save_file(dir.join("model.bpk")).unwrap();
    let fresh = lm.config.model.init(&device).unwrap();
    let again = ember_train::checkpoint::load_model(fresh, &dir).unwrap();
    let x = Tensor::<2, Int>::from_ints([[1, 2, 3, 4, 5]], &device);
    let diff = (lm.model.forward(x.clone()) - again.forward(x))
        .abs()
        .max()
        .into_scalar::<f32>();
    assert_eq!(diff, 0.0);
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn corpus_shorter_than_a_window_is_a_clear_error() {
    let _rng = rng_lock();
    let dir = out_dir("short");
    std::fs::create_dir_all(&dir).unwrap();
    let corpus = dir.join("short.txt");
    std::fs::write(&corpus, "To be, or not to be").unwrap();
    let mut config = tiny();
    config.data.path = corpus;
    let err = train_lm(config, &Launch::new(dir.join("run")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("short.txt") && err.contains("tokens"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Data-parallel training over two CPU workers (`flex,flex`: two threads, each with its own
/// fork of the model) ends with exactly the parameters of the same run on one device: the
/// micro-batches are the same and their gradients are summed in the same order.
#[test]
fn two_devices_train_like_one() {
    let _rng = rng_lock();
    let mut config = tiny();
    config.training.max_steps = 12;
    config.training.checkpoint_interval = 12;
    config.training.eval_interval = 12;
    config.training.grad_accum = 4;
    config.model.dropout = 0.0;

    let one = out_dir("one-device");
    train_lm(config.clone(), &Launch::new(&one)).unwrap();
    let two = out_dir("two-devices");
    let summary = train_lm(
        config.clone(),
        &Launch {
            device: Some("flex,flex".into()),
            ..Launch::new(&two)
        },
    )
    .unwrap();
    assert_eq!(summary.step, 12);
    let (a, b) = (params(&one), params(&two));
    let diff = max_diff(&a, &b);
    assert_eq!(diff, 0.0, "two-device parameters differ by up to {diff}");
    // The training moved the weights (a two-device run that skipped its updates would not).
    let start = out_dir("start");
    let mut frozen = config.clone();
    frozen.training.max_steps = 1;
    frozen.training.lr = 1e-12;
    frozen.training.min_lr = 0.0;
    train_lm(frozen, &Launch::new(&start)).unwrap();
    let moved = max_diff(&params(&start), &b);
    assert!(moved > 1e-3, "parameters moved by only {moved}");

    // Micro-batches are whole: grad_accum must be a multiple of the device count.
    config.training.grad_accum = 3;
    let err = train_lm(
        config,
        &Launch {
            device: Some("flex,flex".into()),
            ..Launch::new(out_dir("uneven"))
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("training.grad_accum") && err.contains("multiple of the 2 devices"),
        "{err}"
    );
    for dir in [one, two, start] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn bf16_products_learn_like_f32_and_train_f32_weights() {
    let _rng = rng_lock();
    let run = |precision: Precision, out: &Path| {
        let mut config = tiny();
        config.training.precision = precision;
        train_lm(config, &Launch::new(out)).unwrap()
    };
    let (f32_out, bf16_out) = (out_dir("f32"), out_dir("bf16"));
    let exact = run(Precision::F32, &f32_out).val_loss.unwrap();
    let mixed = run(Precision::Bf16, &bf16_out).val_loss.unwrap();
    assert!(mixed < 2.75, "bf16 val loss {mixed} after 300 steps");
    assert!(
        (mixed - exact).abs() < 0.02,
        "bf16 val loss {mixed} against f32 {exact}"
    );
    // The runs differ (the products were rounded), and the saved weights are f32 ones: bf16
    // keeps only the top 16 bits of an f32, and most updated weights use the lower ones too.
    let (a, b) = (params(&f32_out), params(&bf16_out));
    assert!(max_diff(&a, &b) > 1e-4);
    let below_bf16 = b.iter().filter(|x| x.to_bits() & 0xffff != 0).count();
    assert!(
        below_bf16 > b.len() / 2,
        "only {below_bf16} of {} weights use f32's lower bits",
        b.len()
    );

    // A bf16 run resumes exactly too.
    let mut config = tiny();
    config.training.precision = Precision::Bf16;
    config.training.max_steps = 20;
    config.training.checkpoint_interval = 10;
    config.training.eval_interval = 20;
    config.training.grad_accum = 2;
    config.model.dropout = 0.1;
    let (whole, split, _) = whole_and_resumed(&config, "bf16-", &[10]);
    assert_eq!(max_diff(&params(&whole), &params(&split)), 0.0);
    for dir in [f32_out, bf16_out, whole, split] {
        let _ = std::fs::remove_dir_all(dir);
    }
}
