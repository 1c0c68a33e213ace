//! The GPU code path without a GPU: Burn's wgpu backend on a software Vulkan adapter (Mesa's
//! lavapipe in CI). A few training steps and a generation must match the CPU backend.
//! Built only with `--features wgpu`:
//!
//! ```text
//! apt-get install mesa-vulkan-drivers libvulkan1
//! cargo test --release -p ember-cli --features wgpu --test wgpu
//! ```
#![cfg(feature = "wgpu")]

mod common;

use std::path::Path;

use common::{assert_clear_error, ember, ember_ok, repo, temp};

/// A run's metrics records of `kind` (`log`, `eval`).
fn records(run: &Path, kind: &str) -> Vec<ember_train::metrics::Record> {
    let all = ember_train::metrics::read(&run.join("metrics.jsonl"));
    all.into_iter().filter(|r| r.kind == kind).collect()
}

/// Train losses logged by a run.
fn losses(run: &Path) -> Vec<f64> {
    records(run, "log").iter().map(|r| r.train_loss).collect()
}

/// The validation losses of a run's evaluations.
fn val_losses(run: &Path) -> Vec<f64> {
    records(run, "eval")
        .iter()
        .filter_map(|r| r.val_loss)
        .collect()
}

fn eval_loss(run: &Path, device: &str, text: &Path) -> f64 {
    let out = ember_ok(&[
        "eval",
        "--checkpoint",
        run.to_str().unwrap(),
        "--data",
        text.to_str().unwrap(),
        "--device",
        device,
        "--json",
    ]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json["loss"].as_f64().unwrap()
}

/// 80 greedy tokens (the context is 32: the cache is rebuilt on the way), and the summary line
/// of stderr.
fn greedy(run: &Path, device: &str) -> (String, String) {
    let mut args = vec!["generate", "--checkpoint", run.to_str().unwrap()];
    args.extend(["--prompt", "ROMEO:", "--greedy", "--max-tokens", "80"]);
    args.extend(["--device", device]);
    let out = ember_ok(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let summary = stderr.lines().last().unwrap_or_default().to_string();
    (String::from_utf8(out.stdout).unwrap(), summary)
}

/// The steps replayed and captured that `ember generate`'s summary line reports.
fn replays(summary: &str) -> Option<(usize, usize)> {
    let (_, rest) = summary.split_once("tokens chosen on the device, ")?;
    let mut words = rest.split_whitespace();
    let replays = words.next()?.parse().ok()?;
    let captures = words.nth(3)?.parse().ok()?;
    Some((replays, captures))
}

#[test]
fn wgpu_trains_and_generates_like_the_cpu() {
    let dir = temp("wgpu");
    // The start run sets the model; the tuning runs take it from there (--init-from).
    let config = |name: &str, steps: u32, model: &str| {
        let path = dir.join(name);
        std::fs::write(
            &path,
            format!(
                "{model}[data]\npath = {:?}\n\
                 [training]\nbatch_size = 8\nmax_steps = {steps}\nlog_interval = 5\neval_interval = 20\n\
                 eval_batches = 3\ncheckpoint_interval = 20\nlr = 3e-3\nwarmup_steps = 5\n",
                repo().join("data/tinyshakespeare.txt").to_str().unwrap()
            ),
        )
        .unwrap();
        path.to_str().unwrap().to_string()
    };
    // Random initialisation differs between backends (each has its own generator), so both
    // runs start from the same weights: one step on the CPU, then --init-from.
    let start = dir.join("start");
    let model = "[model]\nd_model = 32\nn_heads = 2\nn_layers = 2\ncontext_len = 32\n";
    ember_ok(&[
        "train",
        "--config",
        &config("start.toml", 1, model),
        "--out",
        start.to_str().unwrap(),
    ]);
    let tune = config("tune.toml", 20, "");
    let (cpu, gpu) = (dir.join("flex"), dir.join("wgpu"));
    // `ember train` of the tuning config from the start run into `run` on `device`.
    let tune_on = |run: &Path, device: &str, extra: &[&str]| {
        let (start, run) = (start.to_str().unwrap(), run.to_str().unwrap());
        let mut args = vec!["train", "--config", &tune, "--init-from", start];
        args.extend(["--out", run, "--device", device]);
        args.extend(extra);
        ember(&args)
    };
    // The GPU run profiles its last 5 steps: that must not change what it computes.
    let mut profile = String::new();
    for (run, device, extra) in [
        (&cpu, "flex", &[][..]),
        (&gpu, "wgpu", &["--profile-steps", "5"][..]),
    ] {
        let out = tune_on(run, device, extra);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "ember train on {device} failed: {stderr}"
        );
        if device == "wgpu" {
            profile = stderr.to_string();
        }
    }
    assert_kernel_profile(&profile);
    assert_device_memory(&profile);
    // Tolerance: f32 sums in another order, compounded over 20 AdamW steps.
    let (a, b) = (losses(&cpu), losses(&gpu));
    assert_eq!(a.len(), 4);
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    eprintln!("train losses flex {a:?}, wgpu {b:?}: largest difference {worst:e}");
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < 1e-4, "flex {a:?} vs wgpu {b:?}");
    }
    // Its evaluations (3 batches a split: on wgpu two of them replay the first's recorded pass).
    let (a_val, b_val) = (val_losses(&cpu), val_losses(&gpu));
    assert_eq!(a_val.len(), 1, "{a_val:?}");
    assert!(
        (a_val[0] - b_val[0]).abs() < 1e-4,
        "flex {a_val:?} vs wgpu {b_val:?}"
    );
    // The CPU-trained checkpoint runs on the GPU backend: same loss, same greedy text.
    let text = dir.join("text.txt");
    std::fs::write(&text, "ROMEO:\nWhat light through yonder window breaks?\n").unwrap();
    // And a longer text: 4 batches of 16 windows of 32 (on wgpu three replay the first's pass),
    // a smaller batch and a shorter window.
    let long = dir.join("long.txt");
    let shakespeare = std::fs::read_to_string(repo().join("data/tinyshakespeare.txt")).unwrap();
    std::fs::write(&long, &shakespeare[..32 * 16 * 4 + 32 * 3 + 20]).unwrap();
    for text in [&text, &long] {
        let (x, y) = (eval_loss(&cpu, "flex", text), eval_loss(&cpu, "wgpu", text));
        eprintln!("eval loss flex {x}, wgpu {y}");
        assert!((x - y).abs() < 1e-5, "eval loss flex {x} vs wgpu {y}");
    }
    // (On the GPU the greedy tokens are chosen on the device and read in bursts: ember-infer's
    // wgpu tests hold that path to the host's on varied text; this one's is mostly spaces.)
    let ((host, _), (device, summary)) = (greedy(&cpu, "flex"), greedy(&cpu, "wgpu"));
    assert_eq!(host, device);
    // Most of the 80 steps replay a captured one: one capture per window of the cache (the
    // context is 32) and per growth of its buffers, and the steps before each capture run.
    let (replayed, captured) = replays(&summary).unwrap_or_else(|| panic!("{summary}"));
    assert!(replayed >= 40 && captured >= 1, "{summary}");
    // bf16 products: trained where the adapter has bf16, else refused in one line (lavapipe).
    let mixed = dir.join("bf16");
    let out = tune_on(&mixed, "wgpu", &["--set", "training.precision=\"bf16\""]);
    if out.status.success() {
        let c = losses(&mixed);
        assert!((c[3] - a[3]).abs() < 0.05, "bf16 {c:?} vs f32 {a:?}");
    } else {
        assert_clear_error(&out, &["training.precision", "`wgpu`", "bf16"]);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Pythia's block (attention and MLP side by side, a quarter of each head rotated) on the GPU
/// path: the `tiny-pythia` fixture (made with transformers) scores a text, decodes greedily
/// (replayed steps read the rotation's tables, as wide as the part it turns) and trains a few
/// steps as on the CPU.
#[test]
fn a_pythia_model_scores_decodes_and_trains_on_wgpu_as_on_the_cpu() {
    scores_decodes_and_trains_as_on_the_cpu("tiny-pythia");
}

/// LLaMA's block (RMSNorm, SwiGLU, 4 query heads sharing 2 key/value heads) on the GPU path, the
/// `tiny-llama` fixture, the same way.
#[test]
fn a_llama_model_scores_decodes_and_trains_on_wgpu_as_on_the_cpu() {
    scores_decodes_and_trains_as_on_the_cpu("tiny-llama");
}

/// The Hugging Face fixture `name` scores a text, decodes greedily and trains 10 steps on wgpu
/// as on flex.
fn scores_decodes_and_trains_as_on_the_cpu(name: &str) {
    let fixture = repo().join("crates/ember-train/tests/fixtures").join(name);
    let dir = temp(&format!("wgpu-{name}"));
    let text = dir.join("text.txt");
    std::fs::write(&text, "ROMEO:\nWhat light through yonder window breaks?\n").unwrap();
    let (x, y) = (
        eval_loss(&fixture, "flex", &text),
        eval_loss(&fixture, "wgpu", &text),
    );
    assert!((x - y).abs() < 1e-5, "eval loss flex {x} vs wgpu {y}");
    let ((host, _), (device, summary)) = (greedy(&fixture, "flex"), greedy(&fixture, "wgpu"));
    assert_eq!(host, device, "{summary}");
    let config = dir.join("tune.toml");
    std::fs::write(
        &config,
        format!(
            "[data]\npath = {:?}\n[training]\nbatch_size = 4\nmax_steps = 10\nlog_interval = 5\n\
             eval_interval = 10\neval_batches = 2\ncheckpoint_interval = 10\nlr = 1e-3\n",
            repo().join("data/tinyshakespeare.txt").to_str().unwrap()
        ),
    )
    .unwrap();
    let mut losses_on = Vec::new();
    for device in ["flex", "wgpu"] {
        let run = dir.join(device);
        ember_ok(&[
            "train",
            "--config",
            config.to_str().unwrap(),
            "--init-from",
            fixture.to_str().unwrap(),
            "--out",
            run.to_str().unwrap(),
            "--device",
            device,
        ]);
        losses_on.push(losses(&run));
    }
    let (a, b) = (&losses_on[0], &losses_on[1]);
    assert_eq!(a.len(), 2);
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-4, "flex {a:?} vs wgpu {b:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The GPU run's memory line: its allocator holds at least the weights and AdamW's two moments
/// at the end (f32 each), and the peak is at least what is reserved, which is at least what is
/// in use; before a backward pass more was live than at the end (a forward pass's saved
/// activations besides the weights and moments).
fn assert_device_memory(stderr: &str) {
    let number_after = |prefix: &str| -> f64 {
        let at = stderr
            .find(prefix)
            .unwrap_or_else(|| panic!("no `{prefix}` in: {stderr}"));
        let rest = stderr[at + prefix.len()..].trim_start();
        let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == ','));
        rest[..end.unwrap_or(rest.len())]
            .replace(',', "")
            .parse()
            .unwrap()
    };
    let params = number_after("total parameters");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("GPU memory: "))
        .unwrap_or_else(|| panic!("no GPU memory line in: {stderr}"));
    let mib: Vec<f64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let [peak, reserved, in_use, live] = mib[..] else {
        panic!("expected four figures in `{line}`")
    };
    let weights_and_moments = 3.0 * 4.0 * params / (1 << 20) as f64;
    assert!(
        in_use >= weights_and_moments - 0.05,
        "{line}: less in use than the weights and moments ({weights_and_moments:.2} MiB)"
    );
    assert!(peak >= reserved && reserved >= in_use, "{line}");
    assert!(live > in_use, "{line}");
}

/// The kernel profile of the last 5 of 20 steps of a 2-layer model (one micro-batch per step):
/// each layer launches ember's attention kernels once per step, forward and backward, and the
/// matrix products are counted.
fn assert_kernel_profile(stderr: &str) {
    let at = stderr
        .find("kernel profile, steps 16-20 (5 steps")
        .unwrap_or_else(|| panic!("no kernel profile of steps 16-20 in: {stderr}"));
    let table = at + stderr[at..].find("  share ").expect("a kernel table");
    // share, ms/step, launches/step, us/launch, part, kernel
    let rows: Vec<(f64, f64, &str, &str)> = stderr[table..]
        .lines()
        .skip(1)
        .take_while(|l| l.contains('%'))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let share: f64 = f[0].trim_end_matches('%').parse().unwrap();
            (share, f[2].parse().unwrap(), f[4], f[5])
        })
        .collect();
    eprintln!("{}", &stderr[at..]);
    let launches = |name: &str| {
        let of: Vec<_> = rows.iter().filter(|r| r.3 == name).collect();
        assert!(
            of.iter().all(|r| r.2 == "fwd+bwd"),
            "{name} outside fwd+bwd: {rows:?}"
        );
        of.iter().map(|r| r.1).reduce(|a, b| a + b)
    };
    // One launch per layer (two layers), the keys' and the values' gradients one each.
    for (kernel, per_layer) in [
        ("AttentionForward", 1.0),
        ("AttentionBackwardQuery", 1.0),
        ("AttentionBackwardKeyValue", 2.0),
    ] {
        assert_eq!(
            launches(kernel),
            Some(2.0 * per_layer),
            "{kernel} per step: {rows:?}"
        );
    }
    // Four products per layer and the head, each with two more in its backward pass.
    assert_eq!(
        launches("MatmulEntry"),
        Some(3.0 * (4.0 * 2.0 + 1.0)),
        "{rows:?}"
    );
    // AdamW three parameters to a launch: the 10 matrices (4 a layer, the two tables) in 4, the
    // 18 biases and gains (no weight decay: other scalars) in 6.
    let adamw: Vec<_> = rows.iter().filter(|r| r.3.starts_with("Adamw")).collect();
    assert!(
        adamw.iter().all(|r| r.3 == "AdamwSteps" && r.2 == "optim"),
        "{rows:?}"
    );
    assert_eq!(adamw.iter().map(|r| r.1).sum::<f64>(), 10.0, "{rows:?}");
    // Clipping: the 28 gradients' squares in 4 launches of 8, one more for the norm and factor.
    let clip: f64 = rows.iter().filter(|r| r.2 == "clip").map(|r| r.1).sum();
    assert_eq!(clip, 5.0, "{rows:?}");
    // The optimizer and the clipping launch kernels of their own (no matrix products).
    for part in ["clip", "optim"] {
        assert!(
            rows.iter().any(|r| r.2 == part),
            "no {part} kernels: {rows:?}"
        );
    }
    let total: f64 = rows.iter().map(|r| r.0).sum();
    assert!(
        (total - 100.0).abs() < 0.5,
        "shares sum to {total}: {rows:?}"
    );
}
