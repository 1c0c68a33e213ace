//! A Hugging Face folder's weights: one `model.safetensors`, or the shards
//! `model.safetensors.index.json` lists (transformers splits a model above its
//! `max_shard_size`: Llama 3.2 3B, Qwen2.5 3B and every larger model come so), each mapped into
//! memory and its tensors looked up by name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

use super::HF_WEIGHTS;
use crate::error::{Result, TrainError};

/// The index of a model saved in shards.
pub const HF_WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// The weights files of a folder, mapped (read-only).
pub(super) struct WeightFiles {
    /// `model.safetensors`, or the index of the shards: what errors name.
    path: PathBuf,
    maps: Vec<(PathBuf, memmap2::Mmap)>,
}

/// No file holds the tensor asked for.
#[derive(Debug)]
pub(super) struct Missing;

/// The files' tensors, read from their headers.
pub(super) struct Stored<'a> {
    files: Vec<SafeTensors<'a>>,
}

impl WeightFiles {
    /// Maps `dir`'s `model.safetensors`, or else every shard its index names.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join(HF_WEIGHTS);
        let (path, files) = if single.is_file() {
            (single.clone(), vec![single])
        } else {
            let index = dir.join(HF_WEIGHTS_INDEX);
            let files = shard_files(&index)?;
            (index, files)
        };
        let mut maps = Vec::with_capacity(files.len());
        for file in files {
            let map = super::tensors::map(&file).map_err(|e| TrainError::Checkpoint {
                path: file.clone(),
                message: format!("cannot read: {e}"),
            })?;
            maps.push((file, map));
        }
        Ok(Self { path, maps })
    }

    /// `model.safetensors`, or the shards' index: the file errors about the weights name.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every file's header read.
    pub fn read(&self) -> Result<Stored<'_>> {
        let files = self
            .maps
            .iter()
            .map(|(path, map)| {
                SafeTensors::deserialize(map).map_err(|e| TrainError::Checkpoint {
                    path: path.clone(),
                    message: format!("cannot read: {e}"),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Stored { files })
    }
}

impl Stored<'_> {
    /// The tensor `name`, in whichever file holds it; `Err` where none does.
    pub fn tensor(&self, name: &str) -> std::result::Result<TensorView<'_>, Missing> {
        self.files
            .iter()
            .find_map(|file| file.tensor(name).ok())
            .ok_or(Missing)
    }
}

/// The shard files the index at `path` names (its `weight_map`'s values), each once.
fn shard_files(path: &Path) -> Result<Vec<PathBuf>> {
    let bad = |message: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message,
    };
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let index: Index =
        serde_json::from_str(&text).map_err(|e| bad(format!("not a shard index: {e}")))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for name in index.weight_map.values() {
        let file = dir.join(name);
        if Path::new(name).components().count() != 1 {
            return Err(bad(format!(
                "names `{name}`, which is not a file beside it"
            )));
        }
        if !files.contains(&file) {
            if !file.is_file() {
                return Err(bad(format!("names the shard `{name}`, which is missing")));
            }
            files.push(file);
        }
    }
    if files.is_empty() {
        return Err(bad("lists no tensors (`weight_map` is empty)".into()));
    }
    Ok(files)
}
