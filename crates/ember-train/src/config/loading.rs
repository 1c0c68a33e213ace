//! Reading a TOML file into a config: errors name the file and the line and key, or the key
//! and value, at fault (and the `--set` that gave it).

use std::path::Path;

use super::overrides::Override;
use crate::error::{Result, TrainError};

/// Reads `path` and deserializes it; errors name the file and the parser's line and key.
pub(crate) fn parse_toml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::ConfigFile {
        path: path.to_path_buf(),
        message: format!("cannot read config: {e}"),
    })?;
    toml::from_str(&text).map_err(|e| TrainError::ConfigFile {
        path: path.to_path_buf(),
        message: one_line(&e),
    })
}

/// Reads `path`, applies `overrides` one at a time, and deserializes. The file alone is read
/// first, so that its own errors name its line; each override is then checked as it is applied,
/// so that an unknown key or a value of the wrong type names the override.
pub(crate) fn parse_with<T: serde::de::DeserializeOwned>(
    path: &Path,
    overrides: &[Override],
) -> Result<T> {
    let parsed: T = parse_toml(path)?;
    if overrides.is_empty() {
        return Ok(parsed);
    }
    let mut table: toml::Table = parse_toml(path)?;
    for o in overrides {
        o.apply(&mut table)?;
        toml::Value::Table(table.clone())
            .try_into::<T>()
            .map_err(|e| o.error(e.message().trim().replace('\n', " ")))?;
    }
    toml::Value::Table(table)
        .try_into::<T>()
        .map_err(|e| TrainError::ConfigFile {
            path: path.to_path_buf(),
            message: e.message().trim().to_string(),
        })
}

/// A validation error of a config read from `path` with `overrides`: the override whose key
/// it names is blamed, else the file.
pub(crate) fn blame(path: &Path, overrides: &[Override], e: TrainError) -> TrainError {
    let text = e.to_string();
    let named = |o: &&Override| {
        let last = o.key.rsplit('.').next().unwrap_or_default();
        text.contains(&o.key)
            || text.contains(&format!("`{last}`"))
            || text.contains(&format!("{last} "))
    };
    match overrides.iter().rev().find(named) {
        Some(o) if matches!(e, TrainError::ConfigValue { .. } | TrainError::Model(_)) => {
            o.error(text)
        }
        _ => in_file(path, e),
    }
}

/// A validation error of the config read from `path`, prefixed with the file's name.
pub(crate) fn in_file(path: &Path, e: TrainError) -> TrainError {
    match e {
        TrainError::ConfigValue { .. } | TrainError::Model(_) => TrainError::ConfigFile {
            path: path.to_path_buf(),
            message: e.to_string(),
        },
        other => other,
    }
}

/// The TOML parser's message on one line: "line 3, column 1: unknown field `d_modle`, ...".
pub(super) fn one_line(e: &toml::de::Error) -> String {
    let message = e.message().trim().replace('\n', " ");
    let full = e.to_string();
    let location = full.lines().next().unwrap_or_default();
    match location.strip_prefix("TOML parse error at ") {
        Some(at) => format!("{at}: {message}"),
        None => message,
    }
}
