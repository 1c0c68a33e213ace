//! Ctrl-C and SIGTERM during training: the first asks the trainer to stop at the end of the
//! current step with a checkpoint; a second one ends the process at once (exit 128 + signal).

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, OnceLock};

/// The flag the trainer polls; set by the first signal.
static STOP: OnceLock<Arc<AtomicBool>> = OnceLock::new();
/// The first signal received, for the exit code.
static SIGNAL: AtomicI32 = AtomicI32::new(0);

/// Installs the handlers (once) and returns the flag they set.
pub fn stop_on_signals() -> Arc<AtomicBool> {
    let flag = STOP
        .get_or_init(|| Arc::new(AtomicBool::new(false)))
        .clone();
    #[cfg(unix)]
    {
        extern "C" fn on_signal(signal: libc::c_int) {
            // Only atomics and _exit: what a signal handler may safely do.
            let _ = SIGNAL.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
            if let Some(flag) = STOP.get()
                && flag.swap(true, Ordering::SeqCst)
            {
                // SAFETY: _exit is async-signal-safe.
                unsafe { libc::_exit(128 + signal) };
            }
        }
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only touches atomics and calls _exit.
        unsafe {
            libc::signal(libc::SIGINT, handler);
            libc::signal(libc::SIGTERM, handler);
        }
    }
    flag
}

/// The exit code for a run stopped by a signal: 128 + its number (130 for Ctrl-C, 143 for
/// SIGTERM), as shells report a process killed by it.
pub fn exit_code() -> u8 {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => 130,
        signal => (128 + signal).clamp(0, 255) as u8,
    }
}
