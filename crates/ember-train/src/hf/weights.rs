//! What the GPT-NeoX and Llama layouts share: reading the model's tensors out as `f32` arrays
//! under ember's names, one at a time, for a writer that renames and rearranges them; and
//! loading a set of arrays, rearranged into ember's names, into the model.

use std::collections::BTreeMap;
use std::path::Path;

use burn::store::{ApplyError, ModuleSnapshot, SafetensorsStore};
use ember_model::DecoderOnly;
use safetensors::SafeTensors;

use super::tensors::{Array, read_array, serialize};
use crate::error::{Result, TrainError, write_err};

/// Calls `each(i, array)` for the `i`-th of `names` (tensors of `model`, ember's names), read
/// as an `f32` array one at a time; `path` is the file being written, for errors.
pub(super) fn each_tensor<'a>(
    model: &DecoderOnly,
    names: impl IntoIterator<Item = &'a str>,
    path: &Path,
    mut each: impl FnMut(usize, Array),
) -> Result<()> {
    let failed = |e: String| write_err(path, e);
    let mut store = SafetensorsStore::from_bytes(None);
    model
        .save_into(&mut store)
        .map_err(|e| failed(e.to_string()))?;
    let bytes = store.get_bytes().map_err(|e| failed(e.to_string()))?;
    let ours = SafeTensors::deserialize(&bytes).map_err(|e| failed(e.to_string()))?;
    for (i, name) in names.into_iter().enumerate() {
        let view = ours
            .tensor(name)
            .map_err(|e| failed(format!("{name}: {e}")))?;
        each(
            i,
            read_array(&view).map_err(|e| failed(format!("{name}: {e}")))?,
        );
    }
    Ok(())
}

/// `arrays` (`f32`, ember's names, every tensor the file's config describes, each checked
/// against it already) loaded into `model`; what does not fit is ember's side, named.
pub(super) fn load_arrays(
    mut model: DecoderOnly,
    arrays: BTreeMap<String, Array>,
    path: &Path,
) -> Result<DecoderOnly> {
    let bad = |message: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message,
    };
    let bytes = serialize(&arrays).map_err(|e| bad(format!("cannot convert: {e}")))?;
    drop(arrays);
    let mut store = SafetensorsStore::from_bytes(Some(bytes)).validate(false);
    let result = model
        .load_from(&mut store)
        .map_err(|e| bad(format!("cannot read: {e}")))?;
    let left = result.errors.first().map(|e| match e {
        ApplyError::ShapeMismatch { path, .. } => path.clone(),
        other => other.to_string(),
    });
    if let Some(what) = left.or_else(|| result.missing.first().map(|(p, _)| p.clone())) {
        return Err(bad(format!(
            "does not fit the model config.json describes: {what}"
        )));
    }
    Ok(model)
}
