//! Times the parts of one training step of the baby GPT on flex, to see where time goes.
//! `cargo run --release -p ember-train --example step_profile` (`ACT=relu` or `ACT=tanh` for
//! that MLP activation instead of exact GELU; `ONLY=forward` to run only the lines whose name
//! starts with that text, e.g. under `perf record`; `N=200` to time 200 repetitions, not 20;
//! `OUTSIDE_POOL=1` to run outside rayon's pool, as before `ember_kernels::flex::threads`).

use std::time::{Duration, Instant};

use burn::optim::GradientsParams;
use burn::tensor::{Device, Distribution, Int, Tensor};
use ember_model::DecoderOnlyConfig;

// The allocator and purge setting of the `ember` binary (crates/ember-cli/src/main.rs): with
// glibc's malloc, page faults on re-allocated buffers take a third of the step.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn time<F: FnMut()>(name: &str, n: usize, mut f: F) {
    time_part(name, n, || {
        let start = Instant::now();
        f();
        start.elapsed()
    });
}

/// Like [`time`], for the part of each run that `f` times itself and returns.
fn time_part<F: FnMut() -> Duration>(name: &str, n: usize, mut f: F) {
    if let Ok(only) = std::env::var("ONLY")
        && !name.trim_start().starts_with(only.as_str())
    {
        return;
    }
    f();
    let total: Duration = (0..n).map(|_| f()).sum();
    println!(
        "{name:<40} {:8.2} ms",
        total.as_secs_f64() * 1000.0 / n as f64
    );
}

fn main() {
    // As the `ember` binary does, unless OUTSIDE_POOL is set (to see what it changes).
    if std::env::var_os("OUTSIDE_POOL").is_none() {
        ember_kernels::flex::threads::join_global_pool();
    }
    // SAFETY: sets mimalloc's integer option `mi_option_purge_delay` (15) to "never purge".
    unsafe { libmimalloc_sys::mi_option_set(15, -1) };
    let device = Device::flex().autodiff();
    let config = DecoderOnlyConfig {
        vocab_size: 66,
        bias: false,
        activation: match std::env::var("ACT").as_deref() {
            Ok("relu") => ember_model::Activation::Relu,
            Ok("tanh") => ember_model::Activation::GeluTanh,
            _ => ember_model::Activation::Gelu,
        },
        ..Default::default()
    };
    let model = config.init(&device).unwrap();
    let x = Tensor::<2, Int>::random([12, 64], Distribution::Uniform(0.0, 65.0), &device);
    let y = Tensor::<2, Int>::random([12, 64], Distribution::Uniform(0.0, 65.0), &device);
    let n = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    // Timed without its backward pass, which still runs: Burn's autodiff frees a graph only in
    // a backward pass, so forwards without one pile up graphs (and page faults).
    time_part("forward (loss, autodiff)", n, || {
        let start = Instant::now();
        let loss = model.loss(x.clone(), y.clone());
        let _ = loss.clone().into_scalar::<f32>();
        let forward = start.elapsed();
        let _ = loss.backward();
        forward
    });
    time("forward + backward", n, || {
        let loss = model.loss(x.clone(), y.clone());
        let g = loss.backward();
        let _ = GradientsParams::from_grads(g, &model);
    });
    // A whole optimizer step as the trainer takes it: gradients, global-norm clipping, AdamW.
    let training = ember_train::config::TrainingConfig::default();
    let mut optim = ember_train::optimizer::adamw(&training, &model);
    time("forward + backward + clip", n, || {
        let loss = model.loss(x.clone(), y.clone());
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let _ = ember_train::optimizer::clip_global_norm(&model, &mut grads, training.grad_clip);
    });
    let mut stepped = Some(model.clone());
    time("forward + backward + clip + AdamW", n, || {
        let m = stepped.take().expect("put back after each step");
        let loss = m.loss(x.clone(), y.clone());
        let mut grads = GradientsParams::from_grads(loss.backward(), &m);
        let _ = ember_train::optimizer::clip_global_norm(&m, &mut grads, training.grad_clip);
        stepped = Some(optim.step(1e-4, m, grads));
    });
    let inner = Device::flex();
    let m2 = config.init(&inner).unwrap();
    let xi = Tensor::<2, Int>::random([12, 64], Distribution::Uniform(0.0, 65.0), &inner);
    time("forward logits (no autodiff)", n, || {
        let _ = m2.forward(xi.clone()).sum().into_scalar::<f32>();
    });
    let h = Tensor::<3>::random([12, 64, 128], Distribution::Normal(0.0, 1.0), &inner);
    time("  1 block forward (no autodiff)", n, || {
        let _ = m2.blocks[0]
            .forward(h.clone(), None, None, None, false)
            .0
            .sum()
            .into_scalar::<f32>();
    });
    time("  attention forward (no autodiff)", n, || {
        let _ = m2.blocks[0]
            .attn
            .forward_self(h.clone(), true, None, None, false)
            .0
            .sum()
            .into_scalar::<f32>();
    });
    time("  mlp forward (no autodiff)", n, || {
        let _ = m2.blocks[0]
            .mlp
            .forward(h.clone())
            .sum()
            .into_scalar::<f32>();
    });
    time("  c_attn linear (no autodiff)", n, || {
        let _ = m2.blocks[0]
            .attn
            .c_attn
            .forward(h.clone())
            .sum()
            .into_scalar::<f32>();
    });
    time("  layernorm (no autodiff)", n, || {
        let _ = m2.blocks[0]
            .ln_1
            .norm
            .forward(h.clone())
            .sum()
            .into_scalar::<f32>();
    });
    let q = Tensor::<4>::random([12, 4, 64, 32], Distribution::Normal(0.0, 1.0), &inner);
    time("  sdpa causal (no autodiff)", n, || {
        let mask = ember_model::attention::causal_mask(64, 64, &inner);
        let _ = ember_model::scaled_dot_product_attention(
            q.clone(),
            q.clone(),
            q.clone(),
            Some(mask),
            None,
            false,
        )
        .context
        .sum()
        .into_scalar::<f32>();
    });
    time("  fused attention op causal (no autodiff)", n, || {
        let _ = burn::tensor::module::attention(
            q.clone(),
            q.clone(),
            q.clone(),
            None,
            None,
            burn::tensor::ops::AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: true,
            },
        )
        .sum()
        .into_scalar::<f32>();
    });
    for (m, k, n) in [(768, 128, 384), (768, 512, 128), (128, 768, 384)] {
        let a = Tensor::<2>::random([m, k], Distribution::Normal(0.0, 1.0), &inner);
        let b = Tensor::<2>::random([k, n], Distribution::Normal(0.0, 1.0), &inner);
        let gflop = 2.0 * (m * k * n) as f64 / 1e9;
        time(
            &format!("  ember matmul {m}x{k}x{n} ({gflop:.3} GFLOP)"),
            50,
            || {
                let _ = ember_kernels::matmul(a.clone(), b.clone());
            },
        );
    }
    let big = Tensor::<3>::random([12, 64, 512], Distribution::Normal(0.0, 1.0), &inner);
    time("  gelu [12,64,512]", n, || {
        let _ = burn::tensor::activation::gelu(big.clone())
            .sum()
            .into_scalar::<f32>();
    });
    time("  ember gelu [12,64,512]", n, || {
        let _ = ember_kernels::gelu(big.clone()).sum().into_scalar::<f32>();
    });
    let xs: Vec<f32> = (0..12 * 64 * 512)
        .map(|i| (i % 1000) as f32 / 250.0 - 2.0)
        .collect();
    let mut ys = vec![0.0f32; xs.len()];
    time("  gelu kernel only, 393216 values", n, || {
        ember_kernels::kernels::gelu::forward_into::<ember_kernels::kernels::gelu::Exact>(
            &xs, &mut ys,
        );
    });
    time("  sum only [12,64,512]", n, || {
        let _ = big.clone().sum().into_scalar::<f32>();
    });
}
