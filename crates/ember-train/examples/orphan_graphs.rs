//! Shows what forward passes on an autodiff device cost when no backward pass follows: Burn
//! keeps each one's graph (activations included) until some backward pass runs, so evaluate and
//! sample on `model.valid()`. Prints the resident memory after each phase.
//! `cargo run --release -p ember-train --example orphan_graphs`

use burn::module::Module;
use burn::tensor::{Device, Distribution, Int, Tensor};
use ember_model::DecoderOnlyConfig;

/// Resident memory of this process in MiB (Linux; 0 elsewhere).
fn rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok());
    kib.unwrap_or(0) / 1024
}

fn main() {
    let device = Device::flex().autodiff();
    // The baby GPT of configs/shakespeare-char.toml, one batch of 12 x 64 tokens.
    let config = DecoderOnlyConfig {
        vocab_size: 66,
        bias: false,
        ..Default::default()
    };
    let model = config.init(&device).expect("valid config");
    let x = Tensor::<2, Int>::random([12, 64], Distribution::Uniform(0.0, 65.0), &device);
    let n = 50;
    println!("start: {} MiB", rss_mib());
    for _ in 0..n {
        let _ = model.loss(x.clone(), x.clone()).into_scalar::<f32>();
    }
    println!(
        "{n} forward passes on the autodiff device: {} MiB",
        rss_mib()
    );
    let _ = model.loss(x.clone(), x.clone()).backward();
    println!("after one backward pass: {} MiB", rss_mib());
    let (eval, xe) = (model.valid(), x.inner());
    for _ in 0..n {
        let _ = eval.loss(xe.clone(), xe.clone()).into_scalar::<f32>();
    }
    println!("{n} forward passes on model.valid(): {} MiB", rss_mib());
}
