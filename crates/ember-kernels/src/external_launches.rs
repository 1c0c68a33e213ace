//! Device work that ember queues outside CubeCL (cuBLAS's products, `products::cublas`), made
//! visible to a profiler: CubeCL's launch observer sees only CubeCL's kernels, so `ember train
//! --profile-steps` would count such work as the device's idle time.
//!
//! A profiler installs an [`ExternalLaunches`] for the steps it profiles; while one is
//! installed, each such call is timed on the device (events around it on its stream) and
//! reported with a closure that reads its time once the device has run it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Reads a launch's device time; call it after the device has run the launch (`None` where the
/// device could not time it).
pub type Elapsed = Box<dyn FnOnce() -> Option<Duration> + Send>;

/// Told of each launch outside CubeCL, on the thread that issues it.
pub trait ExternalLaunches: Send + Sync {
    /// `name` was queued; `elapsed` reads its device time later.
    fn launched(&self, name: &'static str, elapsed: Elapsed);
}

static INSTALLED: AtomicBool = AtomicBool::new(false);
static OBSERVER: RwLock<Option<Arc<dyn ExternalLaunches>>> = RwLock::new(None);

/// Installs `observer` (or, with `None`, removes the one installed).
pub fn observe(observer: Option<Arc<dyn ExternalLaunches>>) {
    let mut slot = OBSERVER.write().unwrap_or_else(|e| e.into_inner());
    INSTALLED.store(observer.is_some(), Ordering::Release);
    *slot = observer;
}

/// The installed observer, if any (one atomic load when none is).
#[cfg_attr(not(feature = "cublas"), allow(dead_code))]
pub(crate) fn observer() -> Option<Arc<dyn ExternalLaunches>> {
    if !INSTALLED.load(Ordering::Acquire) {
        return None;
    }
    OBSERVER.read().unwrap_or_else(|e| e.into_inner()).clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Log(Mutex<Vec<(&'static str, Option<Duration>)>>);

    impl ExternalLaunches for Log {
        fn launched(&self, name: &'static str, elapsed: Elapsed) {
            self.0.lock().unwrap().push((name, elapsed()));
        }
    }

    /// An installed observer hears of launches until it is removed.
    #[test]
    fn an_installed_observer_is_told_until_removed() {
        assert!(observer().is_none());
        let log = Arc::new(Log::default());
        observe(Some(log.clone()));
        let seen = observer().expect("installed");
        seen.launched("gemm", Box::new(|| Some(Duration::from_micros(5))));
        observe(None);
        assert!(observer().is_none());
        assert_eq!(
            *log.0.lock().unwrap(),
            vec![("gemm", Some(Duration::from_micros(5)))]
        );
    }
}
