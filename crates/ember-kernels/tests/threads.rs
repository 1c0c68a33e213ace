//! `threads::join_global_pool`, in a test binary of its own: it sets up rayon's global pool,
//! which every later test of the same binary would share.

#![cfg(feature = "flex")]

use burn::tensor::{Device, Distribution, Tensor};
use ember_kernels::flex::threads::join_global_pool;

#[test]
fn the_calling_thread_becomes_thread_zero_and_parallel_work_still_runs() {
    assert_eq!(rayon::current_thread_index(), None);
    assert!(join_global_pool());
    assert_eq!(rayon::current_thread_index(), Some(0));
    assert!(!join_global_pool(), "the global pool exists now");

    // Parallel work started here runs (here and on the pool's other threads) and is right: a
    // matrix product big enough for gemm's threads, against the same product row by row.
    let device = Device::flex();
    let a = Tensor::<2>::random([256, 192], Distribution::Normal(0.0, 1.0), &device);
    let b = Tensor::<2>::random([192, 160], Distribution::Normal(0.0, 1.0), &device);
    let full = ember_kernels::matmul(a.clone(), b.clone());
    for row in [0, 77, 255] {
        let one = ember_kernels::matmul(a.clone().slice([row..row + 1, 0..192]), b.clone());
        let diff = (full.clone().slice([row..row + 1, 0..160]) - one)
            .abs()
            .max();
        assert!(diff.into_scalar::<f32>() < 1e-4);
    }
    let threads: std::collections::HashSet<_> = (0..64)
        .map(|_| {
            let (x, y) = rayon::join(rayon::current_thread_index, rayon::current_thread_index);
            (x.unwrap(), y.unwrap())
        })
        .flat_map(|(x, y)| [x, y])
        .collect();
    assert!(threads.contains(&0), "this thread takes part: {threads:?}");
}
