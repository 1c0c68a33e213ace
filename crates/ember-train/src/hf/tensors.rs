//! Tensors as plain `f32` arrays, read from and written to safetensors bytes: what moves
//! between a Hugging Face layout and ember's where names alone do not (transposed weights,
//! regrouped rows), and what a file of `f16` or `bf16` weights becomes (ember's are `f32`).

use std::collections::BTreeMap;

use burn::tensor::{DType, TensorData};
use safetensors::{Dtype, tensor::TensorView};

/// A tensor's shape and `f32` values, row-major.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Array {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

impl Array {
    /// `[r, c]` -> `[c, r]`.
    pub fn transposed(&self) -> Array {
        let (r, c) = (self.shape[0], self.shape[1]);
        let mut values = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                values[j * r + i] = self.values[i * c + j];
            }
        }
        Array {
            shape: vec![c, r],
            values,
        }
    }

    /// Rows (entries of a vector) reordered: row `i` of the result is row `from(i)`.
    pub fn rows_from(&self, from: impl Fn(usize) -> usize) -> Array {
        let rows = self.shape[0];
        let width = self.values.len() / rows.max(1);
        let mut values = Vec::with_capacity(self.values.len());
        for i in 0..rows {
            let j = from(i);
            values.extend_from_slice(&self.values[j * width..(j + 1) * width]);
        }
        Array {
            shape: self.shape.clone(),
            values,
        }
    }
}

/// The `f32` values of a stored tensor (stored as `f32`, `f16` or `bf16`).
pub(super) fn read_array(view: &TensorView<'_>) -> std::result::Result<Array, String> {
    let dtype = match view.dtype() {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        other => {
            return Err(format!(
                "is stored as {other:?}; ember reads F32, F16 and BF16"
            ));
        }
    };
    let shape = view.shape().to_vec();
    let data = TensorData::from_bytes_vec(view.data().to_vec(), shape.clone(), dtype);
    let values = data
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| format!("cannot be read as f32: {e:?}"))?;
    Ok(Array { shape, values })
}

/// An array as safetensors writes it: `f32`, each tensor's bytes made only as it is written
/// (not all of them held beside the arrays at once).
impl safetensors::View for &Array {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        self.values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn data_len(&self) -> usize {
        self.values.len() * size_of::<f32>()
    }
}

/// Safetensors bytes of `arrays` (`f32`).
pub(super) fn serialize(arrays: &BTreeMap<String, Array>) -> std::result::Result<Vec<u8>, String> {
    let metadata = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize(arrays, Some(metadata)).map_err(|e| e.to_string())
}

/// The file at `path`, mapped into memory (read-only): a model's weights are not copied
/// whole before they are read.
pub(super) fn map(path: &std::path::Path) -> std::io::Result<memmap2::Mmap> {
    let file = std::fs::File::open(path)?;
    // SAFETY: read-only; ember never writes a weights file in place (an export writes a new
    // folder), so the bytes change under the map only if another program rewrites the file
    // while it loads, which the format's length checks make unlikely to go unnoticed.
    unsafe { memmap2::Mmap::map(&file) }
}

/// The safetensors file `bytes` with every tensor in `f32`, or `None` where all already are
/// (a model saved in half precision, as many on the Hugging Face hub are, loads as `f32`).
pub(super) fn in_f32(bytes: &[u8]) -> std::result::Result<Option<Vec<u8>>, String> {
    let file = safetensors::SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    let tensors = file.tensors();
    if tensors.iter().all(|(_, view)| view.dtype() == Dtype::F32) {
        return Ok(None);
    }
    let mut arrays = BTreeMap::new();
    for (name, view) in tensors {
        let array = read_array(&view).map_err(|e| format!("tensor `{name}` {e}"))?;
        arrays.insert(name, array);
    }
    serialize(&arrays).map(Some)
}
