//! Finding and loading NCCL 2 at run time, as cuBLAS and cuDNN are loaded: the binary builds and
//! starts without it, and only a run launched across processes on CUDA devices needs it.
//!
//! Tried in order: the folder `NCCL_PATH` names (or the folder of the file it names); the
//! dynamic linker's search path (`libnccl.so.2`: `LD_LIBRARY_PATH`, the system's folders); the
//! CUDA toolkit's library folders and the `nvidia/nccl/lib` folder of each Python environment
//! on `PATH` (PyTorch's wheels bring NCCL there). The functions are looked up in the loaded
//! library itself.

use crate::libraries::{open, symbol};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

/// NCCL's result code (`ncclResult_t`; 0 is success).
pub(crate) type Status = c_int;

/// `ncclUniqueId`: the 128 bytes that name one communicator, made by rank 0 and handed to the
/// others before they join.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RawId {
    pub internal: [c_char; 128],
}

/// `ncclComm_t`.
pub(crate) type RawComm = *mut c_void;

/// `ncclFloat32` of `ncclDataType_t`.
pub(crate) const FLOAT32: c_int = 7;
/// `ncclSum` of `ncclRedOp_t`.
pub(crate) const SUM: c_int = 0;

/// The NCCL functions ember calls.
#[allow(clippy::type_complexity)]
pub(crate) struct Api {
    /// `major * 10000 + minor * 100 + patch` (NCCL 2.9 and later).
    pub version: c_int,
    pub folder: String,
    pub get_unique_id: unsafe extern "C" fn(*mut RawId) -> Status,
    pub comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, RawId, c_int) -> Status,
    pub comm_destroy: unsafe extern "C" fn(RawComm) -> Status,
    pub error_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub group_start: unsafe extern "C" fn() -> Status,
    pub group_end: unsafe extern "C" fn() -> Status,
    pub all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        *mut c_void,
    ) -> Status,
    pub broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        *mut c_void,
    ) -> Status,
}

/// NCCL's functions where it could be loaded, else why not (looked for once).
pub(crate) fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        let (handle, folder) = open_library()?;
        // SAFETY: `handle` is a loaded NCCL 2; each symbol is cast to its C signature.
        unsafe {
            let get_version: unsafe extern "C" fn(*mut c_int) -> Status =
                symbol(handle, "ncclGetVersion", "NCCL")?;
            let mut version = 0;
            get_version(&mut version);
            Ok(Api {
                version,
                folder,
                get_unique_id: symbol(handle, "ncclGetUniqueId", "NCCL")?,
                comm_init_rank: symbol(handle, "ncclCommInitRank", "NCCL")?,
                comm_destroy: symbol(handle, "ncclCommDestroy", "NCCL")?,
                error_string: symbol(handle, "ncclGetErrorString", "NCCL")?,
                group_start: symbol(handle, "ncclGroupStart", "NCCL")?,
                group_end: symbol(handle, "ncclGroupEnd", "NCCL")?,
                all_reduce: symbol(handle, "ncclAllReduce", "NCCL")?,
                broadcast: symbol(handle, "ncclBroadcast", "NCCL")?,
            })
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// NCCL's words for `status`.
pub(crate) fn describe(api: &Api, status: Status) -> String {
    // SAFETY: NCCL returns a static C string for any status.
    let text = unsafe { (api.error_string)(status) };
    match text.is_null() {
        true => format!("NCCL status {status}"),
        // SAFETY: non-null: a C string.
        false => unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned(),
    }
}

/// The library's handle and where it was found.
fn open_library() -> Result<(*mut c_void, String), String> {
    const FILE: &str = "libnccl.so.2";
    if let Some(path) = std::env::var_os("NCCL_PATH") {
        let path = PathBuf::from(path);
        let file = match path.is_file() {
            true => path.clone(),
            false => [path.join("lib"), path.join("lib64"), path.clone()]
                .into_iter()
                .map(|d| d.join(FILE))
                .find(|f| f.exists())
                .unwrap_or_else(|| path.join(FILE)),
        };
        let handle = open(&file.to_string_lossy());
        return match handle.is_null() {
            true => Err(format!("NCCL_PATH: {} could not be loaded", file.display())),
            false => Ok((handle, file.display().to_string())),
        };
    }
    let found = open(FILE);
    if !found.is_null() {
        return Ok((found, "the dynamic linker's search path".into()));
    }
    for dir in crate::libraries::folders("nccl", FILE) {
        let handle = open(&dir.join(FILE).to_string_lossy());
        if !handle.is_null() {
            return Ok((handle, dir.display().to_string()));
        }
    }
    Err(format!(
        "{FILE} was not found (install NCCL 2, or set NCCL_PATH to its folder)"
    ))
}
