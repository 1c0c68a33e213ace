//! Checkpoints written on a thread of their own while training goes on.
//!
//! A checkpoint's weights and optimizer state are read from the device on the training thread
//! (the values of that step), and its small files (tokenizer, config) written there; the
//! thread then writes the two large files, syncs every file to disk, renames the folder into
//! place and points `latest` (and `best`) at it, all as [`checkpoint::save`] does, while the
//! next steps train. Writing and syncing a checkpoint of nanoGPT's GPU config (123 MB with
//! AdamW's moments) took about 0.2 s of the training thread on a 2-core Intel Xeon, one of
//! GPT-2's body (974 MB) 4.7 s; now 0.04-0.05 s of it is left there (docs/benchmarks.md).
//!
//! One checkpoint is written at a time: the next waits for the one before, and so does the end
//! of the run (its summary names only checkpoints on disk). A checkpoint that fails (a full
//! disk) leaves the one before it whole, as a synchronous save does, and its error stops the
//! run at the step after the thread ended ([`Saving::poll`], every step), not a checkpoint
//! interval later, naming the newest checkpoint on disk; a run that stops on another error
//! still waits for the checkpoint being written.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use crate::checkpoint::{self, CheckpointState, Snapshot};
use crate::error::{Result, TrainError};

/// The checkpoint being written, if any (its step and thread), and the newest one written.
pub(super) struct Saving {
    pending: Option<(u64, JoinHandle<Result<PathBuf>>)>,
    newest: PathBuf,
}

impl Saving {
    /// `newest`: the run's checkpoint so far (the resumed one; empty for a fresh run).
    pub(super) fn new(newest: PathBuf) -> Self {
        Saving {
            pending: None,
            newest,
        }
    }

    /// Starts checkpoint `state.step` of `run_dir` (marked best where `best`) once the one
    /// before has been written, whose error, if any, is returned instead: `snapshot` and the
    /// files `write_files` writes here go into a new temporary folder, which a thread then
    /// completes (`keep`: the newest checkpoints kept).
    pub(super) fn start(
        &mut self,
        run_dir: &Path,
        state: &CheckpointState,
        keep: usize,
        best: bool,
        snapshot: Snapshot,
        write_files: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<()> {
        self.wait()?;
        let tmp = checkpoint::begin(run_dir, state.step)?;
        if let Err(e) = write_files(&tmp) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        let step = state.step;
        let (dir, state) = (run_dir.to_path_buf(), state.clone());
        let thread = std::thread::Builder::new()
            .name("ember-checkpoint".into())
            .spawn(move || {
                if let Err(e) = snapshot.write(&tmp) {
                    let _ = std::fs::remove_dir_all(&tmp);
                    return Err(e);
                }
                let written = checkpoint::finish(&dir, &state, keep, tmp)?;
                if best {
                    checkpoint::mark_best(&dir, &written)?;
                }
                Ok(written)
            })
            .map_err(|e| TrainError::Checkpoint {
                path: run_dir.to_path_buf(),
                message: format!("cannot start the thread that writes the checkpoint: {e}"),
            })?;
        self.pending = Some((step, thread));
        Ok(())
    }

    /// The error of the checkpoint being written if its thread has ended with one; called every
    /// step, so that a run whose checkpoint failed stops at once instead of training on to its
    /// next checkpoint (where a full disk would lose that many steps again).
    pub(super) fn poll(&mut self) -> Result<()> {
        if self.pending.as_ref().is_some_and(|(_, t)| t.is_finished()) {
            self.wait()?;
        }
        Ok(())
    }

    /// Waits for the checkpoint being written; the newest checkpoint on disk (the run's start's
    /// where none was written), or the error that stopped the last one
    /// ([`TrainError::SaveFailed`], naming the newest checkpoint on disk).
    pub(super) fn wait(&mut self) -> Result<PathBuf> {
        if let Some((step, thread)) = self.pending.take() {
            let written = thread.join().unwrap_or_else(|panic| {
                // Not expected: the writing's errors are returned, not raised.
                std::panic::resume_unwind(panic)
            });
            self.newest = written.map_err(|cause| TrainError::SaveFailed {
                step,
                cause: Box::new(cause),
                newest: (!self.newest.as_os_str().is_empty()).then(|| self.newest.clone()),
            })?;
        }
        Ok(self.newest.clone())
    }
}

impl Drop for Saving {
    /// A run that stops on an error still completes the checkpoint being written (and says
    /// where that failed, the run's own error being the one returned).
    fn drop(&mut self) {
        if let Some((_, thread)) = self.pending.take()
            && let Ok(Err(e)) = thread.join()
        {
            eprintln!("error: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::tests::state;
    use crate::checkpoint::{MODEL_FILE, OPTIM_FILE, resolve, resolve_best};
    use crate::config::TrainingConfig;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{GradientsParams, ModuleOptimizer};
    use burn::tensor::{Device, Tensor};
    use std::fs;

    /// One AdamW step of `layer` (the weights updated in place where nothing else holds them).
    fn step(layer: Linear, optim: &mut ModuleOptimizer) -> Linear {
        let x = Tensor::<2>::ones([3, 6], &layer.weight.device());
        let grads = GradientsParams::from_grads(layer.forward(x).sum().backward(), &layer);
        optim.step(1e-2, layer, grads)
    }

    /// A layer and its optimizer after one AdamW step (moments to write).
    fn trained() -> (Linear, ModuleOptimizer) {
        let layer = LinearConfig::new(6, 5).init(&Device::flex().autodiff());
        let config = TrainingConfig::default();
        let mut optim = crate::optimizer::adamw_scaled(&config, &layer, &Default::default());
        let layer = step(layer, &mut optim);
        (layer, optim)
    }

    fn run_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ember-saving-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn read(dir: &Path, file: &str) -> Vec<u8> {
        fs::read(dir.join(file)).unwrap_or_else(|e| panic!("{}: {e}", dir.join(file).display()))
    }

    /// A checkpoint written on its thread holds the same bytes as one written by
    /// `checkpoint::save` from the same model and optimizer, even where the model trains on
    /// before the thread has written it (the values are the snapshot's); `latest` and `best`
    /// name it once the writer has been waited for, and dropping the writer completes the
    /// checkpoint being written.
    #[test]
    fn a_checkpoint_written_beside_training_equals_one_written_at_once() {
        let (layer, mut optim) = trained();
        let (sync_run, thread_run) = (run_dir("sync"), run_dir("thread"));
        let files = |dir: &Path| {
            fs::write(dir.join("tokenizer.json"), b"{}")
                .map_err(|e| crate::error::write_err(dir, e))
        };
        let at_once = checkpoint::save(&sync_run, &state(10), 2, |dir| {
            Snapshot::of(&layer, &optim).write(dir)?;
            files(dir)
        })
        .unwrap();

        let mut saving = Saving::new(PathBuf::new());
        let snapshot = Snapshot::of(&layer, &optim);
        saving
            .start(&thread_run, &state(10), 2, true, snapshot, files)
            .unwrap();
        // The layer and the moments step on before the thread writes: the files hold the
        // snapshot's values.
        let layer = step(layer, &mut optim);
        let written = saving.wait().unwrap();
        assert_eq!(written, resolve(&thread_run).unwrap());
        assert_eq!(written, resolve_best(&thread_run).unwrap());
        for file in [MODEL_FILE, OPTIM_FILE, "tokenizer.json", "state.json"] {
            assert_eq!(read(&at_once, file), read(&written, file), "{file}");
        }
        let (sync_state, thread_state) = (
            checkpoint::read_state(&at_once).unwrap(),
            checkpoint::read_state(&written).unwrap(),
        );
        assert_eq!(sync_state, thread_state);
        // (The step did change them: read after it, the weights are other bytes.)
        let after = checkpoint::save(&sync_run, &state(11), 2, |dir| {
            Snapshot::of(&layer, &optim).write(dir)
        })
        .unwrap();
        assert_ne!(read(&at_once, MODEL_FILE), read(&after, MODEL_FILE));
        assert_ne!(read(&at_once, OPTIM_FILE), read(&after, OPTIM_FILE));

        // Dropped while writing (a run stopping on another error): the checkpoint completes,
        // and is not marked best where not asked.
        let mut saving = Saving::new(written.clone());
        let snapshot = Snapshot::of(&layer, &optim);
        saving
            .start(&thread_run, &state(20), 2, false, snapshot, files)
            .unwrap();
        drop(saving);
        let newest = resolve(&thread_run).unwrap();
        assert!(newest.ends_with("step-0000020"), "{}", newest.display());
        assert_eq!(resolve_best(&thread_run).unwrap(), written);
        let _ = fs::remove_dir_all(&sync_run);
        let _ = fs::remove_dir_all(&thread_run);
    }

    /// A checkpoint that fails on its thread (here `latest` cannot be replaced) leaves the
    /// previous one as it was, and its error, naming the file and the newest checkpoint on disk,
    /// is what the next poll (a step), checkpoint or the end of the run gets.
    #[test]
    fn a_failed_checkpoint_is_the_next_poll_s_error() {
        let (layer, optim) = trained();
        let run = run_dir("fail");
        let files = |_: &Path| Ok(());
        let mut saving = Saving::new(PathBuf::new());
        saving
            .start(
                &run,
                &state(10),
                2,
                false,
                Snapshot::of(&layer, &optim),
                files,
            )
            .unwrap();
        let first = saving.wait().unwrap();
        // `latest` is replaced through `.latest.tmp`: a folder there makes that fail.
        fs::create_dir_all(run.join(".latest.tmp")).unwrap();
        saving
            .start(
                &run,
                &state(20),
                2,
                false,
                Snapshot::of(&layer, &optim),
                files,
            )
            .unwrap();
        // `poll` returns the error once the thread has ended, without waiting for it before.
        let started = std::time::Instant::now();
        let err = loop {
            match saving.poll() {
                Err(e) => break e.to_string(),
                Ok(()) => {
                    assert!(
                        started.elapsed().as_secs() < 60,
                        "the failure was never polled"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
        };
        assert!(err.contains(".latest.tmp"), "{err}");
        assert!(
            err.contains("checkpoint of step 20 was not written"),
            "{err}"
        );
        let newest = format!("newest checkpoint on disk is {}", first.display());
        assert!(err.contains(&newest), "{err}");
        assert_eq!(resolve(&run).unwrap(), first);
        // Taken: polling again (nothing being written) is not an error.
        saving.poll().unwrap();
        // The error was taken: the writer goes on from the checkpoint on disk.
        fs::remove_dir_all(run.join(".latest.tmp")).unwrap();
        saving
            .start(
                &run,
                &state(30),
                2,
                false,
                Snapshot::of(&layer, &optim),
                files,
            )
            .unwrap();
        assert!(saving.wait().unwrap().ends_with("step-0000030"));
        let _ = fs::remove_dir_all(&run);
    }
}
