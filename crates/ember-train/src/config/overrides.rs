//! `--set KEY=VALUE`: a TOML value at a dotted key, applied over the file's table.

use crate::error::{Result, TrainError};

/// One `--set section.key=value` of the command line: a config value given beside the file,
/// as nanoGPT's `--batch_size=32`. The value is read as TOML (`3e-4`, `true`, `"cuda"`, `[1,
/// 2]`); a value that is not TOML is taken as a string, so `training.device=cuda` works.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    /// The dotted key, e.g. `training.lr`.
    pub key: String,
    /// The value.
    pub value: toml::Value,
    text: String,
}

impl std::str::FromStr for Override {
    type Err = TrainError;

    fn from_str(text: &str) -> Result<Self> {
        let bad = |message: &str| TrainError::Override {
            text: text.to_string(),
            message: message.to_string(),
        };
        let Some((key, value)) = text.split_once('=') else {
            return Err(bad("expected section.key=value, e.g. training.lr=3e-4"));
        };
        let key = key.trim();
        let well_formed = |part: &str| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        if !key.split('.').all(well_formed) {
            return Err(bad("the key must be dotted names, e.g. training.lr"));
        }
        if key == "task" {
            return Err(bad(
                "the task is the config file's: choose a config of the other task",
            ));
        }
        let value = value.trim();
        let value = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.to_string()));
        Ok(Self {
            key: key.to_string(),
            value,
            text: text.to_string(),
        })
    }
}

impl std::fmt::Display for Override {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.text)
    }
}

impl Override {
    pub(super) fn error(&self, message: impl Into<String>) -> TrainError {
        TrainError::Override {
            text: self.text.clone(),
            message: message.into(),
        }
    }

    /// Sets the value in a parsed config file, making sections as needed.
    pub(super) fn apply(&self, table: &mut toml::Table) -> Result<()> {
        let parts: Vec<&str> = self.key.split('.').collect();
        let (last, sections) = parts.split_last().expect("a key has one part at least");
        let mut at = table;
        for (i, section) in sections.iter().enumerate() {
            let entry = at
                .entry(section.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            at = entry.as_table_mut().ok_or_else(|| {
                self.error(format!(
                    "`{}` is a value, not a section",
                    parts[..=i].join(".")
                ))
            })?;
        }
        at.insert(last.to_string(), self.value.clone());
        Ok(())
    }
}
