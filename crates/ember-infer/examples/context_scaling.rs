//! Time per generated token as the context grows, with and without the KV cache, for the
//! default run's model size (`configs/small.toml`: 4 layers, 4 heads, width 128) with a
//! 1024-position table. Weights are random: speed does not depend on them.
//!
//! ```text
//! cargo run --release --example context_scaling
//! ```
//!
//! With the cache a step feeds one token and attends over the `C` cached keys; without it a step
//! recomputes the whole window of `C` tokens.

use std::time::Instant;

use burn::tensor::{Device, Int, Tensor};
use ember_model::DecoderOnlyConfig;

const STEPS: usize = 32;

fn main() {
    // As the `ember` binary does (ember_kernels::flex::threads).
    ember_kernels::flex::threads::join_global_pool();
    let device = Device::flex();
    let config = DecoderOnlyConfig {
        vocab_size: 66,
        d_model: 128,
        n_heads: 4,
        n_layers: 4,
        context_len: 1024,
        bias: false,
        ..Default::default()
    };
    let model = config.init(&device).expect("a valid config");
    let token = |i: usize| (i % 60) as i64 + 1;
    println!("| context | ms/token with KV cache | ms/token without |");
    println!("|---:|---:|---:|");
    for context in [64, 256, 1024] {
        // With the cache: fill it with context - STEPS tokens, then time STEPS single steps, so
        // the last step attends over exactly `context` keys.
        let prefix: Vec<i64> = (0..context - STEPS).map(token).collect();
        let mut cache = model.new_cache();
        let prompt =
            Tensor::<1, Int>::from_ints(prefix.as_slice(), &device).reshape([1, prefix.len()]);
        let _ = model
            .forward_with(prompt, None, Some(&mut cache), false)
            .logits
            .into_data();
        let start = Instant::now();
        for i in 0..STEPS {
            let next = Tensor::<2, Int>::from_ints([[token(i)]], &device);
            let logits = model
                .forward_with(next, None, Some(&mut cache), false)
                .logits;
            let _ = logits.argmax(2).into_data(); // the host reads each token, as sampling does
        }
        let cached = start.elapsed().as_secs_f64() * 1000.0 / STEPS as f64;

        // Without: every step recomputes a full window of `context` tokens.
        let window: Vec<i64> = (0..context).map(token).collect();
        let runs = (STEPS / 4).max(2);
        let start = Instant::now();
        for _ in 0..runs {
            let x = Tensor::<1, Int>::from_ints(window.as_slice(), &device).reshape([1, context]);
            let _ = model.forward(x).argmax(2).into_data();
        }
        let full = start.elapsed().as_secs_f64() * 1000.0 / runs as f64;
        println!("| {context} | {cached:.2} | {full:.2} |");
    }
}
