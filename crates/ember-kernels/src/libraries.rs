//! NVIDIA's libraries that ember loads at run time (cuDNN, NCCL): where they may lie (the CUDA
//! toolkit's library folders, then the `nvidia/<name>/lib` folders of the Python environments
//! on `PATH`, where PyTorch's wheels bring them), and opening them and their functions.

use std::ffi::{CString, c_void};
use std::path::PathBuf;

/// `major.minor.patch` of a version number written `major * 10000 + minor * 100 + patch`
/// (cuDNN 9's and NCCL's).
pub(crate) fn version_name(version: u64) -> String {
    format!(
        "{}.{}.{}",
        version / 10000,
        version / 100 % 100,
        version % 100
    )
}

/// Opens `path` (a library file's path or name), `RTLD_LOCAL` (its symbols are not offered to
/// other libraries); null where it fails.
pub(crate) fn open(path: &str) -> *mut c_void {
    let Ok(c) = CString::new(path) else {
        return std::ptr::null_mut();
    };
    // SAFETY: dlopen of a library; a failure leaves nothing loaded.
    unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) }
}

/// The function `name` of the library `handle` (`library`, for the message), as `F`.
///
/// # Safety
/// `F` is the function's C signature.
pub(crate) unsafe fn symbol<F: Copy>(
    handle: *mut c_void,
    name: &str,
    library: &str,
) -> Result<F, String> {
    let c = CString::new(name).expect("a symbol name");
    // SAFETY: a symbol lookup in a loaded library.
    let address = unsafe { libc::dlsym(handle, c.as_ptr()) };
    if address.is_null() {
        return Err(format!("{library} has no {name}"));
    }
    // SAFETY (the caller's): `F` is a function pointer of the symbol's signature.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

/// The folders that hold `file`, in the order tried: `CUDA_PATH`'s and the usual toolkit
/// roots' library folders, then `<env>/lib/python3.X/site-packages/nvidia/<wheel>/lib` of each
/// `python3` on `PATH`.
pub(crate) fn folders(wheel: &str, file: &str) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(path) = std::env::var_os("CUDA_PATH") {
        roots.push(path.into());
    }
    roots.extend(["/usr/local/cuda", "/opt/cuda", "/usr/lib/cuda"].map(Into::into));
    for root in roots {
        for dir in ["lib64", "lib", "targets/x86_64-linux/lib"] {
            dirs.push(root.join(dir));
        }
    }
    // PyTorch's wheels: <env>/bin/python3 beside <env>/lib/python3.X/site-packages/nvidia/.
    for bin in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        if !bin.join("python3").exists() {
            continue;
        }
        let Some(env) = bin.parent() else { continue };
        let Ok(entries) = std::fs::read_dir(env.join("lib")) else {
            continue;
        };
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with("python3") {
                let nvidia = entry.path().join("site-packages/nvidia");
                dirs.push(nvidia.join(wheel).join("lib"));
            }
        }
    }
    dirs.retain(|d| d.join(file).exists());
    dirs
}
