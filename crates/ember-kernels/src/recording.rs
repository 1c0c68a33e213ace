//! Which calls a graph recording takes (CubeCL's capture: CUDA graphs, wgpu's recorded
//! dispatches).
//!
//! CubeCL guards, for a recording's lifetime, the memory pages its own kernels were given; the
//! buffers that only cuBLAS or cuDNN read and write (a product's output that another library
//! call consumes, say) are not among them. A recording whose replays are interleaved with new
//! allocations (a decoding step's: the host reads tokens between replays) could then see such a
//! buffer handed to another tensor. So a recording keeps to CubeCL's kernels (cubek's products,
//! ember's fused attention), unless its caller allocates nothing between the replays and says so
//! with [`LibraryCallsRecorded`]: an evaluation's pass (`ember_infer::summed_losses`), which
//! then records the same calls its real pass made.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

thread_local! {
    /// Whether recordings opened on this thread take cuBLAS's and cuDNN's calls.
    static TAKEN: Cell<bool> = const { Cell::new(false) };
}

/// Library calls that failed inside a recording (counted where the device thread runs them).
static FAILED: AtomicUsize = AtomicUsize::new(0);

/// While it lives, a recording made on this thread takes cuBLAS's products, the attention as
/// cuBLAS's products and cuDNN's attention wherever a pass outside a recording would: the
/// recorded pass is then the pass the host runs. Its holder must allocate nothing on the device
/// between the recording's replays, and replay it only while every tensor the pass read lives.
pub struct LibraryCallsRecorded {
    before: bool,
    failed_before: usize,
}

impl LibraryCallsRecorded {
    /// Library calls recorded until the value is dropped.
    pub fn new() -> Self {
        Self {
            before: TAKEN.replace(true),
            failed_before: FAILED.load(Ordering::SeqCst),
        }
    }

    /// Whether a library call recorded since [`LibraryCallsRecorded::new`] failed (a buffer not
    /// found, a call refused): the recording then misses work and must not be replayed. Ask
    /// after the recording is closed, which runs after every call handed over inside it.
    pub fn a_call_failed(&self) -> bool {
        FAILED.load(Ordering::SeqCst) != self.failed_before
    }
}

impl Default for LibraryCallsRecorded {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for LibraryCallsRecorded {
    fn drop(&mut self) {
        TAKEN.set(self.before);
    }
}

/// Whether a library call must be left out of a recording: `capturing` (the client records a
/// graph) and no [`LibraryCallsRecorded`] lives on this thread.
#[cfg_attr(not(feature = "cube"), allow(dead_code))]
pub(crate) fn leaves_libraries_out(capturing: bool) -> bool {
    capturing && !TAKEN.get()
}

/// Counts a library call that failed inside a recording ([`LibraryCallsRecorded::a_call_failed`]).
#[cfg_attr(not(feature = "cublas"), allow(dead_code))]
pub(crate) fn call_failed_in_recording() {
    FAILED.fetch_add(1, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Outside a recording libraries are taken; inside one only while the guard lives (nested
    /// guards restore what was before them).
    #[test]
    fn libraries_are_left_out_of_recordings_unless_a_guard_lives() {
        assert!(!leaves_libraries_out(false));
        assert!(leaves_libraries_out(true));
        {
            let _outer = LibraryCallsRecorded::new();
            assert!(!leaves_libraries_out(true));
            {
                let _inner = LibraryCallsRecorded::new();
                assert!(!leaves_libraries_out(true));
            }
            assert!(!leaves_libraries_out(true));
        }
        assert!(leaves_libraries_out(true));
        assert!(!leaves_libraries_out(false));
    }

    /// A call failed inside a recording is seen by the guards that lived while it failed.
    #[test]
    fn a_failed_call_is_seen_by_the_guard() {
        let guard = LibraryCallsRecorded::new();
        assert!(!guard.a_call_failed());
        call_failed_in_recording();
        assert!(guard.a_call_failed());
        assert!(!LibraryCallsRecorded::new().a_call_failed());
    }
}
