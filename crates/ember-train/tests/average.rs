//! Checkpoint averaging on a tiny language-model run: the written weights are the mean of the
//! chosen checkpoints' weights, and bad requests are clear errors.

use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};
use ember_train::average::average_checkpoints;
use ember_train::{Launch, RunConfig, load_lm, train_lm};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-average-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A 30-step tiny run that keeps its checkpoints of steps 10, 20 and 30.
fn run() -> PathBuf {
    let mut config = RunConfig::load(&repo().join("configs/tiny.toml")).unwrap();
    config.data.path = repo().join("data/tinyshakespeare.txt");
    config.training.max_steps = 30;
    config.training.checkpoint_interval = 10;
    config.training.eval_interval = 30;
    config.training.keep_checkpoints = 3;
    let out = temp("run");
    train_lm(config, &Launch::new(&out)).unwrap();
    out
}

fn step(run: &Path, n: u64) -> PathBuf {
    run.join(format!("checkpoints/step-{n:07}"))
}

/// Every parameter of the checkpoint `dir`, flattened, in f64.
fn params(dir: &Path) -> Vec<f64> {
    struct Collect(Vec<f64>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let values = p.val().try_into_vec_as::<f32>().unwrap();
            self.0.extend(values.into_iter().map(f64::from));
        }
    }
    let mut collect = Collect(Vec::new());
    load_lm(dir, &Device::flex())
        .unwrap()
        .model
        .visit(&mut collect);
    collect.0
}

/// Checks that the checkpoint `averaged` holds the element-wise mean of `sources`.
fn assert_mean(averaged: &Path, sources: &[PathBuf]) {
    let all: Vec<Vec<f64>> = sources.iter().map(|d| params(d)).collect();
    let got = params(averaged);
    assert_eq!(got.len(), all[0].len());
    let mut worst = 0.0f64;
    for (i, value) in got.iter().enumerate() {
        let want = all.iter().map(|p| p[i]).sum::<f64>() / all.len() as f64;
        worst = worst.max((value - want).abs());
    }
    assert!(worst < 1e-6, "largest difference from the mean: {worst}");
    // Training moved the weights, so the mean is not any one of them.
    assert!(all[0].iter().zip(&all[1]).any(|(a, b)| a != b));
}

#[test]
fn averages_the_chosen_checkpoints_and_rejects_bad_requests() {
    let run = run();
    let device = Device::flex();

    // The newest two of a run folder.
    let out = temp("last2");
    let avg = average_checkpoints(std::slice::from_ref(&run), Some(2), &out, &device).unwrap();
    let steps: Vec<u64> = avg.sources.iter().map(|(_, s)| *s).collect();
    assert_eq!(steps, [20, 30]);
    assert_mean(&out, &[step(&run, 20), step(&run, 30)]);
    let lm = load_lm(&out, &device).unwrap();
    assert_eq!(lm.step, 30);
    // The newest checkpoint's files (config, vocabulary), without optimizer state.
    let names = |dir: &Path| {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n != "optim.bpk")
            .collect();
        names.sort();
        names
    };
    assert_eq!(names(&avg.dir), names(&step(&run, 30)));
    assert!(avg.dir.join("chars.json").is_file());

    // Checkpoint folders named one by one, in any order.
    let out3 = temp("three");
    let picked = [step(&run, 30), step(&run, 10)];
    average_checkpoints(&picked, None, &out3, &device).unwrap();
    assert_mean(&out3, &[step(&run, 10), step(&run, 30)]);

    let err = |inputs: &[PathBuf], last: Option<usize>, out: &Path| {
        average_checkpoints(inputs, last, out, &device)
            .unwrap_err()
            .to_string()
    };
    let fresh = temp("fresh");
    let e = err(std::slice::from_ref(&run), None, &out);
    assert!(e.contains("already exists") && e.contains("--out"), "{e}");
    let e = err(std::slice::from_ref(&run), Some(4), &fresh);
    assert!(e.contains("--last 4") && e.contains("(3)"), "{e}");
    let e = err(&[step(&run, 20)], None, &fresh);
    assert!(e.contains("at least two checkpoints, found 1"), "{e}");
    let e = err(&[run.join("nope")], None, &fresh);
    assert!(e.contains("no such folder"), "{e}");

    // A checkpoint of another architecture is named, not averaged.
    let other = temp("other");
    std::fs::create_dir_all(&other).unwrap();
    for entry in std::fs::read_dir(step(&run, 10)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, other.join(path.file_name().unwrap())).unwrap();
    }
    let config = std::fs::read_to_string(other.join("config.toml")).unwrap();
    let edited = config.replacen("n_layers = ", "n_layers = 1", 1);
    assert_ne!(config, edited);
    std::fs::write(other.join("config.toml"), edited).unwrap();
    let e = err(&[other.clone(), step(&run, 30)], None, &fresh);
    assert!(e.contains("[model] config differs"), "{e}");
    assert!(!fresh.exists(), "a refused average writes nothing");

    for dir in [run, out, out3, other] {
        let _ = std::fs::remove_dir_all(dir);
    }
}
