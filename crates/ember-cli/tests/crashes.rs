//! Crashes, full disks and determinism: a run killed at random moments resumes to the same
//! parameters as an uninterrupted one; a full disk stops the run with a clear error and no
//! corrupt checkpoint; the same seed gives the same loss curve.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{assert_clear_error, ember, ember_ok, params, repo, temp};
use ember_train::checkpoint;

/// A tiny run that checkpoints every second step, so that kills often land mid-write.
fn config(dir: &Path) -> String {
    let corpus = repo().join("data/tinyshakespeare.txt");
    let path = dir.join("kill.toml");
    std::fs::write(
        &path,
        format!(
            "[model]\nd_model = 32\nn_heads = 2\nn_layers = 2\ncontext_len = 32\ndropout = 0.1\n\
             [data]\npath = {:?}\n\
             [training]\nbatch_size = 4\nmax_steps = 160\ncheckpoint_interval = 2\nlog_interval = 2\n\
             eval_interval = 80\neval_batches = 2\nkeep_checkpoints = 3\n",
            corpus.to_str().unwrap()
        ),
    )
    .unwrap();
    path.to_str().unwrap().to_string()
}

/// The loss curve of a run: (step, train loss, val loss) per metrics line, timing left out.
fn curve(run: &Path) -> Vec<(u64, f64, Option<f64>)> {
    ember_train::metrics::read(&run.join("metrics.jsonl"))
        .into_iter()
        .map(|r| (r.step, r.train_loss, r.val_loss))
        .collect()
}

fn train_args<'a>(config: &'a str, out: &'a Path, resume: bool) -> Vec<&'a str> {
    let mut args = vec!["train", "--config", config, "--out", out.to_str().unwrap()];
    if resume {
        args.push("--resume");
    }
    args
}

/// Hidden folders of interrupted checkpoint writes in `run`.
fn leftovers(run: &Path) -> usize {
    std::fs::read_dir(run.join(checkpoint::CHECKPOINTS))
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
                .count()
        })
        .unwrap_or(0)
}

/// After a crash: if `latest` exists it names a checkpoint that loads, and `resolve` finds one
/// that loads. Returns whether there is a checkpoint to resume from.
fn check_after_crash(run: &Path) -> bool {
    let device = burn::tensor::Device::flex();
    if let Ok(text) = std::fs::read_to_string(run.join(checkpoint::LATEST)) {
        let named = run.join(text.trim());
        ember_train::load_lm(&named, &device)
            .unwrap_or_else(|e| panic!("`latest` names a broken checkpoint: {e}"));
    }
    match checkpoint::resolve(run) {
        Ok(dir) => {
            let loaded = ember_train::load_lm(&dir, &device).expect("the checkpoint loads");
            assert_eq!(loaded.step % 2, 0, "checkpoints are every 2 steps");
            true
        }
        Err(_) => false,
    }
}

#[test]
fn killed_at_random_moments_the_run_resumes_to_the_same_parameters() {
    let dir = temp("crash");
    let config = config(&dir);
    let whole = dir.join("whole");
    let started = std::time::Instant::now();
    ember_ok(&train_args(&config, &whole, false));
    // Kills land 8-25% of an uninterrupted run's time after each start, so that however fast
    // the machine, a run needs at least four starts (each resumes where the last one's newest
    // checkpoint left off) and the kills hit every stage of the run.
    let whole_ms = started.elapsed().as_millis() as u64;

    let run = dir.join("killed");
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let (mut kills, mut mid_write, mut resumed) = (0, 0, 0);
    let mut resumable = false;
    for _ in 0..8 {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ember"))
            .args(train_args(&config, &run, resumable))
            .current_dir(repo())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let permille = 80 + seed % 171;
        std::thread::sleep(Duration::from_millis(whole_ms * permille / 1000));
        if child.try_wait().unwrap().is_some() {
            break; // finished before the kill
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        kills += 1;
        if leftovers(&run) > 0 {
            mid_write += 1;
        }
        resumable = check_after_crash(&run);
        resumed += usize::from(resumable);
    }
    ember_ok(&train_args(&config, &run, resumable));
    eprintln!(
        "{kills} kills ({whole_ms} ms uninterrupted), {mid_write} of them during a checkpoint \
         write, {resumed} left a checkpoint to resume from"
    );
    assert!(kills >= 4, "the run was killed only {kills} times");
    assert!(
        resumed >= 2,
        "only {resumed} kills left a checkpoint to resume from"
    );
    assert_eq!(leftovers(&run), 0, "interrupted writes are cleaned up");
    assert!(
        params(&whole) == params(&run),
        "the resumed run's parameters differ from the uninterrupted run's"
    );
    assert_eq!(curve(&whole), curve(&run), "loss curves differ");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_same_seed_gives_the_same_loss_curve() {
    let dir = temp("determinism");
    let config = config(&dir);
    let (a, b) = (dir.join("a"), dir.join("b"));
    ember_ok(&train_args(&config, &a, false));
    ember_ok(&train_args(&config, &b, false));
    let curve_a = curve(&a);
    assert_eq!(curve_a.len(), 82, "80 log lines and 2 evaluations");
    assert_eq!(curve_a, curve(&b));
    assert!(params(&a) == params(&b));
    let _ = std::fs::remove_dir_all(dir);
}

/// A tmpfs of `kib` KiB at `dir`, unmounted on drop; `None` where mounting is not allowed.
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(dir: &Path, kib: usize) -> Option<Self> {
        std::fs::create_dir_all(dir).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"])
            .arg(dir)
            .stderr(Stdio::null())
            .status()
            .ok()?;
        status.success().then(|| Self(dir.to_path_buf()))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_stops_the_run_and_keeps_the_last_checkpoint() {
    let dir = temp("disk-full");
    let config = config(&dir);

    // A real full disk where this machine lets us mount one: room for one checkpoint (376 KiB)
    // and the run's small files, not for a second.
    let disk = dir.join("disk");
    if let Some(_mounted) = SmallDisk::mount(&disk, 600) {
        let run = disk.join("run");
        let out = ember(&train_args(&config, &run, false));
        assert_clear_error(&out, &["cannot write", "No space left on device"]);
        assert_eq!(leftovers(&run), 0, "the partial write is removed");
        let kept = checkpoint::resolve(&run).expect("the first checkpoint is kept");
        let named = format!("the newest checkpoint on disk is {}", kept.display());
        assert_clear_error(&out, &[named.as_str(), "--resume continues from it"]);
        ember_train::load_lm(&kept, &burn::tensor::Device::flex()).unwrap();
    } else {
        eprintln!("cannot mount a tmpfs here: only the file-size-limit case runs");
    }

    // Everywhere: a file-size limit makes the first weights file fail to write (EFBIG). The
    // checkpoint of step 50 fails on its thread: the run stops within a few steps of it, not
    // at the next checkpoint (step 100), and says nothing is on disk.
    let run = dir.join("limited");
    let script = "trap '' XFSZ; ulimit -f 100; exec \"$0\" \"$@\"";
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_ember"))
        .args(train_args(&config, &run, false))
        .args(["--set", "training.checkpoint_interval=50"])
        .args(["--set", "training.eval_interval=160"])
        .current_dir(repo())
        .output()
        .unwrap();
    let needles = [
        "checkpoint of step 50 was not written",
        "model.bpk",
        "File too large",
    ];
    assert_clear_error(&out, &needles);
    assert_clear_error(&out, &["no checkpoint of this run is on disk"]);
    assert_eq!(leftovers(&run), 0, "the partial write is removed");
    assert!(checkpoint::resolve(&run).is_err(), "no checkpoint appears");
    let last = curve(&run).last().map(|r| r.0);
    assert!(
        last.is_some_and(|step| (50..100).contains(&step)),
        "last logged step {last:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
