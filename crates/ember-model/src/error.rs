//! The one error type of the model crate: a configuration that cannot build a model.

use std::fmt;

/// A model configuration was rejected. The message names the field and the value at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The field of the config that is at fault, e.g. `n_heads`.
    pub field: &'static str,
    /// What is wrong with it, including the value.
    pub message: String,
}

impl ConfigError {
    pub(crate) fn new(field: &'static str, message: impl Into<String>) -> Self {
        Self {
            field,
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid model config: `{}` {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

/// Checks shared by every config: a size must be at least one.
pub(crate) fn positive(field: &'static str, value: usize) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(ConfigError::new(field, "must be at least 1, got 0"));
    }
    Ok(())
}

/// A dropout probability must lie in `[0, 1)`.
pub(crate) fn probability(field: &'static str, value: f64) -> Result<(), ConfigError> {
    if !(0.0..1.0).contains(&value) {
        return Err(ConfigError::new(
            field,
            format!("must be in [0, 1), got {value}"),
        ));
    }
    Ok(())
}

/// A LayerNorm epsilon must be a small positive number.
pub(crate) fn epsilon(field: &'static str, value: f64) -> Result<(), ConfigError> {
    if !(value.is_finite() && value > 0.0) {
        return Err(ConfigError::new(
            field,
            format!("must be a positive number, got {value}"),
        ));
    }
    Ok(())
}
