//! The f32 matrix-multiply throughput Burn's flex backend reaches on this machine: the peak that
//! model FLOPs utilisation is measured against (`scripts/bench-compare.sh`).
//!
//! ```text
//! cargo run --release --example matmul_peak
//! ```

use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};

fn main() {
    let device = Device::flex();
    for n in [256, 512, 1024, 2048] {
        let a = Tensor::<2>::random([n, n], Distribution::Default, &device);
        let b = Tensor::<2>::random([n, n], Distribution::Default, &device);
        let _ = a.clone().matmul(b.clone()).into_data(); // warm up
        let runs = (4096 / n).max(2);
        let start = Instant::now();
        for _ in 0..runs {
            let _ = a.clone().matmul(b.clone()).into_data();
        }
        let secs = start.elapsed().as_secs_f64() / runs as f64;
        let gflops = 2.0 * (n as f64).powi(3) / secs / 1e9;
        println!("{n}x{n}: {gflops:.1} GFLOP/s");
    }
}
