//! ember's ops against the model's concepts on flex: each fast path gives what the lecture
//! notes' maths gives (the general masked attention, the model's causal path), output and
//! gradients. The ops' tests against their own references live in ember-kernels; these need
//! the concepts, which the kernels crate does not see.

#![cfg(feature = "flex")]

use burn::nn::DropoutConfig;
use burn::tensor::{Device, Distribution, Tensor, TensorData};
use ember_model::attention::{causal_attention, causal_mask};
use ember_model::ops::check::agrees_on;
use ember_model::scaled_dot_product_attention;

/// `causal_attention` (on flex, the fused softmax) against the general path with
/// `causal_mask`: forward, weights, and gradients of q, k, v with and without gradient
/// checkpointing; without a cache (T = S) and with 6 cached positions (T < S).
#[test]
fn causal_attention_equals_the_masked_general_path() {
    let draw = |dims: [usize; 4]| {
        Tensor::<4>::random(dims, Distribution::Normal(0.0, 2.0), &Device::flex()).into_data()
    };
    for (t, s) in [(7, 7), (5, 11)] {
        let (q, k, v) = (
            draw([2, 3, t, 16]),
            draw([2, 3, s, 16]),
            draw([2, 3, s, 16]),
        );
        let g = draw([2, 3, t, 16]);
        for device in [
            Device::flex(),
            Device::flex().autodiff(),
            Device::flex().autodiff().gradient_checkpointing(),
        ] {
            let tracked = device.is_autodiff();
            let run = |fused: bool| {
                let load = |d: &TensorData| {
                    let x = Tensor::<4>::from_data(d.clone(), &device);
                    if tracked { x.require_grad() } else { x }
                };
                let (q, k, v) = (load(&q), load(&k), load(&v));
                assert!(ember_model::ops::kernels_take(&q));
                let out = if fused {
                    causal_attention(q.clone(), k.clone(), v.clone(), None, true)
                } else {
                    let mask = causal_mask(t, s, &device);
                    let (a, b, c) = (q.clone(), k.clone(), v.clone());
                    scaled_dot_product_attention(a, b, c, Some(mask), None, true)
                };
                let weights = out.weights.unwrap();
                let mut result = vec![out.context.clone().inner(), weights.clone().inner()];
                if tracked {
                    let w = Tensor::<4>::from_data(g.clone(), &device);
                    let grads = (out.context * w).sum().backward();
                    for x in [q, k, v] {
                        result.push(x.grad(&grads).expect("a gradient"));
                    }
                }
                result
            };
            let (fused, general) = (run(true), run(false));
            assert_eq!(fused.len(), general.len());
            for (i, (a, b)) in fused.into_iter().zip(general).enumerate() {
                let d = (a - b).abs().max().into_scalar::<f32>();
                assert!(d < 2e-5, "T = {t}, S = {s}, output {i}: differs by {d}");
            }
        }
    }
}

/// One query over a cache-like view (the first 37 of 50 positions, as `KvCache` returns them):
/// the decoding op (on flex, ember's loops) against the general path.
#[test]
fn single_query_equals_the_general_path() {
    let (q, k, v) = ember_model::ops::check::cache_like_query(&Device::flex());
    let fast = scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), None, None, false);
    // Asking for the weights takes the general path.
    let general = scaled_dot_product_attention(q, k, v, None, None, true);
    let diff = (fast.context - general.context)
        .abs()
        .max()
        .into_scalar::<f32>();
    assert!(diff < 1e-5, "differs by {diff}");
}

/// The general path: split the heads, attend with the causal mask, merge.
fn general(qkv: Tensor<3>, heads: usize) -> Tensor<3> {
    let [b, t, d3] = qkv.dims();
    let d = d3 / 3;
    let split = |part: usize| {
        qkv.clone()
            .slice([0..b, 0..t, part * d..(part + 1) * d])
            .reshape([b, t, heads, d / heads])
            .swap_dims(1, 2)
    };
    let mask = causal_mask(t, t, &qkv.device());
    let out = scaled_dot_product_attention(split(0), split(1), split(2), Some(mask), None, false);
    out.context.swap_dims(1, 2).reshape([b, t, d])
}

/// The fused causal self-attention op (on flex, one task per sequence and head) against the
/// general masked path, on flex, flex + autodiff and flex + autodiff + checkpointing; head
/// sizes 4 and 7, one position and several; and against the model's other causal path
/// (`causal_attention`) on the same heads.
#[test]
fn causal_self_attention_equals_the_general_path() {
    let no_dropout = DropoutConfig::new(0.0).init();
    for (b, t, heads, k) in [(2, 9, 3, 4), (1, 1, 2, 7), (3, 16, 1, 7)] {
        let d = heads * k;
        let draw = |dims: [usize; 3]| {
            Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.5), &Device::flex()).into_data()
        };
        let (x, g) = (draw([b, t, 3 * d]), draw([b, t, d]));
        let fused = |qkv: Tensor<3>| {
            ember_model::ops::causal_self_attention(qkv, heads, &no_dropout).expect("no dropout")
        };
        agrees_on(
            &Device::flex(),
            &x,
            &g,
            fused,
            |qkv| general(qkv, heads),
            2e-5,
            &format!("{b}x{t}, {heads} heads of {k}"),
        );
        let qkv = Tensor::<3>::from_data(x.clone(), &Device::flex());
        let [q, kk, v] = [0, 1, 2].map(|part| {
            qkv.clone()
                .slice([0..b, 0..t, part * d..(part + 1) * d])
                .reshape([b, t, heads, k])
                .swap_dims(1, 2)
        });
        let other = causal_attention(q, kk, v, None, false).context;
        let other = other.swap_dims(1, 2).reshape([b, t, d]);
        let diff = (fused(qkv) - other).abs().max().into_scalar::<f32>();
        assert!(diff < 1e-5, "against causal_attention: {diff}");
    }
}
