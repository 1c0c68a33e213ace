//! Choosing the compute device by name at run time.

use burn::tensor::Device;

use crate::error::{Result, TrainError};

/// Device names this build knows, in the order `auto` prefers them.
pub fn available() -> Vec<&'static str> {
    let mut names = vec!["flex"];
    if cfg!(feature = "ndarray") {
        names.push("ndarray");
    }
    names
}

/// The device called `name` (`flex`, `ndarray`, `auto`). An unknown name, or one this build
/// was compiled without, is an error listing the names available.
pub fn parse(name: &str) -> Result<Device> {
    match name {
        "flex" | "cpu" | "auto" => Ok(Device::flex()),
        #[cfg(feature = "ndarray")]
        #[allow(deprecated)]
        "ndarray" => Ok(Device::ndarray()),
        "wgpu" | "vulkan" | "cuda" => missing(name),
        #[cfg(not(feature = "ndarray"))]
        "ndarray" => missing(name),
        other => Err(TrainError::Device(format!(
            "unknown device `{other}`; available: {}, auto",
            available().join(", ")
        ))),
    }
}

/// A device this build was compiled without.
fn missing(name: &str) -> Result<Device> {
    let hint = match name {
        "ndarray" => "rebuild with `cargo build --release -p ember-cli --features ndarray`",
        _ => "ember has no GPU backend yet",
    };
    Err(TrainError::Device(format!(
        "device `{name}` is not in this build ({hint}); available: {}",
        available().join(", ")
    )))
}
