//! Finding and loading cuDNN 9 at run time, as cuBLAS is loaded: the binary builds and starts
//! without it, and the attention runs on ember's own path where it is missing.
//!
//! cuDNN 9 is a small front library (`libcudnn.so.9`) that opens its sub-libraries
//! (`libcudnn_graph`, `libcudnn_engines_*`, `libcudnn_heuristic`, ...) by name when first used,
//! and they must all be of one version: a machine may have two (a system package and PyTorch's
//! wheel), and a front library of one with sub-libraries of the other fails its first
//! descriptor. So exactly one folder's set is loaded:
//!
//! 1. the folder `CUDNN_PATH` names (or the folder of the file it names);
//! 2. else the one the dynamic linker finds for `libcudnn.so.9` (`LD_LIBRARY_PATH`, the
//!    system's folders), whose front library then finds its own sub-libraries the same way;
//! 3. else the CUDA toolkit's library folders (`CUDA_PATH`, `/usr/local/cuda`), then the
//!    `nvidia/cudnn/lib` folder of the Python environment of each `python3` on `PATH` (where
//!    PyTorch's wheels bring cuDNN).
//!
//! For a folder, its sub-libraries are opened by their full paths first, then its front
//! library: the front library's requests by name then find those already loaded. Everything is
//! opened `RTLD_LOCAL` (its symbols are not offered to other libraries), and cuBLAS (which
//! cuDNN may open too) is loaded first, so that both use the same cuBLAS.
//!
//! The functions are looked up in the loaded front library itself ([`Api`]), not by name
//! through the process (which could reach another copy).

use crate::libraries::{open, symbol, version_name};
use cudarc::cudnn::sys::{
    cudaStream_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t,
    cudnnBackendDescriptor_t, cudnnBackendDescriptorType_t, cudnnHandle_t,
};
use std::ffi::{CStr, c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The oldest cuDNN whose fused attention the graphs are written for (cudnn-frontend's causal
/// flash attention with dropout and its backward pass; 9.0 was the first cuDNN 9).
pub(crate) const OLDEST: usize = 9_00_00;

/// A cuDNN status (`cudnnStatus_t`; 0 is success), kept as a number: a newer cuDNN may return
/// values the bindings do not name.
pub(crate) type Status = u32;

/// The cuDNN functions ember calls, from the loaded front library.
#[allow(clippy::type_complexity)]
pub(crate) struct Api {
    pub version: usize,
    pub folder: String,
    pub create: unsafe extern "C" fn(*mut cudnnHandle_t) -> Status,
    pub set_stream: unsafe extern "C" fn(cudnnHandle_t, cudaStream_t) -> Status,
    pub error_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub last_error: unsafe extern "C" fn(*mut c_char, usize),
    pub create_descriptor:
        unsafe extern "C" fn(cudnnBackendDescriptorType_t, *mut cudnnBackendDescriptor_t) -> Status,
    pub destroy_descriptor: unsafe extern "C" fn(cudnnBackendDescriptor_t) -> Status,
    pub set_attribute: unsafe extern "C" fn(
        cudnnBackendDescriptor_t,
        cudnnBackendAttributeName_t,
        cudnnBackendAttributeType_t,
        i64,
        *const c_void,
    ) -> Status,
    pub get_attribute: unsafe extern "C" fn(
        cudnnBackendDescriptor_t,
        cudnnBackendAttributeName_t,
        cudnnBackendAttributeType_t,
        i64,
        *mut i64,
        *mut c_void,
    ) -> Status,
    pub finalize: unsafe extern "C" fn(cudnnBackendDescriptor_t) -> Status,
    pub execute: unsafe extern "C" fn(
        cudnnHandle_t,
        cudnnBackendDescriptor_t,
        cudnnBackendDescriptor_t,
    ) -> Status,
}

/// cuDNN's functions where it could be loaded and is at least [`OLDEST`], else why not (looked
/// for once).
pub(crate) fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        #[cfg(feature = "cublas")]
        let _ = crate::products::cublas::loadable();
        let (front, folder) = open_front()?;
        // SAFETY: `front` is a loaded cuDNN; each symbol is cast to its C signature.
        let api = unsafe {
            let get_version: unsafe extern "C" fn() -> usize =
                symbol(front, "cudnnGetVersion", "cuDNN")?;
            Api {
                version: get_version(),
                folder,
                create: symbol(front, "cudnnCreate", "cuDNN")?,
                set_stream: symbol(front, "cudnnSetStream", "cuDNN")?,
                error_string: symbol(front, "cudnnGetErrorString", "cuDNN")?,
                last_error: symbol(front, "cudnnGetLastErrorString", "cuDNN")?,
                create_descriptor: symbol(front, "cudnnBackendCreateDescriptor", "cuDNN")?,
                destroy_descriptor: symbol(front, "cudnnBackendDestroyDescriptor", "cuDNN")?,
                set_attribute: symbol(front, "cudnnBackendSetAttribute", "cuDNN")?,
                get_attribute: symbol(front, "cudnnBackendGetAttribute", "cuDNN")?,
                finalize: symbol(front, "cudnnBackendFinalize", "cuDNN")?,
                execute: symbol(front, "cudnnBackendExecute", "cuDNN")?,
            }
        };
        match api.version >= OLDEST {
            true => Ok(api),
            false => Err(format!(
                "cuDNN {} in {} is older than 9.0",
                version_name(api.version as u64),
                api.folder
            )),
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The last `dlerror`, for messages.
fn dl_error() -> String {
    // SAFETY: dlerror returns null or a C string valid until the next dl call.
    let e = unsafe { libc::dlerror() };
    match e.is_null() {
        true => "unknown".into(),
        // SAFETY: non-null: a C string.
        false => unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned(),
    }
}

/// The front library's handle and the folder (or search) it came from.
fn open_front() -> Result<(*mut c_void, String), String> {
    if let Some(path) = std::env::var_os("CUDNN_PATH") {
        let path = PathBuf::from(path);
        let dir = match path.is_file() {
            true => path.parent().map(Path::to_path_buf).unwrap_or_default(),
            false => [path.join("lib"), path.join("lib64"), path.clone()]
                .into_iter()
                .find(|d| d.join("libcudnn.so.9").exists())
                .unwrap_or(path),
        };
        return open_folder(&dir).map(|h| (h, dir.display().to_string()));
    }
    let found = open("libcudnn.so.9");
    if !found.is_null() {
        return Ok((found, "the dynamic linker's search path".into()));
    }
    let mut last = "libcudnn.so.9 was not found (set CUDNN_PATH to its folder)".to_string();
    for dir in crate::libraries::folders("cudnn", "libcudnn.so.9") {
        match open_folder(&dir) {
            Ok(handle) => return Ok((handle, dir.display().to_string())),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Opens `dir`'s cuDNN: its sub-libraries, `libcudnn_graph` first, then its front library.
fn open_folder(dir: &Path) -> Result<*mut c_void, String> {
    let front = dir.join("libcudnn.so.9");
    if !front.exists() {
        return Err(format!("no libcudnn.so.9 in {}", dir.display()));
    }
    let mut subs: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("libcudnn_") && n.ends_with(".so.9"))
        .collect();
    subs.sort_by_key(|n| (!n.starts_with("libcudnn_graph"), n.clone()));
    for sub in subs {
        // A sub-library that does not load (a missing dependency) fails cuDNN later, in one
        // warning line naming cuDNN's status.
        let _ = open(&dir.join(sub).to_string_lossy());
    }
    let handle = open(&front.to_string_lossy());
    match handle.is_null() {
        true => Err(format!("{}: {}", front.display(), dl_error())),
        false => Ok(handle),
    }
}
