//! For tests: one of ember's kernels against the same computation in Burn's ops, plain, under
//! autodiff and under autodiff with checkpointing, output and input gradient.

use burn::tensor::{Device, Tensor, TensorData};

/// Asserts that `ours` and `burns` give the same output on `x`, and (under autodiff) the same
/// gradient of `sum(output * g)` with respect to `x`, within `tolerance` times the reference's
/// largest magnitude (at least 1), on `device` plain, with autodiff and with autodiff and
/// checkpointing. An `exp` runs before the op, so the gradient flows through a graph. `what`
/// names the case in failures.
pub fn agrees_on(
    device: &Device,
    x: &TensorData,
    g: &TensorData,
    ours: impl Fn(Tensor<3>) -> Tensor<3>,
    burns: impl Fn(Tensor<3>) -> Tensor<3>,
    tolerance: f32,
    what: &str,
) {
    for device in [
        device.clone(),
        device.clone().autodiff(),
        device.clone().autodiff().gradient_checkpointing(),
    ] {
        let tracked = device.is_autodiff();
        let run = |op: &dyn Fn(Tensor<3>) -> Tensor<3>| -> Vec<Tensor<3>> {
            let load = |data: &TensorData| Tensor::<3>::from_data(data.clone(), &device);
            let input = if tracked {
                load(x).require_grad()
            } else {
                load(x)
            };
            let out = op(input.clone().exp());
            let mut result = vec![out.clone().inner()];
            if tracked {
                let grads = (out * load(g)).sum().backward();
                result.push(input.grad(&grads).expect("a gradient"));
            }
            result
        };
        let (a, b) = (run(&ours), run(&burns));
        assert_eq!(a.len(), b.len());
        for (i, (a, r)) in a.into_iter().zip(b).enumerate() {
            let scale = r.clone().abs().max().into_scalar::<f32>().max(1.0);
            let diff = (a - r).abs().max().into_scalar::<f32>();
            assert!(
                diff < tolerance * scale,
                "{what}, {}output {i}: {diff}",
                if tracked { "autodiff, " } else { "" }
            );
        }
    }
}

/// `softmax(logits / t)` in f64.
fn probabilities(logits: &[f32], t: f32) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let e: Vec<f64> = logits
        .iter()
        .map(|&l| ((l as f64 - max) / t as f64).exp())
        .collect();
    let total: f64 = e.iter().sum();
    e.iter().map(|x| x / total).collect()
}

/// The index of the host's walk over `softmax(logits / t)` in f64 for `u`, and how far
/// `u` is from the nearest boundary between two tokens.
pub fn walked(logits: &[f32], u: f32, t: f32) -> (usize, f64) {
    let mut c = 0.0;
    let mut margin = f64::INFINITY;
    let mut index = None;
    for (j, p) in probabilities(logits, t).into_iter().enumerate() {
        c += p;
        margin = margin.min((c - u as f64).abs());
        if index.is_none() && c > u as f64 {
            index = Some(j);
        }
    }
    (index.unwrap_or(logits.len() - 1), margin)
}

/// Whether token `index` of `softmax(logits / t)` (in f64) spans `u` give or take `tolerance`:
/// a draw rounded to a neighbour of the exact token, which near a boundary is as right.
pub fn spans(logits: &[f32], u: f32, t: f32, index: usize, tolerance: f64) -> bool {
    let p = probabilities(logits, t);
    let before: f64 = p[..index].iter().sum();
    let after = before + p[index];
    before - tolerance <= u as f64 && u as f64 <= after + tolerance
}

/// One query `[2, 3, 1, 32]` and the keys and values of a cache-like view `[2, 3, 37, 32]` on
/// `device`: the first 37 of 50 positions of buffers, as a KV cache returns them (strided),
/// the query scaled up so that its weights are far from uniform.
pub fn cache_like_query(device: &Device) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let normal = burn::tensor::Distribution::Normal(0.0, 1.0);
    let buffer = |seed| {
        device.seed(seed);
        Tensor::<4>::random([2, 3, 50, 32], normal, device)
    };
    let (k, v) = (buffer(1), buffer(2));
    let (k, v) = (
        k.slice([0..2, 0..3, 0..37, 0..32]),
        v.slice([0..2, 0..3, 0..37, 0..32]),
    );
    let q = Tensor::<4>::random([2, 3, 1, 32], normal, device) * 3.0;
    (q, k, v)
}
