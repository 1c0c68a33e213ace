//! The launch observer's stand-in for builds without a GPU backend: nothing to observe.

use std::time::Instant;

use super::{Part, StepLaunches};

/// Never built with a device (every device of a CPU-only build is refused first).
pub(super) struct Profiler;

/// Nothing to watch without a GPU backend.
pub(super) struct Watching;

impl Profiler {
    pub(super) fn new() -> Self {
        Self
    }

    pub(super) fn watch(&self) -> Watching {
        Watching
    }

    pub(super) fn unwatch(&self, _watching: Watching) {}

    pub(super) fn set_part(&self, _part: Part) {}

    pub(super) fn take_step(&self, _epoch: Instant) -> StepLaunches {
        StepLaunches::default()
    }
}
