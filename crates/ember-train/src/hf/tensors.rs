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
        self.columns_transposed(0, self.shape[1])
    }

    /// Columns `a..b` of `[r, c]`, transposed: `[b - a, r]`.
    pub fn columns_transposed(&self, a: usize, b: usize) -> Array {
        let (r, c, w) = (self.shape[0], self.shape[1], b - a);
        let mut values = vec![0.0; w * r];
        transpose_into(|i, j| self.values[i * c + a + j], r, w, &mut values, 0);
        Array {
            shape: vec![w, r],
            values,
        }
    }

    /// Arrays `[r_i, c]` stacked along their first axis, `[sum r_i, c]` (one array is itself).
    pub fn stacked(mut parts: Vec<Array>) -> Array {
        if parts.len() == 1 {
            return parts.pop().expect("one part");
        }
        let rows: usize = parts.iter().map(|p| p.shape[0]).sum();
        let mut shape = parts[0].shape.clone();
        shape[0] = rows;
        let mut values = Vec::with_capacity(shape.iter().product());
        for part in &parts {
            values.extend_from_slice(&part.values);
        }
        Array { shape, values }
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

/// `src` `[r, c]` transposed into columns `at..at + r` of `dst` `[c, width]` (`width` its row
/// length), in square tiles, so that both sides are read and written a cache line at a time;
/// `src`'s entry `(i, j)` is `value(i, j)`.
fn transpose_into(
    value: impl Fn(usize, usize) -> f32,
    r: usize,
    c: usize,
    dst: &mut [f32],
    at: usize,
) {
    const TILE: usize = 32;
    let width = dst.len() / c.max(1);
    for i0 in (0..r).step_by(TILE) {
        for j0 in (0..c).step_by(TILE) {
            for i in i0..(i0 + TILE).min(r) {
                for j in j0..(j0 + TILE).min(c) {
                    dst[j * width + at + i] = value(i, j);
                }
            }
        }
    }
}

/// Stored matrices `[r_i, c]` stacked along their first axis and transposed, `[c, sum r_i]`,
/// as `f32`, read straight from the file into the result (a model's weights are most of its
/// bytes: no copy of them is made on the way).
pub(super) fn read_transposed(views: &[TensorView<'_>]) -> std::result::Result<Array, String> {
    let rows: usize = views.iter().map(|v| v.shape()[0]).sum();
    let c = views[0].shape()[1];
    let mut values = vec![0.0; rows * c];
    let mut at = 0;
    for view in views {
        let (r, bytes) = (view.shape()[0], view.data());
        match view.dtype() {
            Dtype::F32 => transpose_into(|i, j| f32_at(bytes, i * c + j), r, c, &mut values, at),
            Dtype::BF16 => transpose_into(|i, j| bf16_at(bytes, i * c + j), r, c, &mut values, at),
            _ => {
                let part = read_array(view)?;
                transpose_into(|i, j| part.values[i * c + j], r, c, &mut values, at);
            }
        }
        at += r;
    }
    Ok(Array {
        shape: vec![c, rows],
        values,
    })
}

/// Entry `k` of little-endian `f32` bytes.
fn f32_at(bytes: &[u8], k: usize) -> f32 {
    let b = &bytes[4 * k..4 * k + 4];
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Entry `k` of little-endian bfloat16 bytes, which are the top half of an `f32`.
fn bf16_at(bytes: &[u8], k: usize) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes([bytes[2 * k], bytes[2 * k + 1]])) << 16)
}

/// The `f32` values of a stored tensor (stored as `f32`, `f16` or `bf16`; the file's bytes
/// need not be aligned).
pub(super) fn read_array(view: &TensorView<'_>) -> std::result::Result<Array, String> {
    let shape = view.shape().to_vec();
    let bytes = view.data();
    let values = match view.dtype() {
        Dtype::F32 => (0..bytes.len() / 4).map(|k| f32_at(bytes, k)).collect(),
        Dtype::BF16 => (0..bytes.len() / 2).map(|k| bf16_at(bytes, k)).collect(),
        Dtype::F16 => TensorData::from_bytes_vec(bytes.to_vec(), shape.clone(), DType::F16)
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| format!("cannot be read as f32: {e:?}"))?,
        other => {
            return Err(format!(
                "is stored as {other:?}; ember reads F32, F16 and BF16"
            ));
        }
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Two stored matrices whose sizes are not multiples of the transposition's tiles, read
    /// stacked and transposed from the file, equal the same stacked in memory and transposed
    /// one entry at a time.
    #[test]
    fn read_transposed_is_the_stack_transposed() {
        let array = |r: usize, c: usize, from: usize| Array {
            shape: vec![r, c],
            values: (0..r * c).map(|v| (from + v) as f32).collect(),
        };
        let (a, b) = (array(37, 45, 0), array(5, 45, 10_000));
        let arrays = BTreeMap::from([("a".to_string(), a.clone()), ("b".to_string(), b.clone())]);
        let bytes = serialize(&arrays).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let views = [file.tensor("a").unwrap(), file.tensor("b").unwrap()];
        let got = read_transposed(&views).unwrap();
        let stacked = Array::stacked(vec![a, b]);
        assert_eq!(got.shape, [45, 42]);
        for i in 0..42 {
            for j in 0..45 {
                assert_eq!(
                    got.values[j * 42 + i],
                    stacked.values[i * 45 + j],
                    "({i}, {j})"
                );
            }
        }
    }
}
