//! The attention graphs, evaluated on the CPU ([`super::interpret`]), against Burn's autodiff of
//! the op's reference (no dropout) and against a dense `f64` attention with the same dropout
//! mask: the graphs cuDNN receives compute the attention and its gradient, from and into
//! ember's layouts.

use super::attention_graph::{AttentionShape, backward_graph, forward_graph, uid};
use super::graph::{DataType, Op};
use super::interpret::{Buffer, run};
use burn::tensor::{Device, Tensor, TensorData};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

fn buffer(values: Vec<f64>) -> Buffer {
    Rc::new(RefCell::new(values))
}

/// A hashed Bernoulli mask keeping about `keep` of the elements.
fn hashed(keep: f64) -> impl Fn([i64; 4]) -> f64 {
    move |at: [i64; 4]| {
        let mut x = (at[0] * 1_000_003 + at[1] * 10_007 + at[2] * 101 + at[3]) as u64;
        x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 29;
        let u = (x % 10_000) as f64 / 10_000.0;
        f64::from(u8::from(u < keep))
    }
}

/// What the two graphs give: the output `[B, T, D]`, the log-sum-exps `[B, H, T]` and the
/// projection's gradient `[B, T, 3D]`.
struct Passes {
    out: Vec<f64>,
    lse: Vec<f64>,
    dqkv: Vec<f64>,
}

/// Both graphs of `shape` on `qkv` and the output's gradient `grad`, through the interpreter.
fn through_graphs(
    shape: &AttentionShape,
    qkv: &[f64],
    grad: &[f64],
    mask: &dyn Fn([i64; 4]) -> f64,
) -> Passes {
    let (b, h, t, k) = (shape.b, shape.h, shape.t, shape.k);
    let d = (h * k) as usize;
    let rows = (b * t) as usize;
    let qkv = buffer(qkv.to_vec());
    let out = buffer(vec![f64::NAN; rows * d]);
    let lse = buffer(vec![f64::NAN; (b * h * t) as usize]);
    let seeds = buffer(vec![0.0; 1]);
    let mut memory: HashMap<i64, (Buffer, i64)> = HashMap::new();
    let offset = |u| shape.element_offset(u);
    for u in [uid::Q, uid::K, uid::V] {
        memory.insert(u, (qkv.clone(), offset(u)));
    }
    memory.insert(uid::O, (out.clone(), 0));
    memory.insert(uid::STATS, (lse.clone(), 0));
    memory.insert(uid::SEED, (seeds.clone(), 0));
    memory.insert(uid::OFFSET, (seeds.clone(), 0));
    run(&forward_graph(shape), &memory, mask);

    let dqkv = buffer(vec![f64::NAN; rows * 3 * d]);
    memory.insert(uid::DO, (buffer(grad.to_vec()), 0));
    for u in [uid::DQ, uid::DK, uid::DV] {
        memory.insert(u, (dqkv.clone(), offset(u)));
    }
    memory.insert(
        uid::DELTA,
        (buffer(vec![f64::NAN; (b * h * t) as usize]), 0),
    );
    memory.insert(uid::DQ_ACCUMULATOR, (buffer(vec![f64::NAN; rows * d]), 0));
    run(&backward_graph(shape), &memory, mask);
    let take = |x: Buffer| x.borrow().clone();
    Passes {
        out: take(out),
        lse: take(lse),
        dqkv: take(dqkv),
    }
}

/// The same in dense `f64` loops, per sequence and head: scores, softmax (causal where the shape
/// is), `M r`, the
/// product with `V`; FlashAttention's backward.
#[allow(clippy::needless_range_loop)] // indices into the projection's layout, as the maths writes them
fn dense(
    shape: &AttentionShape,
    qkv: &[f64],
    grad: &[f64],
    mask: &dyn Fn([i64; 4]) -> f64,
) -> Passes {
    let (b, h, t, k) = (
        shape.b as usize,
        shape.h as usize,
        shape.t as usize,
        shape.k as usize,
    );
    let d = h * k;
    let scale = 1.0 / (k as f64).sqrt();
    let r = 1.0 / (1.0 - f64::from(shape.dropout));
    let at = |s: usize, i: usize, part: usize, hh: usize, c: usize| {
        (s * t + i) * 3 * d + part * d + hh * k + c
    };
    let mut passes = Passes {
        out: vec![0.0; b * t * d],
        lse: vec![0.0; b * h * t],
        dqkv: vec![0.0; b * t * 3 * d],
    };
    for s in 0..b {
        for hh in 0..h {
            let m = |i: usize, j: usize| match shape.dropout > 0.0 {
                true => mask([s as i64, hh as i64, i as i64, j as i64]),
                false => 1.0,
            };
            let mut p = vec![vec![0.0; t]; t];
            for i in 0..t {
                // The keys query `i` sees.
                let seen = if shape.causal { i + 1 } else { t };
                let scores: Vec<f64> = (0..seen)
                    .map(|j| {
                        scale
                            * (0..k)
                                .map(|c| qkv[at(s, i, 0, hh, c)] * qkv[at(s, j, 1, hh, c)])
                                .sum::<f64>()
                    })
                    .collect();
                let max = scores.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x));
                let sum: f64 = scores.iter().map(|x| (x - max).exp()).sum();
                passes.lse[(s * h + hh) * t + i] = max + sum.ln();
                for j in 0..seen {
                    p[i][j] = (scores[j] - max).exp() / sum;
                }
            }
            let dropped = |i: usize, j: usize| p[i][j] * m(i, j) * r;
            let g = |i: usize, c: usize| grad[(s * t + i) * d + hh * k + c];
            for i in 0..t {
                for c in 0..k {
                    passes.out[(s * t + i) * d + hh * k + c] = (0..t)
                        .map(|j| dropped(i, j) * qkv[at(s, j, 2, hh, c)])
                        .sum();
                }
            }
            // dP = dO V^T M r; dS = P (dP - rowsum(dP P)); dQ = scale dS K, dK = scale dS^T Q.
            let mut ds = vec![vec![0.0; t]; t];
            for i in 0..t {
                let dp: Vec<f64> = (0..t)
                    .map(|j| {
                        (0..k)
                            .map(|c| g(i, c) * qkv[at(s, j, 2, hh, c)])
                            .sum::<f64>()
                            * m(i, j)
                            * r
                    })
                    .collect();
                let delta: f64 = (0..t).map(|j| dp[j] * p[i][j]).sum();
                for (j, out) in ds[i].iter_mut().enumerate() {
                    *out = p[i][j] * (dp[j] - delta);
                }
            }
            for i in 0..t {
                for c in 0..k {
                    passes.dqkv[at(s, i, 0, hh, c)] = scale
                        * (0..t)
                            .map(|j| ds[i][j] * qkv[at(s, j, 1, hh, c)])
                            .sum::<f64>();
                    passes.dqkv[at(s, i, 1, hh, c)] = scale
                        * (0..t)
                            .map(|j| ds[j][i] * qkv[at(s, j, 0, hh, c)])
                            .sum::<f64>();
                    passes.dqkv[at(s, i, 2, hh, c)] = (0..t).map(|j| dropped(j, i) * g(j, c)).sum();
                }
            }
        }
    }
    passes
}

fn shape(b: i64, h: i64, t: i64, k: i64, dropout: f32) -> AttentionShape {
    AttentionShape {
        b,
        h,
        t,
        k,
        dtype: DataType::Bf16,
        dropout,
        rng: false,
        causal: true,
        masked: f32::NEG_INFINITY,
    }
}

fn random(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 20_001) as f64 / 10_000.0 - 1.0
        })
        .collect()
}

fn assert_close(what: &str, ours: &[f64], expected: &[f64], tolerance: f64) {
    assert_eq!(ours.len(), expected.len(), "{what}: lengths");
    let scale = expected.iter().fold(1f64, |m, v| m.max(v.abs()));
    for (i, (a, e)) in ours.iter().zip(expected).enumerate() {
        assert!(
            (a - e).abs() <= tolerance * scale,
            "{what}: value {i} is {a}, expected {e}"
        );
    }
}

/// Without dropout: the graphs' output and gradient equal Burn's autodiff of the op's
/// reference on flex (an independent path: split heads, masked softmax, merge), and their
/// log-sum-exps the dense loops'.
#[test]
fn graphs_equal_the_reference_without_dropout() {
    for (b, h, t, k) in [(2, 3, 7, 4), (1, 2, 1, 8), (2, 1, 12, 2)] {
        let shape = shape(b, h, t, k, 0.0);
        let d = (h * k) as usize;
        let n = (b * t) as usize;
        let (qkv, grad) = (random(n * 3 * d, 1), random(n * d, 2));
        let ours = through_graphs(&shape, &qkv, &grad, &|_| 1.0);

        let device = Device::flex().autodiff();
        let dims = [b as usize, t as usize];
        let to32 = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
        let x = Tensor::<3>::from_data(
            TensorData::new(to32(&qkv), [dims[0], dims[1], 3 * d]),
            &device,
        )
        .require_grad();
        let g =
            Tensor::<3>::from_data(TensorData::new(to32(&grad), [dims[0], dims[1], d]), &device);
        let out = crate::causal_self_attention_reference(x.clone(), h as usize);
        let grads = (out.clone() * g).sum().backward();
        let read = |t: Tensor<3>| -> Vec<f64> {
            t.into_data()
                .try_to_vec::<f32>()
                .unwrap()
                .into_iter()
                .map(f64::from)
                .collect()
        };
        let what = format!("{b}x{t}, {h} heads of {k}");
        assert_close(
            &format!("output, {what}"),
            &ours.out,
            &read(out.inner()),
            1e-5,
        );
        assert_close(
            &format!("gradient, {what}"),
            &ours.dqkv,
            &read(x.grad(&grads).unwrap()),
            1e-5,
        );
        let loops = dense(&shape, &qkv, &grad, &|_| 1.0);
        // The graphs' scale is an `f32` (cuDNN takes it so), the loops' an `f64`.
        assert_close(&format!("log-sum-exp, {what}"), &ours.lse, &loops.lse, 1e-6);
        assert_close(
            &format!("dense gradient, {what}"),
            &loops.dqkv,
            &ours.dqkv,
            1e-6,
        );
    }
}

/// With dropout: the same mask in both passes gives the dense loops' output, log-sum-exps
/// (taken before dropout) and gradient; and dropping differs from not dropping.
#[test]
fn graphs_equal_dense_attention_with_dropout() {
    let p = 0.25;
    let shape = shape(2, 2, 9, 4, p);
    let d = 8;
    let n = 18;
    let (qkv, grad) = (random(n * 3 * d, 3), random(n * d, 4));
    let mask = hashed(1.0 - f64::from(p));
    let ours = through_graphs(&shape, &qkv, &grad, &mask);
    let loops = dense(&shape, &qkv, &grad, &mask);
    // The graphs' scales are `f32`s, the loops' `f64`s.
    assert_close("output", &ours.out, &loops.out, 1e-6);
    assert_close("log-sum-exp", &ours.lse, &loops.lse, 1e-6);
    assert_close("gradient", &ours.dqkv, &loops.dqkv, 1e-6);
    let kept = through_graphs(&shape, &qkv, &grad, &|_| 1.0);
    let largest = (ours.out.iter().zip(&kept.out)).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        largest > 0.01,
        "dropout changed the output by only {largest}"
    );
}

/// Without the causal mask (every query sees every key), with and without dropout: the dense
/// loops' attention; and the mask matters (the causal graphs differ).
#[test]
fn graphs_without_the_causal_mask_equal_dense_attention() {
    for p in [0.0, 0.25] {
        let shape = AttentionShape {
            causal: false,
            ..shape(2, 2, 9, 4, p)
        };
        let (qkv, grad) = (random(18 * 3 * 8, 7), random(18 * 8, 8));
        let mask = hashed(1.0 - f64::from(p));
        let ours = through_graphs(&shape, &qkv, &grad, &mask);
        let loops = dense(&shape, &qkv, &grad, &mask);
        assert_close("output", &ours.out, &loops.out, 1e-6);
        assert_close("log-sum-exp", &ours.lse, &loops.lse, 1e-6);
        assert_close("gradient", &ours.dqkv, &loops.dqkv, 1e-6);
        let causal = AttentionShape {
            causal: true,
            ..shape
        };
        let masked = through_graphs(&causal, &qkv, &grad, &mask);
        let largest =
            (ours.lse.iter().zip(&masked.lse)).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            largest > 0.01,
            "the causal mask changed the log-sum-exps by only {largest}"
        );
    }
}

/// The graphs with their dropout nodes kept and nothing dropped (every element kept, rescaled
/// by 1) give the attention without dropout: the same as the graphs without those nodes.
#[test]
fn graphs_with_dropout_nodes_and_no_dropout_equal_those_without() {
    let plain = shape(2, 2, 9, 8, 0.0);
    let with_nodes = AttentionShape { rng: true, ..plain };
    assert!(
        forward_graph(&with_nodes)
            .memory_uids()
            .contains(&uid::SEED)
    );
    let (qkv, grad) = (random(18 * 3 * 16, 5), random(18 * 16, 6));
    let a = through_graphs(&plain, &qkv, &grad, &|_| 1.0);
    // The generator keeps every element with probability 1.
    let b = through_graphs(&with_nodes, &qkv, &grad, &hashed(1.0));
    assert_close("output", &b.out, &a.out, 1e-12);
    assert_close("log-sum-exp", &b.lse, &a.lse, 1e-12);
    assert_close("gradient", &b.dqkv, &a.dqkv, 1e-12);
}

/// The tensors in memory are exactly the caller's buffers: the projection's three blocks, the
/// output, the statistics, the gradients, the seeds where dropping, and the work memory.
#[test]
fn graphs_read_and_write_the_named_buffers() {
    let plain = shape(2, 2, 8, 4, 0.0);
    assert_eq!(
        forward_graph(&plain).memory_uids(),
        [uid::Q, uid::K, uid::V, uid::O, uid::STATS]
    );
    let dropping = AttentionShape {
        dropout: 0.1,
        ..plain
    };
    assert_eq!(
        forward_graph(&dropping).memory_uids(),
        [
            uid::Q,
            uid::K,
            uid::V,
            uid::O,
            uid::STATS,
            uid::SEED,
            uid::OFFSET
        ]
    );
    let mut expected = vec![uid::Q, uid::K, uid::V, uid::O, uid::STATS];
    expected.extend([
        uid::DO,
        uid::DQ,
        uid::DK,
        uid::DV,
        uid::DELTA,
        uid::DQ_ACCUMULATOR,
    ]);
    assert_eq!(backward_graph(&plain).memory_uids(), expected);
    // The projection's type for its blocks, the output and its gradient; f32 statistics.
    let half = AttentionShape {
        dtype: DataType::F16,
        ..plain
    };
    let g = backward_graph(&half);
    for u in [
        uid::Q,
        uid::K,
        uid::V,
        uid::O,
        uid::DO,
        uid::DQ,
        uid::DK,
        uid::DV,
    ] {
        assert_eq!(g.tensor(u).dtype, DataType::F16, "tensor {u}");
    }
    for u in [uid::STATS, uid::DELTA, uid::DQ_ACCUMULATOR] {
        assert_eq!(g.tensor(u).dtype, DataType::F32, "tensor {u}");
    }
    // Every operation names tensors of its graph, each tensor once.
    for g in [forward_graph(&dropping), backward_graph(&dropping)] {
        for op in &g.ops {
            let named = match *op {
                Op::Matmul { a, b, c } => vec![a, b, c],
                Op::Pointwise { x, b, t, y, .. } => {
                    [Some(x), b, t, Some(y)].into_iter().flatten().collect()
                }
                Op::Reduction { x, y, .. } | Op::Reshape { x, y } => vec![x, y],
                Op::Rng {
                    seed, offset, y, ..
                } => vec![seed, offset, y],
            };
            for u in named {
                assert_eq!(g.tensor(u).uid, u);
            }
        }
        for t in &g.tensors {
            assert_eq!(g.tensors.iter().filter(|o| o.uid == t.uid).count(), 1);
        }
    }
}
