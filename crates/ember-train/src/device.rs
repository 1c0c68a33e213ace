//! Choosing the compute device by name at run time.
//!
//! `flex` (Burn's CPU backend) is always there; `ndarray`, `wgpu`, `vulkan` and `cuda` are
//! cargo features of this build. A GPU device is probed when it is asked for, so that a build
//! with GPU support on a machine without a GPU fails with a message, not a panic.

use burn::tensor::Device;

use crate::error::{Result, TrainError};

/// Device names this build knows, in the order `auto` prefers them (GPUs first).
pub fn available() -> Vec<&'static str> {
    let mut names = Vec::new();
    if cfg!(feature = "cuda") {
        names.push("cuda");
    }
    if cfg!(feature = "vulkan") {
        names.push("vulkan");
    }
    if cfg!(feature = "wgpu") {
        names.push("wgpu");
    }
    names.push("flex");
    if cfg!(feature = "ndarray") {
        names.push("ndarray");
    }
    names
}

/// The cargo feature that brings device `name` in, for names this build may lack.
fn feature_of(name: &str) -> Option<&'static str> {
    match name {
        "ndarray" => Some("ndarray"),
        "wgpu" => Some("wgpu"),
        "vulkan" => Some("vulkan"),
        "cuda" => Some("cuda"),
        _ => None,
    }
}

/// `name` split into the backend and an optional index (`cuda:1`).
fn split(name: &str) -> (&str, Option<&str>) {
    match name.split_once(':') {
        Some((kind, index)) => (kind, Some(index)),
        None => (name, None),
    }
}

/// Checks that `name` names a device this build has, without starting it (for config
/// validation).
pub fn check_name(name: &str) -> Result<()> {
    let (kind, index) = split(name);
    if let Some(index) = index
        && index.parse::<usize>().is_err()
    {
        return Err(TrainError::Device(format!(
            "device `{name}`: `{index}` is not a device index (e.g. cuda:0)"
        )));
    }
    match kind {
        "flex" | "cpu" | "auto" => Ok(()),
        k if available().contains(&k) => Ok(()),
        k if feature_of(k).is_some() => Err(missing(k)),
        _ => Err(TrainError::Device(format!(
            "unknown device `{name}`; available: {}, auto",
            available().join(", ")
        ))),
    }
}

/// Checks a training device list, `NAME` or `NAME,NAME,...` (e.g. `cuda:0,cuda:1`), without
/// starting the devices, and returns how many it names. `auto` stands alone.
pub fn check_list(names: &str) -> Result<usize> {
    let names = split_list(names)?;
    for name in &names {
        check_name(name)?;
    }
    Ok(names.len())
}

/// The names of a comma-separated device list, trimmed; an empty entry or `auto` in a list of
/// several is an error.
fn split_list(names: &str) -> Result<Vec<&str>> {
    let list: Vec<&str> = names.split(',').map(str::trim).collect();
    if list.iter().any(|n| n.is_empty()) {
        return Err(TrainError::Device(format!(
            "device list `{names}` has an empty entry (write e.g. cuda:0,cuda:1)"
        )));
    }
    if list.len() > 1 && list.contains(&"auto") {
        return Err(TrainError::Device(format!(
            "device list `{names}`: `auto` picks one device and cannot be part of a list"
        )));
    }
    Ok(list)
}

/// The devices of a training run: one name, or several separated by commas for data-parallel
/// training (`cuda:0,cuda:1`). The first device holds the model and the optimizer.
pub fn parse_list(names: &str) -> Result<Vec<Device>> {
    split_list(names)?.into_iter().map(parse).collect()
}

/// The device called `name`: `flex` (or `cpu`), `ndarray`, `wgpu`, `vulkan`, `cuda` or
/// `cuda:N`, or `auto` (the first GPU this build has that answers, else `flex`). A name this
/// build lacks is an error saying which cargo feature adds it; a GPU that does not answer is an
/// error saying so.
pub fn parse(name: &str) -> Result<Device> {
    if name.contains(',') {
        return Err(TrainError::Device(format!(
            "`{name}`: this command runs on one device; lists of devices are for `ember train`"
        )));
    }
    check_name(name)?;
    let (kind, index) = split(name);
    let index: usize = index.map_or(0, |i| i.parse().unwrap_or(0));
    match kind {
        "flex" | "cpu" => Ok(Device::flex()),
        "auto" => Ok(auto()),
        gpu => start(gpu, index),
    }
}

/// The first GPU that answers, else the CPU.
fn auto() -> Device {
    for name in available() {
        if name == "flex" {
            break;
        }
        if let Ok(device) = start(name, 0) {
            return device;
        }
    }
    Device::flex()
}

/// Starts a compiled-in non-default device and checks it computes.
#[allow(unused_variables, unreachable_code)]
fn start(name: &str, index: usize) -> Result<Device> {
    let make: fn(usize) -> Device = match name {
        #[cfg(feature = "ndarray")]
        #[allow(deprecated)]
        "ndarray" => |_| Device::ndarray(),
        #[cfg(feature = "wgpu")]
        "wgpu" => |_| Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        #[cfg(feature = "vulkan")]
        "vulkan" => |_| Device::vulkan(burn::tensor::DeviceKind::DefaultDevice),
        #[cfg(feature = "cuda")]
        "cuda" => Device::cuda,
        other => return Err(missing(other)),
    };
    if name == "cuda" {
        // The LLVM route links libdevice into kernels; the NVRTC route compiles C++ against
        // the toolkit's headers.
        #[cfg(not(feature = "cuda-nvrtc"))]
        cuda::check_libdevice()?;
        #[cfg(feature = "cuda-nvrtc")]
        cuda::check_headers()?;
    }
    #[cfg(feature = "autotune")]
    cache_compiled_kernels();
    probe(name, move || make(index)).map_err(|e| match (name, e) {
        ("cuda", TrainError::Device(message)) => TrainError::Device(cuda::explain(message)),
        ("vulkan" | "wgpu", TrainError::Device(message)) => {
            TrainError::Device(vulkan::explain(name, message, vulkan::loader_found))
        }
        (_, e) => e,
    })
}

/// Keeps the kernels cubecl compiles between runs, beside its autotune results (cubecl's
/// compilation cache, off by default): a run then starts without compiling them again
/// (measured on lavapipe with fusion: 200 tokens in 9.2 s instead of 13.5 s). Settings of a
/// `cubecl.toml` in the working directory and `CUBECL_*` variables still apply. Called before
/// the first device starts; a configuration already read is left as it is. The store exists only
/// where cubecl-server is built with `persistence`, which Burn's `cuda` and `vulkan` features
/// leave out (this crate turns it on, Cargo.toml): without it `cuda` compiled every kernel in
/// every process (on an H200, 20 kernels and about 0.6 s of each 500-token sample's 2 s).
#[cfg(feature = "autotune")]
fn cache_compiled_kernels() {
    use cubecl_runtime::config::{CubeClRuntimeConfig, RuntimeConfig};
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.compilation.cache = true;
    // An NVRTC build tunes cubek's products to kernels the LLVM build cannot launch (on an H200:
    // Hopper's TMA products), under the same autotune keys: a machine's shared results made the
    // LLVM build fail its first product ("TMA is not available"). Each build keeps its own
    // environment unless one is named (`CUBECL_ENVIRONMENT`, a cubecl.toml).
    #[cfg(feature = "cuda-nvrtc")]
    {
        use cubecl_runtime::config::environment::EnvironmentConfig;
        if config.environment.name == EnvironmentConfig::default().name {
            config.environment.name = "ember-cuda-nvrtc".into();
        }
    }
    let _ = CubeClRuntimeConfig::try_set(config);
}

/// What the CUDA device needs on the machine it runs on, checked before Burn's start-up (which
/// fails on another thread and reports only that its channel closed).
#[allow(dead_code)]
mod cuda {
    use std::path::{Path, PathBuf};

    use crate::error::TrainError;

    /// Where cubecl-llvm looks for the CUDA toolkit when `CUDA_PATH` is unset, in its order.
    const CUDA_ROOTS: [&str; 4] = ["/usr/local/cuda", "/opt/cuda", "/usr/lib/cuda", "/usr"];

    /// The toolkit's math library, which kernels using exp/log/erf/tanh link (every training
    /// step does): looked up as cubecl-llvm does, so a missing one fails here with the path
    /// instead of inside the first kernel.
    pub fn check_libdevice() -> Result<(), TrainError> {
        let root = match std::env::var_os("CUDA_PATH") {
            Some(path) => Some(PathBuf::from(path)),
            None => CUDA_ROOTS
                .iter()
                .map(Path::new)
                .find(|root| root.join("nvvm/libdevice").is_dir())
                .map(Path::to_path_buf),
        };
        let looked = match &root {
            Some(root) => {
                let file = root.join("nvvm/libdevice/libdevice.10.bc");
                if file.is_file() {
                    return Ok(());
                }
                file.display().to_string()
            }
            None => format!(
                "nvvm/libdevice/libdevice.10.bc under {}",
                CUDA_ROOTS.join(", ")
            ),
        };
        Err(TrainError::Device(format!(
            "device `cuda` needs the CUDA toolkit's libdevice (not found: {looked}); install the \
             toolkit or set CUDA_PATH to it"
        )))
    }

    /// With `cuda-nvrtc`, kernels are CUDA C++ that NVRTC compiles against the toolkit's headers,
    /// found as cubecl-cuda finds them (`CUDA_PATH`, /usr/local/cuda, /opt/cuda, /usr): checked
    /// here because cubecl-cuda panics with a message whose first line is empty.
    #[cfg(feature = "cuda-nvrtc")]
    pub fn check_headers() -> Result<(), TrainError> {
        let looked = match cubecl_cuda::install::cuda_path() {
            Some(root) => {
                let header = root.join("include/cuda_fp16.h");
                if header.is_file() {
                    return Ok(());
                }
                header.display().to_string()
            }
            None => {
                "include/cuda_fp16.h under CUDA_PATH, /usr/local/cuda, /opt/cuda or /usr".into()
            }
        };
        Err(TrainError::Device(format!(
            "device `cuda` (an NVRTC build) needs the CUDA toolkit's headers (not found: \
             {looked}); install the toolkit or set CUDA_PATH to it"
        )))
    }

    /// Folders where the NVIDIA driver's `libcuda.so.1` usually is.
    fn driver_found() -> bool {
        let extra = [
            "/usr/local/nvidia/lib64",
            "/usr/local/nvidia/lib",
            "/usr/lib/wsl/lib",
        ];
        super::library_found("libcuda.so.1", &extra)
            || Path::new("/proc/driver/nvidia/version").exists()
    }

    /// Replaces Burn's start-up failure (a closed channel) with what is missing, where that can
    /// be told.
    pub fn explain(message: String) -> String {
        if driver_found() {
            message
        } else {
            "device `cuda` is in this build but found no NVIDIA driver on this machine \
             (no libcuda.so.1, no /proc/driver/nvidia); available here: flex"
                .into()
        }
    }
}

/// Whether the dynamic linker's usual places hold the library `file`: the folders of
/// `LD_LIBRARY_PATH`, the system's library folders and `extra`.
fn library_found(file: &str, extra: &[&str]) -> bool {
    let mut dirs: Vec<std::path::PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    let system = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ];
    dirs.extend(system.iter().chain(extra).map(std::path::PathBuf::from));
    dirs.iter().any(|d| d.join(file).exists())
}

/// What the Vulkan devices need on the machine they run on: wgpu starts its adapter on another
/// thread and, where there is none, Burn reports only that the thread's channel closed
/// (`RecvError`).
mod vulkan {
    /// The Vulkan loader's library file, which wgpu opens by this name.
    const LOADER: &str = "libvulkan.so.1";

    /// Whether the dynamic linker can find the Vulkan loader: in `LD_LIBRARY_PATH`, the usual
    /// library folders, or the linker's cache (`/etc/ld.so.cache`, which names every library
    /// `ldconfig` found).
    pub fn loader_found() -> bool {
        super::library_found(LOADER, &["/usr/local/lib"])
            || std::fs::read("/etc/ld.so.cache")
                .is_ok_and(|cache| cache.windows(LOADER.len()).any(|w| w == LOADER.as_bytes()))
    }

    /// Replaces a start-up failure that names only a closed channel with what is missing: the
    /// loader, or a driver it can start (seen on an NVIDIA machine: the driver's Vulkan
    /// library, `libGLX_nvidia.so.0`, needs libglvnd's `libGLX` and `libGLdispatch`, and its
    /// manifest was outside the loader's folders). Other failures keep their own message.
    pub fn explain(name: &str, message: String, loader_found: impl FnOnce() -> bool) -> String {
        if !message.contains("RecvError") {
            message
        } else if !loader_found() {
            format!(
                "device `{name}` is in this build but this machine has no Vulkan loader \
                 ({LOADER}; Debian and Ubuntu: the package libvulkan1); available here: flex"
            )
        } else {
            format!(
                "device `{name}` is in this build but the Vulkan loader started no GPU driver \
                 (VK_LOADER_DEBUG=error prints its reasons; NVIDIA's driver also needs libglvnd, \
                 Debian's libglx0 and libglvnd0, and VK_DRIVER_FILES set to its nvidia_icd.json \
                 where that is outside /usr/share/vulkan/icd.d); available here: flex"
            )
        }
    }
}

/// Creates a device and runs one small computation on it. Backends panic when there is no
/// adapter or driver; that panic is caught (and kept off stderr) and becomes an error.
#[allow(dead_code)]
fn probe(name: &str, make: impl FnOnce() -> Device + std::panic::UnwindSafe) -> Result<Device> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(|| {
        let device = make();
        let x = burn::tensor::Tensor::<1>::from_floats([1.0, 2.0], &device);
        let sum: f32 = x.sum().into_scalar();
        (sum == 3.0).then_some(device)
    });
    std::panic::set_hook(hook);
    match result {
        Ok(Some(device)) => Ok(device),
        Ok(None) => Err(TrainError::Device(format!(
            "device `{name}` started but computed 1 + 2 wrongly"
        ))),
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "no reason given".into());
            Err(TrainError::Device(format!(
                "device `{name}` is in this build but did not start on this machine ({}); available here: flex",
                why.lines().next().unwrap_or_default()
            )))
        }
    }
}

/// A device this build was compiled without.
fn missing(name: &str) -> TrainError {
    let hint = match feature_of(name) {
        Some(feature) => {
            // Burn's CUDA backend builds against LLVM, which the setup script provides.
            match feature {
                "cuda" => "build it with `bash scripts/setup-cuda.sh --build`; see README, Devices"
                    .to_string(),
                _ => format!(
                    "rebuild with `cargo build --release -p ember-cli --features {feature}`"
                ),
            }
        }
        None => "unknown".into(),
    };
    TrainError::Device(format!(
        "device `{name}` is not in this build ({hint}); available: {}",
        available().join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_this_build_lacks_say_how_to_get_them() {
        assert!(parse("flex").is_ok() && parse("cpu").is_ok() && parse("auto").is_ok());
        let err = check_name("tpu").unwrap_err().to_string();
        assert!(
            err.contains("unknown device `tpu`") && err.contains("flex"),
            "{err}"
        );
        let err = check_name("cuda:x").unwrap_err().to_string();
        assert!(err.contains("not a device index"), "{err}");
        assert_eq!(parse_list("flex, cpu").unwrap().len(), 2);
        let err = check_list("flex,,flex").unwrap_err().to_string();
        assert!(err.contains("empty entry"), "{err}");
        let err = check_list("auto,flex").unwrap_err().to_string();
        assert!(err.contains("cannot be part of a list"), "{err}");
        let err = check_list("flex,tpu").unwrap_err().to_string();
        assert!(err.contains("unknown device `tpu`"), "{err}");
        let err = parse("flex,flex").unwrap_err().to_string();
        assert!(err.contains("one device"), "{err}");
        if !cfg!(feature = "cuda") {
            let err = check_name("cuda:1").unwrap_err().to_string();
            assert!(err.contains("scripts/setup-cuda.sh --build"), "{err}");
        }
    }

    #[test]
    fn a_vulkan_device_that_does_not_start_says_what_is_missing() {
        // Burn's message when wgpu found no adapter, as `probe` words it.
        let closed = "device `vulkan` is in this build but did not start on this machine \
                      (called `Result::unwrap()` on an `Err` value: RecvError); available here: flex";
        let no_loader = vulkan::explain("vulkan", closed.into(), || false);
        assert!(
            no_loader.contains("no Vulkan loader (libvulkan.so.1")
                && no_loader.contains("libvulkan1")
                && !no_loader.contains("RecvError"),
            "{no_loader}"
        );
        let no_driver = vulkan::explain("wgpu", closed.into(), || true);
        assert!(
            no_driver.starts_with("device `wgpu`")
                && no_driver.contains("started no GPU driver")
                && no_driver.contains("VK_LOADER_DEBUG=error")
                && no_driver.contains("libglvnd")
                && !no_driver.contains("RecvError"),
            "{no_driver}"
        );
        // Another failure keeps its own words.
        let other = "device `vulkan` started but computed 1 + 2 wrongly".to_string();
        assert_eq!(vulkan::explain("vulkan", other.clone(), || true), other);
    }
}
