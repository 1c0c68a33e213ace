//! Reading a text corpus: the whole file as UTF-8, with errors that say where it goes wrong.

use std::path::Path;

use crate::error::{DataError, Result};

/// Reads `path` as UTF-8 text. A missing, unreadable or empty file, or invalid UTF-8, is an
/// error naming the file (and for UTF-8, the byte offset and line).
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|source| DataError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    if bytes.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    String::from_utf8(bytes).map_err(|e| {
        let offset = e.utf8_error().valid_up_to();
        let line = 1 + e.as_bytes()[..offset]
            .iter()
            .filter(|&&b| b == b'\n')
            .count();
        DataError::InvalidUtf8 {
            path: path.to_path_buf(),
            offset,
            line,
        }
    })
}

/// Splits token ids as nanoGPT does: the first `train_fraction` for training, the rest for
/// validation.
pub fn split(ids: &[u32], train_fraction: f64) -> (&[u32], &[u32]) {
    let n = ((ids.len() as f64) * train_fraction) as usize;
    ids.split_at(n.min(ids.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ember-corpus-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    #[test]
    fn errors_name_the_file_and_offset() {
        let missing = Path::new("/nonexistent/ember/corpus.txt");
        let err = read_text(missing).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/ember/corpus.txt"), "{err}");

        let empty = temp_file("empty.txt", b"");
        let err = read_text(&empty).unwrap_err().to_string();
        assert!(err.contains("empty.txt") && err.contains("empty"), "{err}");

        let bad = temp_file("bad.txt", b"ab\ncd\xffef");
        let err = read_text(&bad).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::InvalidUtf8 {
                    offset: 5,
                    line: 2,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("offset 5"), "{err}");
    }

    #[test]
    fn split_is_first_ninety_percent() {
        let ids: Vec<u32> = (0..100).collect();
        let (train, val) = split(&ids, 0.9);
        assert_eq!(train.len(), 90);
        assert_eq!(val, &ids[90..]);
    }
}
