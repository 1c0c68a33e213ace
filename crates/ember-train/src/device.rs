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
        "ndarray" | "wgpu" | "vulkan" | "cuda" => Err(TrainError::Device(format!(
            "device `{name}` is not in this build (build with `cargo build --release --features {name}`); available: {}",
            available().join(", ")
        ))),
        other => Err(TrainError::Device(format!(
            "unknown device `{other}`; available: {}, auto",
            available().join(", ")
        ))),
    }
}
