//! Checkpoint folders, written atomically.
//!
//! A run's output folder holds `checkpoints/step-NNNNNNN/` folders, a `latest` file naming
//! the newest and a `best` file naming the one with the lowest validation loss. A checkpoint is first written to a hidden temporary folder, synced, then renamed
//! into place, and only then does `latest` (itself replaced by rename) point at it: a crash at
//! any moment leaves the previous checkpoint whole and findable.

use std::fs;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::{ModuleOptimizer, OptimizerRecord};
use burn::store::ModuleRecord;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError, write_err};

/// Version of the checkpoint layout this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The file in a run folder that names the newest checkpoint.
pub const LATEST: &str = "latest";
/// The file in a run folder that names the checkpoint with the lowest validation loss.
pub const BEST: &str = "best";
/// Where checkpoints live inside a run folder.
pub const CHECKPOINTS: &str = "checkpoints";
/// Model weights inside a checkpoint (Burn's burnpack format).
pub const MODEL_FILE: &str = "model.bpk";
/// Optimizer state inside a checkpoint.
pub const OPTIM_FILE: &str = "optim.bpk";
/// Run state inside a checkpoint.
pub const STATE_FILE: &str = "state.json";
/// The resolved run config inside a checkpoint.
pub const CONFIG_FILE: &str = "config.toml";

/// What a checkpoint records besides tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointState {
    /// Layout version ([`FORMAT_VERSION`] when written by this build).
    pub format_version: u32,
    /// `decoder_only` or `encoder_decoder`.
    pub model_kind: String,
    /// Optimizer steps completed.
    pub step: u64,
    /// The run's seed; with `step` it fixes every later batch and dropout mask.
    pub seed: u64,
    /// Training tokens consumed so far.
    pub tokens_seen: u64,
    /// Training wall time so far, in seconds.
    pub elapsed_secs: f64,
    /// The last validation loss, if one was measured.
    pub val_loss: Option<f64>,
    /// Micro-batches of one step over every process (`grad_accum` x world size; 0 in
    /// checkpoints that predate it): what a run resumed with another world size keeps.
    #[serde(default)]
    pub micro_batches: u64,
    /// The number of processes that trained it (0 in checkpoints that predate it).
    #[serde(default)]
    pub world_size: u64,
}

/// What a checkpoint's `model_kind` means to a user.
pub fn describe_kind(kind: &str) -> String {
    match kind {
        "decoder_only" => "language model (decoder_only)".into(),
        "encoder_decoder" => "translation model (encoder_decoder)".into(),
        other => format!("`{other}` model"),
    }
}

fn step_dir_name(step: u64) -> String {
    format!("step-{step:07}")
}

fn sync_dir(path: &Path) {
    // Best effort: makes the rename durable on filesystems that need it.
    if let Ok(dir) = fs::File::open(path) {
        let _ = dir.sync_all();
    }
}

/// Writes a checkpoint for `state.step` into `run_dir`. `write_files` fills the (temporary)
/// folder it is given with the model, optimizer, tokenizer and config files; this function adds
/// `state.json`, syncs, renames the folder into place, points `latest` at it, and keeps only the
/// newest `keep` checkpoints. Returns the checkpoint folder.
pub fn save(
    run_dir: &Path,
    state: &CheckpointState,
    keep: usize,
    write_files: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let tmp = begin(run_dir, state.step)?;
    if let Err(e) = write_files(&tmp) {
        // A full disk, say: free what the partial write took; the previous checkpoint stays.
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    finish(run_dir, state, keep, tmp)
}

/// The first half of [`save`]: a new temporary folder for checkpoint `step` of `run_dir`, for
/// its files to be written into before [`finish`].
pub(crate) fn begin(run_dir: &Path, step: u64) -> Result<PathBuf> {
    let root = run_dir.join(CHECKPOINTS);
    fs::create_dir_all(&root).map_err(|e| write_err(&root, e))?;
    let tmp = root.join(format!(
        ".tmp-{}-{}",
        step_dir_name(step),
        std::process::id()
    ));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| write_err(&tmp, e))?;
    }
    fs::create_dir(&tmp).map_err(|e| write_err(&tmp, e))?;
    Ok(tmp)
}

/// The second half of [`save`], once the files are in `tmp` (from [`begin`]): `state.json`,
/// every file synced, the folder renamed into place, `latest` pointed at it, the newest `keep`
/// checkpoints kept. On an error `tmp` is removed and the previous checkpoints stay.
pub(crate) fn finish(
    run_dir: &Path,
    state: &CheckpointState,
    keep: usize,
    tmp: PathBuf,
) -> Result<PathBuf> {
    if let Err(e) = fill(&tmp, state) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let root = run_dir.join(CHECKPOINTS);
    let name = step_dir_name(state.step);
    let final_dir = root.join(&name);
    if final_dir.exists() {
        // The same step saved again (e.g. after a resume): move the old one aside first.
        let old = root.join(format!(".old-{name}-{}", std::process::id()));
        fs::rename(&final_dir, &old).map_err(|e| write_err(&final_dir, e))?;
        fs::rename(&tmp, &final_dir).map_err(|e| write_err(&final_dir, e))?;
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(&tmp, &final_dir).map_err(|e| write_err(&final_dir, e))?;
    }
    sync_dir(&root);

    point(run_dir, LATEST, &final_dir)?;
    prune(run_dir, keep);
    Ok(final_dir)
}

/// Makes the pointer file `which` ([`LATEST`] or [`BEST`]) of `run_dir` name checkpoint folder
/// `dir`, replacing it by rename so that a reader never sees half a name.
fn point(run_dir: &Path, which: &str, dir: &Path) -> Result<()> {
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    let tmp = run_dir.join(format!(".{which}.tmp"));
    let file = run_dir.join(which);
    fs::write(&tmp, format!("{CHECKPOINTS}/{name}\n")).map_err(|e| write_err(&tmp, e))?;
    fs::rename(&tmp, &file).map_err(|e| write_err(&file, e))?;
    sync_dir(run_dir);
    Ok(())
}

/// Records checkpoint folder `dir` (of `run_dir`) as the run's best: pruning keeps it, and
/// `--best` finds it.
pub fn mark_best(run_dir: &Path, dir: &Path) -> Result<()> {
    point(run_dir, BEST, dir)
}

/// The checkpoint folder a run folder's pointer file `which` names, if the file exists and
/// names a complete checkpoint.
fn pointed(run_dir: &Path, which: &str) -> Option<PathBuf> {
    let text = fs::read_to_string(run_dir.join(which)).ok()?;
    let dir = run_dir.join(text.trim());
    is_complete(&dir).then_some(dir)
}

/// The validation loss and step of the best checkpoint of run folder `run_dir`, if it has one.
pub fn best_val_loss(run_dir: &Path) -> Option<(f64, u64)> {
    let state = read_state(&pointed(run_dir, BEST)?).ok()?;
    Some((state.val_loss?, state.step))
}

/// The best checkpoint (lowest validation loss) of run folder `run_dir`.
pub fn resolve_best(run_dir: &Path) -> Result<PathBuf> {
    let err = |message: &str| TrainError::Checkpoint {
        path: run_dir.to_path_buf(),
        message: message.into(),
    };
    if !run_dir.is_dir() {
        return Err(err("no such run folder (--best takes a run folder)"));
    }
    if run_dir.join(STATE_FILE).exists() {
        return Err(err(
            "is a checkpoint folder; --best takes the run folder around it",
        ));
    }
    if !run_dir.join(BEST).exists() {
        return Err(err(
            "has no `best` file: the run has not evaluated a validation loss yet (or was made by an older ember)",
        ));
    }
    pointed(run_dir, BEST)
        .ok_or_else(|| err("its `best` file names a checkpoint that is missing or incomplete"))
}

/// Writes `state.json` into the temporary folder `tmp` beside the checkpoint's other files and
/// syncs them all.
fn fill(tmp: &Path, state: &CheckpointState) -> Result<()> {
    let state_path = tmp.join(STATE_FILE);
    let json = serde_json::to_string_pretty(state).expect("state always serializes");
    fs::write(&state_path, json).map_err(|e| write_err(&state_path, e))?;
    for entry in fs::read_dir(tmp).map_err(|e| write_err(tmp, e))? {
        let path = entry.map_err(|e| write_err(tmp, e))?.path();
        let file = fs::File::open(&path).map_err(|e| write_err(&path, e))?;
        file.sync_all().map_err(|e| write_err(&path, e))?;
    }
    sync_dir(tmp);
    Ok(())
}

/// Removes all but the newest `keep` checkpoints, and leftovers of interrupted writes. The
/// checkpoints that `latest` and `best` name are never removed, whatever their step.
fn prune(run_dir: &Path, keep: usize) {
    let root = run_dir.join(CHECKPOINTS);
    let Ok(entries) = fs::read_dir(&root) else {
        return;
    };
    let protected: Vec<PathBuf> = [LATEST, BEST]
        .iter()
        .filter_map(|which| fs::read_to_string(run_dir.join(which)).ok())
        .map(|text| run_dir.join(text.trim()))
        .collect();
    let mut steps = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if name.starts_with(".tmp-") || name.starts_with(".old-") {
            // Another process's write in progress is not ours to remove: only our own
            // leftovers, and those of processes that no longer run (killed mid-write).
            if left_by_dead_or_self(&name) {
                let _ = fs::remove_dir_all(entry.path());
            }
        } else if name.starts_with("step-") {
            steps.push(entry.path());
        }
    }
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for old in &steps[..excess] {
        if !protected.iter().any(|p| p == old) {
            let _ = fs::remove_dir_all(old);
        }
    }
}

/// Was the temporary folder `name` (`.tmp-step-N-PID`) left by this process or by one that is
/// gone? Where that cannot be told (no `/proc`), only this process's own count.
fn left_by_dead_or_self(name: &str) -> bool {
    let Some(pid) = name.rsplit('-').next().and_then(|p| p.parse::<u32>().ok()) else {
        return false;
    };
    let proc = Path::new("/proc");
    pid == std::process::id() || (proc.is_dir() && !proc.join(pid.to_string()).exists())
}

/// Is `dir` a complete checkpoint folder (state readable, model present)?
fn is_complete(dir: &Path) -> bool {
    dir.join(MODEL_FILE).is_file() && read_state(dir).is_ok()
}

/// Finds the checkpoint folder `path` refers to: a checkpoint folder itself, or a run folder
/// (then the one `latest` names, or failing that the newest complete one).
pub fn resolve(path: &Path) -> Result<PathBuf> {
    let missing = |message: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message,
    };
    if !path.exists() {
        return Err(missing(
            "no such folder (train first, or pass --checkpoint DIR)".into(),
        ));
    }
    if !path.is_dir() {
        return Err(missing(
            "is a file; expected a checkpoint or run folder".into(),
        ));
    }
    if path.join(STATE_FILE).exists() || path.join(MODEL_FILE).exists() {
        return Ok(path.to_path_buf());
    }
    if let Some(dir) = pointed(path, LATEST) {
        return Ok(dir);
    }
    // `latest` missing or broken: fall back to the newest complete checkpoint.
    step_dirs(&path.join(CHECKPOINTS))
        .into_iter()
        .rev()
        .find(|dir| is_complete(dir))
        .ok_or_else(|| {
            missing(
                "holds no complete checkpoint (expected `latest` or checkpoints/step-*/)".into(),
            )
        })
}

/// The `step-*` folders of a run's checkpoints folder `root`, oldest first, complete or not.
fn step_dirs(root: &Path) -> Vec<PathBuf> {
    let mut steps: Vec<PathBuf> = fs::read_dir(root)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
                })
                .collect()
        })
        .unwrap_or_default();
    steps.sort();
    steps
}

/// The complete checkpoint folders of the run folder `run_dir`, oldest first.
pub fn complete(run_dir: &Path) -> Vec<PathBuf> {
    let mut steps = step_dirs(&run_dir.join(CHECKPOINTS));
    steps.retain(|dir| is_complete(dir));
    steps
}

/// The newest complete checkpoint older than checkpoint folder `dir` in the same run, if any:
/// where to turn when `dir` is damaged.
pub fn older_complete(dir: &Path) -> Option<PathBuf> {
    let name = dir.file_name()?;
    step_dirs(dir.parent()?)
        .into_iter()
        .rev()
        .find(|d| d.file_name().is_some_and(|n| n < name) && is_complete(d))
}

/// Resolves `path` to a checkpoint folder and checks it holds a `kind` model; `needed` says
/// what the calling command needs, for the error.
pub fn open(path: &Path, kind: &str, needed: &str) -> Result<(PathBuf, CheckpointState)> {
    let dir = resolve(path)?;
    let state = read_state(&dir)?;
    if state.model_kind != kind {
        return Err(TrainError::Checkpoint {
            path: dir,
            message: format!(
                "holds a {}; this command needs {needed}",
                describe_kind(&state.model_kind)
            ),
        });
    }
    Ok((dir, state))
}

/// Reads and checks `state.json` of a checkpoint folder.
pub fn read_state(dir: &Path) -> Result<CheckpointState> {
    let path = dir.join(STATE_FILE);
    let bad = |message: String| TrainError::Checkpoint {
        path: path.clone(),
        message,
    };
    let text = fs::read_to_string(&path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not a valid state file: {e}")))?;
    let version = value.get("format_version").and_then(|v| v.as_u64());
    match version {
        Some(v) if v > FORMAT_VERSION as u64 => {
            return Err(bad(format!(
                "format version {v} is newer than this ember understands ({FORMAT_VERSION}); upgrade ember"
            )));
        }
        None => return Err(bad("has no format_version: not an ember checkpoint".into())),
        _ => {}
    }
    serde_json::from_value(value).map_err(|e| bad(format!("not a valid state file: {e}")))
}

/// A model's weights and its optimizer's state read from the device into host memory: what a
/// checkpoint holds of them, which any thread can then write ([`Snapshot::write`]) while the
/// model trains on.
pub(crate) struct Snapshot {
    model: ModuleRecord,
    optim: OptimizerRecord,
}

impl Snapshot {
    /// Reads `model`'s weights and `optim`'s state (waiting for the device to have computed
    /// them).
    pub(crate) fn of<M: Module>(model: &M, optim: &ModuleOptimizer) -> Snapshot {
        Snapshot {
            model: model.clone().into_record(),
            optim: optim.to_record(),
        }
    }

    /// Writes the weights and the optimizer state into checkpoint folder `dir`.
    pub(crate) fn write(self, dir: &Path) -> Result<()> {
        let model_path = dir.join(MODEL_FILE);
        self.model
            .save(&model_path)
            .map_err(|e| write_err(&model_path, e))?;
        let optim_path = dir.join(OPTIM_FILE);
        self.optim
            .save(&optim_path)
            .map_err(|e| write_err(&optim_path, e))
    }
}

/// Loads the optimizer state of checkpoint `dir`.
pub(crate) fn load_optimizer(optim: ModuleOptimizer, dir: &Path) -> Result<ModuleOptimizer> {
    let path = dir.join(OPTIM_FILE);
    optim.load(&path).map_err(|e| TrainError::Checkpoint {
        path: path.clone(),
        message: format!("cannot load optimizer state: {e}"),
    })
}

/// Loads the weights of checkpoint `dir` into a model built from the checkpoint's config.
pub fn load_model<M: Module>(model: M, dir: &Path) -> Result<M> {
    let path = dir.join(MODEL_FILE);
    if !path.is_file() {
        return Err(TrainError::Checkpoint {
            path,
            message: "missing model weights".into(),
        });
    }
    model.try_load_file(&path).map_err(|e| {
        let mut message = format!(
            "cannot load model weights: {}",
            summarize_record_error(&e.to_string())
        );
        if let Some(older) = older_complete(dir) {
            message += &format!("; an older checkpoint is {}", older.display());
        }
        TrainError::Checkpoint { path, message }
    })
}

/// Burn's record errors list every tensor at fault; keep the count and the first one.
fn summarize_record_error(message: &str) -> String {
    let kinds = [
        ("Apply errors: ", "do not match this model"),
        ("Missing tensors: ", "are missing"),
        ("Unused tensors: ", "are not part of this model"),
    ];
    for (marker, what) in kinds {
        let Some(at) = message.find(marker) else {
            continue;
        };
        let list = message[at + marker.len()..]
            .trim()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let items: Vec<&str> = list
            .split("\", \"")
            .map(|item| item.trim_matches('"'))
            .filter(|item| !item.is_empty())
            .collect();
        let first = items
            .first()
            .unwrap_or(&"")
            .replace("Shape { dims: ", "")
            .replace(" }", "");
        return format!(
            "{} tensor(s) {what} (weights of another architecture, or a config.toml that does not belong to them?); first: {first}",
            items.len()
        );
    }
    message.to_string()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The state of a checkpoint at `step` of a one-process run.
    pub(crate) fn state(step: u64) -> CheckpointState {
        CheckpointState {
            format_version: FORMAT_VERSION,
            model_kind: "decoder_only".into(),
            step,
            seed: 1,
            tokens_seen: step * 10,
            elapsed_secs: 1.0,
            val_loss: None,
            micro_batches: 1,
            world_size: 1,
        }
    }

    fn write_model(dir: &Path) -> Result<()> {
        fs::write(dir.join(MODEL_FILE), b"weights").map_err(|e| write_err(dir, e))
    }

    #[test]
    fn latest_points_at_newest_and_old_ones_are_pruned() {
        let run = std::env::temp_dir().join(format!("ember-ckpt-{}", std::process::id()));
        let _ = fs::remove_dir_all(&run);
        for step in [10, 20, 30] {
            save(&run, &state(step), 2, write_model).unwrap();
        }
        let dir = resolve(&run).unwrap();
        assert!(dir.ends_with("step-0000030"));
        assert_eq!(read_state(&dir).unwrap().step, 30);
        assert!(!run.join(CHECKPOINTS).join("step-0000010").exists());
        assert!(run.join(CHECKPOINTS).join("step-0000020").exists());

        // A write that died before its rename leaves only a hidden folder: still step 30.
        fs::create_dir_all(run.join(CHECKPOINTS).join(".tmp-step-0000040-1")).unwrap();
        assert!(resolve(&run).unwrap().ends_with("step-0000030"));

        // `latest` pointing at a damaged checkpoint: fall back to the newest complete one.
        fs::remove_file(dir.join(MODEL_FILE)).unwrap();
        assert!(resolve(&run).unwrap().ends_with("step-0000020"));

        // A newer format is refused with a clear message.
        let mut s = state(20);
        s.format_version = FORMAT_VERSION + 1;
        let d = run.join(CHECKPOINTS).join("step-0000020");
        fs::write(d.join(STATE_FILE), serde_json::to_string(&s).unwrap()).unwrap();
        let err = read_state(&d).unwrap_err().to_string();
        assert!(err.contains("newer"), "{err}");
        let _ = fs::remove_dir_all(&run);
    }

    #[test]
    fn pruning_keeps_what_latest_and_best_name() {
        let run = std::env::temp_dir().join(format!("ember-ckpt-best-{}", std::process::id()));
        let _ = fs::remove_dir_all(&run);
        let step = |n: u64| run.join(CHECKPOINTS).join(step_dir_name(n));
        save(&run, &state(10), 2, write_model).unwrap();
        mark_best(&run, &step(10)).unwrap();
        for n in [20, 30, 40] {
            save(&run, &state(n), 2, write_model).unwrap();
        }
        // The newest two and the best survive.
        assert!(step(10).exists() && step(30).exists() && step(40).exists());
        assert!(!step(20).exists());
        assert_eq!(resolve_best(&run).unwrap(), step(10));
        assert_eq!(resolve(&run).unwrap(), step(40));

        // A checkpoint older by name than the ones on disk (a run restarted at a lower step)
        // is what `latest` names, so it is kept although the two newest by name are others.
        save(&run, &state(5), 2, write_model).unwrap();
        assert!(step(5).exists(), "the checkpoint just written was pruned");
        assert_eq!(resolve(&run).unwrap(), step(5));

        // No `best` file, or a checkpoint folder instead of the run folder: clear errors.
        let err = resolve_best(&step(5)).unwrap_err().to_string();
        assert!(err.contains("run folder"), "{err}");
        fs::remove_file(run.join(BEST)).unwrap();
        let err = resolve_best(&run).unwrap_err().to_string();
        assert!(err.contains("no `best` file"), "{err}");
        let _ = fs::remove_dir_all(&run);
    }

    #[test]
    fn missing_folder_is_a_clear_error() {
        let err = resolve(Path::new("/nonexistent/ember-run"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("/nonexistent/ember-run") && err.contains("no such folder"),
            "{err}"
        );
    }
}
