//! What the GPT-NeoX and Llama layouts share: reading the model's tensors out as `f32` arrays
//! under ember's names, writing a file whose tensors are made from them one at a time, and
//! loading arrays, rearranged into ember's names, into the model one at a time.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Mutex;

use burn::store::burn_pack::{Bytes, DType, Tensor as PackTensor};
use burn::store::{ApplyError, ModuleSnapshot};
use burn::tensor::TensorData;
use ember_model::DecoderOnly;

use super::tensors::Array;
use crate::error::{Result, TrainError, write_err};

/// The model's tensors by ember's names, each read back as an `f32` array only when asked for.
pub(super) struct ModelTensors {
    by_name: HashMap<String, PackTensor>,
}

impl ModelTensors {
    pub fn of(model: &DecoderOnly) -> Self {
        let by_name = model
            .collect(None, None, false)
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        Self { by_name }
    }

    /// The tensor `name`'s values.
    pub fn array(&self, name: &str) -> std::result::Result<Array, String> {
        let tensor = self
            .by_name
            .get(name)
            .ok_or_else(|| format!("the model has no tensor `{name}`"))?;
        let shape = tensor.shape.as_slice().to_vec();
        let bytes = tensor.to_bytes().map_err(|e| format!("{name}: {e}"))?;
        let values = TensorData::from_bytes(bytes, shape.clone(), tensor.dtype)
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| format!("{name}: {e:?}"))?;
        Ok(Array { shape, values })
    }
}

/// One tensor of a file being written: its name and shape, and what makes its `f32` values
/// once the writer reaches it.
pub(super) struct Lazy<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub make: Box<dyn Fn() -> std::result::Result<Array, String> + 'a>,
}

/// Writes `tensors` (`f32`) as the safetensors file `path`, each made as the writer reaches it
/// and dropped once written: no more than one is held beside the model.
pub(super) fn write_each(path: &Path, tensors: Vec<Lazy<'_>>) -> Result<()> {
    let failure = RefCell::new(None);
    let pending: Vec<Pending> = tensors
        .iter()
        .map(|tensor| Pending {
            tensor,
            failure: &failure,
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let views = pending.iter().map(|p| (p.tensor.name.as_str(), p));
    let written = safetensors::serialize_to_file(views, Some(metadata), path);
    if let Some(message) = failure
        .into_inner()
        .or(written.err().map(|e| e.to_string()))
    {
        let _ = std::fs::remove_file(path);
        return Err(write_err(path, message));
    }
    Ok(())
}

/// A [`Lazy`] tensor as the safetensors writer sees it; what fails to be made is kept in
/// `failure` (the writer asks for bytes, not errors) and its bytes written as zeros.
struct Pending<'a, 'b> {
    tensor: &'a Lazy<'b>,
    failure: &'a RefCell<Option<String>>,
}

impl safetensors::View for &Pending<'_, '_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.tensor.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let len = self.data_len();
        match (self.tensor.make)() {
            Ok(array) if array.shape == self.tensor.shape => {
                let mut bytes = Vec::with_capacity(len);
                for v in &array.values {
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
                Cow::Owned(bytes)
            }
            made => {
                let message = match made {
                    Ok(array) => format!(
                        "`{}` came out of shape {:?}, not {:?}",
                        self.tensor.name, array.shape, self.tensor.shape
                    ),
                    Err(e) => e,
                };
                self.failure.borrow_mut().get_or_insert(message);
                Cow::Owned(vec![0; len])
            }
        }
    }

    fn data_len(&self) -> usize {
        self.tensor.shape.iter().product::<usize>() * size_of::<f32>()
    }
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
