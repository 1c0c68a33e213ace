//! Training across processes on CPU devices, as a launcher starts them: two processes under
//! Open MPI's `mpirun` (the `mpi` feature) train to the parameters of one process with twice the
//! `grad_accum`, bit for bit; a killed rank ends the other in one line; SIGTERM to one rank
//! stops both at one step with a checkpoint; the run resumes exactly, with two processes or one. Without the feature, a launched process says what
//! it lacks in one line; a rank whose rank 0 never comes gives up after the rendezvous timeout.

mod common;

use std::net::TcpListener;
#[cfg(feature = "mpi")]
use std::path::Path;
#[cfg(feature = "mpi")]
use std::process::Stdio;
use std::process::{Command, Output};
#[cfg(feature = "mpi")]
use std::time::{Duration, Instant};

use common::{assert_clear_error, repo};
#[cfg(feature = "mpi")]
use common::{ember_ok, params, temp};

/// A port nobody listens on now.
fn free_port() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port().to_string()
}

/// The tiny config without dropout (dropout masks are equal too, but this keeps the claim to
/// the sums), `steps` long, with `extra` overrides.
fn tiny(steps: u64, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["train", "--config", "configs/tiny.toml"]
        .map(String::from)
        .to_vec();
    let sets = [
        format!("training.max_steps={steps}"),
        "model.dropout=0".into(),
        "training.eval_interval=500".into(),
    ];
    for set in sets.iter().map(String::as_str).chain(extra.iter().copied()) {
        args.push("--set".into());
        args.push(set.to_string());
    }
    args
}

/// One rank started by hand as `torchrun` would start it (its variables set), without rank 0.
fn lone_rank(port: &str) -> Output {
    let mut args = tiny(4, &[]);
    args.extend([
        "--out".into(),
        std::env::temp_dir()
            .join("ember-lone-rank")
            .display()
            .to_string(),
    ]);
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(&args)
        .current_dir(repo())
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", "1")
        .env("LOCAL_WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port)
        .env("EMBER_RENDEZVOUS_TIMEOUT", "1")
        .output()
        .unwrap()
}

#[cfg(feature = "mpi")]
#[test]
fn a_rank_whose_rank_zero_never_comes_gives_up_in_one_line() {
    let started = std::time::Instant::now();
    let out = lone_rank(&free_port());
    assert_clear_error(
        &out,
        &[
            "rank 1 could not reach rank 0 at 127.0.0.1:",
            "within 1 s",
            "EMBER_RENDEZVOUS_TIMEOUT",
        ],
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
}

#[cfg(not(feature = "mpi"))]
#[test]
fn a_launched_process_without_mpi_says_what_it_lacks() {
    let out = lone_rank(&free_port());
    assert_clear_error(&out, &["across processes needs MPI", "--features mpi"]);
}

/// `mpirun -np N ember ...` with the rendezvous on `port`; ranks not bound to cores, so each
/// process's threads are what one process alone would have.
#[cfg(feature = "mpi")]
fn mpirun(n: usize, port: &str, args: &[String]) -> Command {
    let mut command = Command::new("mpirun");
    command
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
        ])
        .args(["-np", &n.to_string(), "-x", &format!("MASTER_PORT={port}")])
        .arg(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .current_dir(repo());
    command
}

#[cfg(feature = "mpi")]
fn with_out(mut args: Vec<String>, out: &Path) -> Vec<String> {
    args.extend(["--out".into(), out.display().to_string()]);
    args
}

/// `args` with `--set key=value`.
#[cfg(feature = "mpi")]
fn with_set(mut args: Vec<String>, set: &str) -> Vec<String> {
    args.extend(["--set".into(), set.into()]);
    args
}

/// `ember args`, which must succeed.
#[cfg(feature = "mpi")]
fn ok(args: &[String]) -> Output {
    ember_ok(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// `args` training into `run`, resuming it.
#[cfg(feature = "mpi")]
fn resumed(args: Vec<String>, run: &Path) -> Vec<String> {
    let mut args = with_out(args, run);
    args.push("--resume".into());
    args
}

#[cfg(feature = "mpi")]
fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The validation losses a run's metrics recorded, by step.
#[cfg(feature = "mpi")]
fn evals(run: &Path) -> Vec<(u64, Option<f64>)> {
    ember_train::metrics::read(&run.join("metrics.jsonl"))
        .into_iter()
        .filter(|r| r.kind == "eval")
        .map(|r| (r.step, r.val_loss))
        .collect()
}

#[cfg(feature = "mpi")]
#[test]
fn two_processes_train_to_the_parameters_of_one_with_twice_the_grad_accum() {
    let dir = temp("two-ranks");
    let (one, two) = (dir.join("one"), dir.join("two"));
    let args = tiny(40, &["training.eval_interval=20"]);
    ok(&with_out(
        with_set(args.clone(), "training.grad_accum=2"),
        &one,
    ));
    let out = mpirun(2, &free_port(), &with_out(args, &two))
        .output()
        .unwrap();
    let stderr = text(&out);
    assert!(out.status.success(), "{stderr}");
    // Rank 0 alone reports, and says how the batch is made.
    assert_eq!(stderr.matches("done: 40 steps").count(), 1, "{stderr}");
    assert!(
        stderr.contains("2 processes (mpirun), collectives by MPI"),
        "{stderr}"
    );
    assert!(
        stderr.contains("global batch: batch_size 8 x grad_accum 1 x 2 processes = 16 sequences"),
        "{stderr}"
    );
    // Each rank's gradient is one micro-batch's; their sum is the one process's sum of two,
    // the same two additions: equal bit for bit.
    let (a, b) = (params(&one), params(&two));
    assert!(!a.is_empty());
    assert!(a == b, "the parameters differ");
    assert_eq!(evals(&one), evals(&two));

    // The translation task too: its micro-batches are consecutive batches of an epoch,
    // numbered over both processes.
    let (one_t, two_t) = (dir.join("one-t"), dir.join("two-t"));
    let mut args: Vec<String> = ["train", "--config", "configs/multi30k-tiny.toml"]
        .map(String::from)
        .to_vec();
    for set in [
        "model.dropout=0",
        "training.max_steps=12",
        "training.eval_interval=6",
    ] {
        args = with_set(args, set);
    }
    ok(&with_out(
        with_set(args.clone(), "training.grad_accum=2"),
        &one_t,
    ));
    let out = mpirun(2, &free_port(), &with_out(args, &two_t))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let (a, b) = (evals(&one_t), evals(&two_t));
    assert_eq!(a.len(), 2);
    assert_eq!(a, b);

    // Two micro-batches per rank against four in one process: the sums are grouped
    // `(a + b) + (c + d)` instead of `((a + b) + c) + d`, one f32 rounding apart per value and
    // step; after 100 steps the validation losses agree within 1e-5 (measured: 2e-7 apart
    // after 300 steps).
    let (four, two_by_two) = (dir.join("four"), dir.join("two-by-two"));
    let args = tiny(100, &["training.eval_interval=50"]);
    ok(&with_out(
        with_set(args.clone(), "training.grad_accum=4"),
        &four,
    ));
    let each = with_set(args, "training.grad_accum=2");
    let out = mpirun(2, &free_port(), &with_out(each, &two_by_two))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let (a, b) = (evals(&four), evals(&two_by_two));
    assert_eq!(a.len(), 2);
    for ((step_a, loss_a), (step_b, loss_b)) in a.into_iter().zip(b) {
        let (loss_a, loss_b) = (loss_a.unwrap(), loss_b.unwrap());
        assert_eq!(step_a, step_b);
        assert!(
            (loss_a - loss_b).abs() <= 1e-5 * loss_a,
            "{loss_a} vs {loss_b}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The pid of rank `rank` of the run writing into `run` (Open MPI gives each its rank in the
/// environment).
#[cfg(feature = "mpi")]
fn rank_pid(run: &Path, rank: usize) -> Option<String> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if !cmdline.starts_with(env!("CARGO_BIN_EXE_ember"))
            || !cmdline.contains(&*run.to_string_lossy())
        {
            continue;
        }
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        if environ.split(|&b| b == 0).any(|v| v == want.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

/// Two processes of `args` training into `run`, rank 1 sent `signal` once the run has saved
/// step 300's checkpoint: their output, and when they started.
#[cfg(feature = "mpi")]
fn signal_rank_1_after_step_300(args: &[String], run: &Path, signal: &str) -> (Output, Instant) {
    let child = mpirun(2, &free_port(), &with_out(args.to_vec(), run))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !run.join("checkpoints/step-0000300").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no checkpoint at step 300"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = rank_pid(run, 1).expect("rank 1 runs");
    common::signal(&pid, signal);
    (child.wait_with_output().unwrap(), started)
}

#[cfg(feature = "mpi")]
#[test]
fn a_killed_rank_ends_the_other_in_one_line_a_stopped_one_stops_both_and_the_run_resumes_exactly() {
    let dir = temp("killed-rank");
    let steps = 3000;
    let args = tiny(steps, &["training.checkpoint_interval=100"]);
    let whole = dir.join("whole");
    ok(&with_out(
        with_set(args.clone(), "training.grad_accum=2"),
        &whole,
    ));

    // Once the run has saved a few checkpoints, kill rank 1 as the system would.
    let run = dir.join("killed");
    let (out, started) = signal_rank_1_after_step_300(&args, &run, "KILL");
    let stderr = text(&out);
    assert!(!out.status.success(), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(60), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(
        errors[0].contains("rank 1 ended before the run did"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    // Resumed by two processes, and (a copy) by one: the global batch is kept.
    let copy = dir.join("copy");
    assert!(
        Command::new("cp")
            .args(["-r", &run.to_string_lossy(), &copy.to_string_lossy()])
            .status()
            .unwrap()
            .success()
    );
    let out = mpirun(2, &free_port(), &resumed(args.clone(), &run))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let out = ok(&resumed(args.clone(), &copy));
    assert!(
        text(&out).contains("1 process(es) keep that batch with grad_accum 2 each"),
        "{}",
        text(&out)
    );
    let want = params(&whole);
    assert!(
        params(&run) == want,
        "resumed by two processes: parameters differ"
    );
    assert!(
        params(&copy) == want,
        "resumed by one process: parameters differ"
    );

    // SIGTERM to rank 1 alone: both ranks stop at the same step, rank 0 saves it, and the
    // resumed run ends at the same parameters again.
    let run = dir.join("stopped");
    let (out, _) = signal_rank_1_after_step_300(&args, &run, "TERM");
    let stderr = text(&out);
    let (step, line) = common::interrupted_step(&stderr);
    assert!((300..steps).contains(&step), "{line}");
    assert!(
        stderr.contains("continue with: mpirun as before"),
        "{stderr}"
    );
    assert!(!stderr.lines().any(|l| l.starts_with("error:")), "{stderr}");
    let saved = ember_train::checkpoint::resolve(&run).unwrap();
    assert_eq!(
        ember_train::checkpoint::read_state(&saved).unwrap().step,
        step
    );
    let out = mpirun(2, &free_port(), &resumed(args, &run))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        params(&run) == want,
        "resumed after SIGTERM: parameters differ"
    );
    let _ = std::fs::remove_dir_all(dir);
}
