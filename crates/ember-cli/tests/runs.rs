//! Living with run folders: a second run into a folder is refused unless it resumes or
//! overwrites; one process at a time; Ctrl-C/SIGTERM saves and resumes exactly; `--set`
//! overrides; the best checkpoint, `--best` and early stopping; plain log lines in a pipe.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_clear_error, ember, ember_ok, interrupted_step, params, repo, signal, temp};
use ember_train::checkpoint;

/// A tiny model that trains in well under a second per dozen steps.
fn config(dir: &Path, training: &str) -> String {
    let corpus = repo().join("data/tinyshakespeare.txt");
    let path = dir.join("run.toml");
    std::fs::write(
        &path,
        format!(
            "[model]\nd_model = 32\nn_heads = 2\nn_layers = 2\ncontext_len = 32\n\
             [data]\npath = {:?}\n\
             [training]\nbatch_size = 4\neval_batches = 2\n{training}",
            corpus.to_str().unwrap()
        ),
    )
    .unwrap();
    path.to_str().unwrap().to_string()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

fn metrics(run: &Path) -> Vec<ember_train::metrics::Record> {
    ember_train::metrics::read(&run.join("metrics.jsonl"))
}

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .current_dir(repo())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until `run` has a checkpoint of at least `step` (or the child ends).
fn wait_for_checkpoint(child: &mut Child, run: &Path, step: u64) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(120) {
        if let Ok(dir) = checkpoint::resolve(run)
            && checkpoint::read_state(&dir).is_ok_and(|s| s.step >= step)
        {
            return;
        }
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("no checkpoint of step {step} within 120 s");
}

#[test]
fn a_second_run_into_a_folder_is_refused_unless_it_resumes_or_overwrites() {
    let dir = temp("reuse");
    let cfg = config(
        &dir,
        "max_steps = 30\ncheckpoint_interval = 10\nkeep_checkpoints = 2\neval_interval = 30\nlog_interval = 10\n",
    );
    let run = dir.join("R");
    let r = run.to_str().unwrap();
    ember_ok(&["train", "--config", &cfg, "--out", r]);
    let first_metrics = metrics(&run);
    let first_params = params(&run);

    // The same command again: refused, nothing touched.
    let out = ember(&["train", "--config", &cfg, "--out", r]);
    assert_clear_error(&out, &[r, "already holds a run", "--resume", "--overwrite"]);
    assert_eq!(metrics(&run), first_metrics, "metrics.jsonl was touched");
    assert!(params(&run) == first_params);

    // Resumed at or past its max_steps: nothing trains, and a note says how to go on.
    let out = ember_ok(&["train", "--config", &cfg, "--out", r, "--resume"]);
    assert!(
        stderr(&out).contains("at step 30 already, training.max_steps = 30: nothing to train"),
        "{}",
        stderr(&out)
    );
    assert!(params(&run) == first_params);

    // The case that used to go wrong: a shorter run whose step numbers are below the old
    // checkpoints'. With --overwrite the old run is removed first and says so; `latest` names
    // the new run's checkpoint, which exists, and commands are served the new model.
    let out = ember_ok(&[
        "train",
        "--config",
        &cfg,
        "--out",
        r,
        "--overwrite",
        "--set",
        "training.max_steps=6",
        "--set",
        "training.checkpoint_interval=2",
    ]);
    assert!(
        stderr(&out).contains("--overwrite: removed the earlier run"),
        "{}",
        stderr(&out)
    );
    let latest = checkpoint::resolve(&run).unwrap();
    assert!(latest.ends_with("step-0000006"), "{}", latest.display());
    let steps: Vec<String> = std::fs::read_dir(run.join(checkpoint::CHECKPOINTS))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert!(
        steps.iter().all(|s| s.as_str() <= "step-0000006"),
        "the old run's checkpoints remain: {steps:?}"
    );
    let out = ember_ok(&[
        "generate",
        "--checkpoint",
        r,
        "--prompt",
        "A",
        "--max-tokens",
        "3",
        "--greedy",
    ]);
    assert!(stderr(&out).contains("(step 6)"), "{}", stderr(&out));
    let records = metrics(&run);
    assert_eq!(records.last().unwrap().step, 6);
    assert!(
        records.iter().all(|r| r.step <= 6),
        "the old run's metrics remain"
    );

    // --resume and --overwrite together are a usage error.
    let out = ember(&[
        "train",
        "--config",
        &cfg,
        "--out",
        r,
        "--resume",
        "--overwrite",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn two_processes_never_train_into_one_folder_and_a_killed_one_leaves_no_lock() {
    let dir = temp("lock");
    let cfg = config(
        &dir,
        "max_steps = 100000\ncheckpoint_interval = 5\neval_interval = 100000\nlog_interval = 5\n",
    );
    let run = dir.join("R");
    let r = run.to_str().unwrap();
    let mut first = spawn(&["train", "--config", &cfg, "--out", r]);
    wait_for_checkpoint(&mut first, &run, 5);
    let out = ember(&["train", "--config", &cfg, "--out", r, "--resume"]);
    assert_clear_error(&out, &[r, "in use", &first.id().to_string()]);
    first.kill().unwrap(); // SIGKILL: no chance to clean up
    first.wait().unwrap();
    // The lock died with the process: a resume now starts (stopped after one more step).
    let out = ember_ok(&[
        "train",
        "--config",
        &cfg,
        "--out",
        r,
        "--resume",
        "--set",
        "training.max_steps=6",
    ]);
    assert!(stderr(&out).contains("resuming from"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(dir);
}

#[cfg(unix)]
#[test]
fn sigterm_saves_a_checkpoint_and_the_resumed_run_ends_identical() {
    let dir = temp("sigterm");
    // Long enough that the signal lands mid-run on a fast machine (a step of this model can
    // take well under a millisecond).
    let cfg = config(
        &dir,
        "max_steps = 3000\ncheckpoint_interval = 10000\neval_interval = 500\nlog_interval = 7\n\
         keep_checkpoints = 1\n",
    );
    let whole = dir.join("whole");
    ember_ok(&["train", "--config", &cfg, "--out", whole.to_str().unwrap()]);

    let run = dir.join("stopped");
    let r = run.to_str().unwrap();
    let mut child = spawn(&["train", "--config", &cfg, "--out", r]);
    // The first evaluation (step 500) saves the best checkpoint; stop some steps after it.
    wait_for_checkpoint(&mut child, &run, 500);
    std::thread::sleep(Duration::from_millis(150));
    signal(&child.id().to_string(), "TERM");
    let out = child.wait_with_output().unwrap();
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(143), "{text}");
    let (step, line) = interrupted_step(&text);
    assert!((500..3000).contains(&step), "{line}");
    assert!(
        text.contains("continue with: ember train") && text.contains("--resume"),
        "{text}"
    );
    let saved = checkpoint::resolve(&run).unwrap();
    assert_eq!(checkpoint::read_state(&saved).unwrap().step, step);
    assert!(
        run.join("loss.png").is_file(),
        "the plot is drawn on the way out"
    );

    ember_ok(&["train", "--config", &cfg, "--out", r, "--resume"]);
    assert!(
        params(&whole) == params(&run),
        "the resumed run's parameters differ"
    );
    let evals = |run: &Path| -> Vec<(u64, Option<f64>)> {
        metrics(run)
            .into_iter()
            .filter(|r| r.kind == "eval")
            .map(|r| (r.step, r.val_loss))
            .collect()
    };
    assert_eq!(evals(&whole), evals(&run));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn overrides_are_checked_like_the_file_and_saved_with_the_run() {
    let dir = temp("set");
    let cfg = config(
        &dir,
        "max_steps = 4\ncheckpoint_interval = 4\neval_interval = 4\n",
    );
    let run = dir.join("R");
    let r = run.to_str().unwrap();
    ember_ok(&[
        "train",
        "--config",
        &cfg,
        "--out",
        r,
        "--set",
        "training.max_steps=3",
        "--set",
        "model.n_layers=1",
        "--set",
        "training.lr=3e-4",
    ]);
    let saved = checkpoint::resolve(&run).unwrap();
    assert_eq!(checkpoint::read_state(&saved).unwrap().step, 3);
    let resolved = ember_train::RunConfig::load(&saved.join(checkpoint::CONFIG_FILE)).unwrap();
    assert_eq!(resolved.model.n_layers, 1);
    assert_eq!(resolved.training.lr, 3e-4);
    assert_eq!(resolved.training.max_steps, 3);

    let fresh = dir.join("fresh");
    let f = fresh.to_str().unwrap();
    for (set, needles) in [
        (
            "training.lrr=1",
            vec!["--set training.lrr=1", "unknown field `lrr`"],
        ),
        (
            "training.batch_size=0",
            vec!["--set training.batch_size=0", "training.batch_size"],
        ),
        (
            "training.lr",
            vec!["--set training.lr", "section.key=value"],
        ),
        ("model.n_heads=3", vec!["--set model.n_heads=3", "n_heads"]),
    ] {
        let out = ember(&["train", "--config", &cfg, "--out", f, "--set", set]);
        assert_clear_error(&out, &needles);
        assert_eq!(out.status.code(), Some(1));
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_best_checkpoint_is_kept_and_early_stopping_ends_a_stalled_run() {
    let dir = temp("best");
    let cfg = config(
        &dir,
        "max_steps = 40\ncheckpoint_interval = 40\nkeep_checkpoints = 1\neval_interval = 10\n\
         log_interval = 5\n",
    );
    let run = dir.join("R");
    let r = run.to_str().unwrap();
    let out = ember_ok(&["train", "--config", &cfg, "--out", r]);
    let text = stderr(&out);
    // Off a terminal: one plain line per log_interval.
    let lines = text
        .lines()
        .filter(|l| l.trim_start().starts_with("step") && l.contains(", lr "))
        .count();
    assert_eq!(lines, 8, "{text}");

    let evals: Vec<(u64, f64)> = metrics(&run)
        .into_iter()
        .filter_map(|r| r.val_loss.map(|v| (r.step, v)))
        .collect();
    assert_eq!(evals.len(), 4);
    let (best_step, best_loss) = evals
        .iter()
        .copied()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap();
    let best = checkpoint::resolve_best(&run).unwrap();
    let state = checkpoint::read_state(&best).unwrap();
    assert_eq!((state.step, state.val_loss), (best_step, Some(best_loss)));
    assert!(
        text.contains(&format!("best: {}", best.display())),
        "{text}"
    );
    // The summary's share of the evaluations and the saves: each improvement before step 40
    // saved, and step 40 saved by its interval.
    let improved_before_40 = evals
        .iter()
        .enumerate()
        .filter(|(i, (step, v))| *step < 40 && evals[..*i].iter().all(|(_, u)| v < u))
        .count();
    let done = text.lines().find(|l| l.starts_with("done: ")).unwrap();
    assert!(done.contains("; of which 4 evaluations "), "{done}");
    let saves = format!(", {} checkpoints ", improved_before_40 + 1);
    assert!(done.contains(&saves), "{done}");
    let out = ember_ok(&[
        "generate",
        "--checkpoint",
        r,
        "--best",
        "--prompt",
        "A",
        "--max-tokens",
        "2",
    ]);
    assert!(
        stderr(&out).contains(&format!("(step {best_step})")),
        "{}",
        stderr(&out)
    );
    let out = ember_ok(&["eval", "--checkpoint", r, "--best", "--split", "val"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("loss"));
    let out = ember(&[
        "generate",
        "--checkpoint",
        best.to_str().unwrap(),
        "--best",
        "--prompt",
        "A",
    ]);
    assert_clear_error(&out, &["run folder"]);

    // A learning rate too small to move any weight: the validation loss never improves on
    // the first evaluation, so patience 2 stops the run at the third.
    let stalled = dir.join("stalled");
    let s = stalled.to_str().unwrap();
    let out = ember_ok(&[
        "train",
        "--config",
        &cfg,
        "--out",
        s,
        "--set",
        "training.lr=1e-30",
        "--set",
        "training.min_lr=0",
        "--set",
        "training.early_stop_patience=2",
        "--set",
        "training.max_steps=1000",
    ]);
    let text = stderr(&out);
    assert!(text.contains("early stop"), "{text}");
    assert_eq!(
        checkpoint::read_state(&checkpoint::resolve(&stalled).unwrap())
            .unwrap()
            .step,
        30
    );
    assert!(
        checkpoint::resolve_best(&stalled)
            .unwrap()
            .ends_with("step-0000010")
    );
    assert_eq!(metrics(&stalled).last().unwrap().step, 30);
    let _ = std::fs::remove_dir_all(dir);
}

/// `ember prepare --config` tokenizes the config's corpus with its tokenizer settings, and
/// `ember train` with `data.path` set to the folder trains, stops and resumes to the
/// parameters of an uninterrupted run on the text.
#[test]
fn a_prepared_corpus_trains_and_resumes_from_the_command_line() {
    let dir = temp("prepared-cli");
    let config = config(
        &dir,
        "max_steps = 12\ncheckpoint_interval = 6\neval_interval = 12\n",
    );
    let folder = dir.join("tokens");
    let out = ember_ok(&[
        "prepare",
        "--config",
        &config,
        "--out",
        folder.to_str().unwrap(),
    ]);
    let said = stderr(&out);
    assert!(said.contains("1115394 tokens (2 bytes each)"), "{said}");
    let tokens = format!("data.path={:?}", folder.to_str().unwrap());
    let text_run = dir.join("text");
    ember_ok(&[
        "train",
        "--config",
        &config,
        "--out",
        text_run.to_str().unwrap(),
    ]);
    let run = dir.join("run");
    let run_s = run.to_str().unwrap();
    ember_ok(&[
        "train",
        "--config",
        &config,
        "--out",
        run_s,
        "--set",
        &tokens,
        "--stop-after",
        "6",
    ]);
    ember_ok(&[
        "train", "--config", &config, "--out", run_s, "--set", &tokens, "--resume",
    ]);
    assert_eq!(params(&run), params(&text_run));
    let _ = std::fs::remove_dir_all(dir);
}

/// `--no-checkpoints` (for benchmarks that time the steps alone) trains and evaluates but
/// writes no checkpoint, not even at the end or where the validation loss improves, and says
/// so; it cannot be combined with `--resume`.
#[test]
fn no_checkpoints_trains_and_evaluates_but_saves_nothing() {
    let dir = temp("no-checkpoints");
    let config = config(
        &dir,
        "max_steps = 6\ncheckpoint_interval = 2\neval_interval = 3\n",
    );
    let run = dir.join("run");
    let run_s = run.to_str().unwrap();
    let out = ember_ok(&[
        "train",
        "--config",
        &config,
        "--out",
        run_s,
        "--no-checkpoints",
    ]);
    let said = stderr(&out);
    assert!(
        said.contains("checkpoint: none (--no-checkpoints)"),
        "{said}"
    );
    assert!(!said.contains("best:"), "{said}");
    assert!(!run.join("checkpoints").exists() && !run.join("latest").exists());
    let evals: Vec<u64> = metrics(&run)
        .iter()
        .filter(|r| r.kind == "eval")
        .map(|r| r.step)
        .collect();
    assert_eq!(evals, [3, 6]);
    let refused = ember(&[
        "train",
        "--config",
        &config,
        "--out",
        run_s,
        "--resume",
        "--no-checkpoints",
    ]);
    assert_clear_error(&refused, &["--no-checkpoints", "--resume"]);
    let _ = std::fs::remove_dir_all(dir);
}
