//! The calling thread as one of the threads of rayon's global pool, for CPU speed, and
//! element-wise work spread over that pool.
//!
//! Flex's operations, `gemm` and ember's own kernels split their work over rayon's global pool.
//! Called from a thread outside the pool (a program's main thread), each of the few hundred
//! parallel operations of a training step hands its work to the pool, wakes its sleeping
//! threads and sleeps until they finish: 282,000–293,000 context switches in 300 baby-GPT steps
//! against ~42,000 when the caller is one of the pool's threads, and 17.5–17.9 ms per step
//! against 14.8–14.9 on 2 cores (`examples/step_profile` in ember-train, `OUTSIDE_POOL=1` and
//! not).

/// Makes the calling thread thread 0 of rayon's global pool (which then starts one thread
/// fewer: `RAYON_NUM_THREADS` or one per core, this one included). Call it first thing in
/// `main`, before anything runs in parallel. Returns `false`, and changes nothing, when the
/// global pool already exists.
///
/// Work handed to the pool from other threads (e.g. one thread per device in data-parallel
/// training) is done by the pool's other threads; this thread helps only while it waits inside
/// a parallel operation of its own.
pub fn join_global_pool() -> bool {
    rayon::ThreadPoolBuilder::new()
        .use_current_thread()
        .build_global()
        .is_ok()
}

/// Elements per task when an element-wise kernel (GELU, dropout) is spread over rayon's
/// threads. Shorter tensors (a decoding step's) stay on the calling thread: handing work to the
/// pool costs more than it saves there.
const TASK: usize = 1 << 15;

/// Rows of `width` values per task when whole rows are split over rayon's threads: about
/// [`TASK`] values, at least one row. A tensor of fewer than two tasks' rows stays on the
/// calling thread.
pub(crate) fn rows_per_task(width: usize) -> usize {
    (TASK / width.max(1)).max(1)
}

/// `f(chunk, offset of its first element)` over `out` in chunks of [`TASK`] elements, on
/// rayon's threads when there are at least two chunks.
pub(crate) fn spread(out: &mut [f32], f: impl Fn(&mut [f32], usize) + Send + Sync) {
    use rayon::prelude::*;
    if out.len() < 2 * TASK {
        return f(out, 0);
    }
    out.par_chunks_mut(TASK)
        .enumerate()
        .for_each(|(i, chunk)| f(chunk, i * TASK));
}
