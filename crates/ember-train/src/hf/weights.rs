//! What the GPT-NeoX and Llama layouts share: reading the model's tensors out as `f32` arrays
//! under ember's names, one at a time, for a writer that renames and rearranges them; and
//! loading arrays, rearranged into ember's names, into the model one at a time.

use std::path::Path;

use std::collections::BTreeSet;
use std::sync::Mutex;

use burn::store::burn_pack::{Bytes, DType, Tensor as PackTensor};
use burn::store::{ApplyError, ModuleSnapshot, SafetensorsStore};
use ember_model::DecoderOnly;
use safetensors::SafeTensors;

use super::tensors::{Array, read_array};
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

/// `tensors` (ember's names and `f32` arrays, every tensor of the model the file's config
/// describes, each checked against it already) loaded into `model` one at a time as the iterator
/// makes them, so that no more than one is held beside the model (a model of a few billion
/// parameters loads in the memory it takes); what does not fit is ember's side, named.
pub(super) fn load_each(
    mut model: DecoderOnly,
    tensors: impl IntoIterator<Item = Result<(String, Array)>>,
    path: &Path,
) -> Result<DecoderOnly> {
    let bad = |message: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message,
    };
    let unfit = |what: &str| {
        bad(format!(
            "does not fit the model config.json describes: {what}"
        ))
    };
    let mut left: Option<BTreeSet<String>> = None;
    for tensor in tensors {
        let (name, array) = tensor?;
        let len = array.values.len() * size_of::<f32>();
        // Burn's loader draws the bytes once; the values move into the tensor uncopied.
        let values = Mutex::new(Some(array.values));
        let take = move || {
            Ok(Bytes::from_elems(
                values.lock().unwrap().take().unwrap_or_default(),
            ))
        };
        let one = PackTensor::deferred(name.clone(), DType::F32, array.shape, None, len, take);
        let result = model.apply(vec![one], None, None, false);
        if let Some(error) = result.errors.first() {
            return Err(unfit(&match error {
                ApplyError::ShapeMismatch { path, .. } => path.clone(),
                other => other.to_string(),
            }));
        }
        if result.applied.is_empty() {
            return Err(unfit(&name));
        }
        // The model's tensors not loaded yet: every one but this at first.
        let left = left.get_or_insert_with(|| result.missing.into_iter().map(|(p, _)| p).collect());
        left.remove(&name);
    }
    if let Some(what) = left.and_then(|left| left.into_iter().next()) {
        return Err(unfit(&what));
    }
    Ok(model)
}
