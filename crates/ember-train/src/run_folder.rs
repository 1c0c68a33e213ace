//! A run folder belongs to one run. A new run refuses a folder that holds another run's
//! checkpoints unless told to replace them, and two processes never train into one folder at
//! once. Without this, a second run into the same folder had its fresh checkpoints pruned in
//! favour of the first run's higher step numbers, and commands were served the old model.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use crate::checkpoint::{BEST, CHECKPOINTS, CONFIG_FILE, LATEST};
use crate::error::{Result, TrainError, write_err};

/// The lock file inside a run folder; the process training into the folder holds an exclusive
/// lock on it (released by the system when that process ends, however it ends).
pub const LOCK_FILE: &str = ".lock";

/// How a run treats what its folder already holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reuse {
    /// A folder holding a run is refused.
    #[default]
    Refuse,
    /// Continue the run the folder holds.
    Resume,
    /// Remove the run the folder holds (checkpoints, pointers, metrics, plot) first.
    Overwrite,
}

/// A run folder claimed by this process: it stays locked until this value is dropped.
#[derive(Debug)]
pub struct RunFolder {
    dir: PathBuf,
    _lock: File,
    /// The outermost folder claiming created (`dir` or a parent, as `runs/` of `runs/small`),
    /// removed on drop with the folders below it if nothing was written to them.
    created: Option<PathBuf>,
}

impl RunFolder {
    /// Creates (if needed), locks and checks `dir` for a run that treats earlier contents as
    /// `reuse` says.
    pub fn claim(dir: &Path, reuse: Reuse) -> Result<Self> {
        if crate::hf::is_hf_folder(dir) {
            return Err(TrainError::RunFolder {
                path: dir.to_path_buf(),
                message: format!(
                    "holds a Hugging Face model ({}, {}): --checkpoint would go on loading it \
                     instead of this run; train into another --out folder (--init-from {} starts \
                     from its weights)",
                    crate::hf::HF_CONFIG,
                    crate::hf::HF_WEIGHTS,
                    dir.display()
                ),
            });
        }
        let created = dir
            .ancestors()
            .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
            .last()
            .map(Path::to_path_buf);
        fs::create_dir_all(dir).map_err(|e| write_err(dir, e))?;
        let lock = lock(dir)?;
        let earlier = earlier_run(dir);
        match (reuse, earlier) {
            (Reuse::Refuse, Some(what)) => {
                return Err(TrainError::RunFolder {
                    path: dir.to_path_buf(),
                    message: format!(
                        "already holds a run ({what}); continue it with --resume, replace it \
                         with --overwrite, or train into another --out folder"
                    ),
                });
            }
            (Reuse::Overwrite, Some(what)) => {
                for name in [
                    CHECKPOINTS,
                    LATEST,
                    BEST,
                    "metrics.jsonl",
                    "loss.png",
                    ".loss.tmp.png",
                    CONFIG_FILE,
                ] {
                    let path = dir.join(name);
                    let removed = if path.is_dir() {
                        fs::remove_dir_all(&path)
                    } else {
                        fs::remove_file(&path)
                    };
                    match removed {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                            return Err(write_err(&path, e));
                        }
                        _ => {}
                    }
                }
                eprintln!(
                    "--overwrite: removed the earlier run in {} ({what}: its checkpoints, metrics and plot)",
                    dir.display()
                );
            }
            _ => {}
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            _lock: lock,
            created,
        })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for RunFolder {
    /// A folder this run created and left holding nothing but its lock (the run stopped before
    /// writing anything: a corpus not found, a value refused) is removed, so that a mistyped
    /// command leaves no empty run folder behind.
    fn drop(&mut self) {
        let only_lock = fs::read_dir(&self.dir).is_ok_and(|entries| {
            entries
                .flatten()
                .all(|e| e.file_name() == std::ffi::OsStr::new(LOCK_FILE))
        });
        let Some(outermost) = self.created.as_deref().filter(|_| only_lock) else {
            return;
        };
        let _ = fs::remove_file(self.dir.join(LOCK_FILE));
        // Up to the outermost folder made, each only while empty.
        for dir in self.dir.ancestors() {
            if fs::remove_dir(dir).is_err() || dir == outermost {
                break;
            }
        }
    }
}

/// Takes the folder's lock, or says which process holds it.
fn lock(dir: &Path) -> Result<File> {
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| write_err(&path, e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let who = if holder.is_empty() {
                "another process".to_string()
            } else {
                format!("another ember process (pid {holder})")
            };
            return Err(TrainError::RunFolder {
                path: dir.to_path_buf(),
                message: format!(
                    "is in use: {who} is training into it; wait for it to end or train into another --out folder"
                ),
            });
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(write_err(&path, e)),
    }
    // Who holds the lock, for the message another process prints.
    let _ = file.set_len(0);
    let _ = file.rewind();
    let _ = write!(file, "{}", std::process::id());
    let _ = file.flush();
    Ok(file)
}

/// What earlier run `dir` holds, described for a message ("checkpoint step-0000300"), or
/// `None` when it holds no checkpoint. Metrics of a run killed before its first checkpoint
/// are no run: there is nothing to resume, and a new run replaces them.
fn earlier_run(dir: &Path) -> Option<String> {
    let mut steps: Vec<String> = fs::read_dir(dir.join(CHECKPOINTS))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.starts_with("step-"))
                .collect()
        })
        .unwrap_or_default();
    steps.sort();
    match steps.last() {
        Some(newest) => Some(format!("checkpoint {newest}")),
        None if dir.join(LATEST).exists() => Some("a `latest` file".into()),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("ember-runfolder-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_folder_with_a_run_is_refused_replaced_or_resumed() {
        let dir = temp("reuse");
        // An empty or new folder, and one with only metrics of a run killed early: accepted.
        drop(RunFolder::claim(&dir, Reuse::Refuse).unwrap());
        fs::create_dir_all(&dir).unwrap();
        drop(RunFolder::claim(&dir, Reuse::Refuse).unwrap());
        fs::write(dir.join("metrics.jsonl"), "{}\n").unwrap();
        drop(RunFolder::claim(&dir, Reuse::Refuse).unwrap());

        fs::create_dir_all(dir.join(CHECKPOINTS).join("step-0000300")).unwrap();
        fs::write(dir.join(LATEST), "checkpoints/step-0000300\n").unwrap();
        let err = RunFolder::claim(&dir, Reuse::Refuse)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("step-0000300") && err.contains("--resume") && err.contains("--overwrite"),
            "{err}"
        );
        drop(RunFolder::claim(&dir, Reuse::Resume).unwrap());
        assert!(dir.join(LATEST).exists(), "resuming removes nothing");

        drop(RunFolder::claim(&dir, Reuse::Overwrite).unwrap());
        assert!(!dir.join(CHECKPOINTS).exists() && !dir.join(LATEST).exists());
        assert!(!dir.join("metrics.jsonl").exists());
        let _ = fs::remove_dir_all(&dir);
    }

    /// A run that fails before writing anything leaves no folder it created; a folder that was
    /// there before, or one the run wrote to, stays.
    #[test]
    fn a_folder_created_and_left_empty_is_removed() {
        let dir = temp("created");
        drop(RunFolder::claim(&dir.join("runs/small"), Reuse::Refuse).unwrap());
        assert!(!dir.exists(), "the empty folders this run made are removed");
        fs::create_dir_all(dir.join("runs/other")).unwrap();
        drop(RunFolder::claim(&dir.join("runs/small"), Reuse::Refuse).unwrap());
        assert!(!dir.join("runs/small").exists() && dir.join("runs/other").exists());
        let _ = fs::remove_dir_all(&dir);

        let claimed = RunFolder::claim(&dir, Reuse::Refuse).unwrap();
        fs::write(dir.join(CONFIG_FILE), "[model]\n").unwrap();
        drop(claimed);
        assert!(dir.join(CONFIG_FILE).exists(), "written to: kept");
        let _ = fs::remove_dir_all(&dir);

        fs::create_dir_all(&dir).unwrap();
        drop(RunFolder::claim(&dir, Reuse::Refuse).unwrap());
        assert!(dir.is_dir(), "made by the user: kept");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_claimed_folder_is_refused_until_released() {
        let dir = temp("lock");
        let first = RunFolder::claim(&dir, Reuse::Refuse).unwrap();
        let err = RunFolder::claim(&dir, Reuse::Resume)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("in use") && err.contains(&std::process::id().to_string()),
            "{err}"
        );
        drop(first);
        drop(RunFolder::claim(&dir, Reuse::Refuse).unwrap());
        let _ = fs::remove_dir_all(&dir);
    }
}
