//! The attention op's tests on wgpu (Mesa's lavapipe in CI): the fused kernels, the batched
//! products and the cached attention against the reference, output and gradients.

use super::*;
use crate::check::agrees_on;
use burn::tensor::{Device, DeviceKind, Distribution};

/// Output and the projection's gradient against the op's reference (split heads, masked
/// softmax, merge: what every other backend runs) on wgpu, plain, under autodiff and with
/// checkpointing: head sizes 4 to 128 (smaller tiles), one position and several, lengths
/// that are not a multiple of a cube's rows or of a tile (two and three blocks of rows), one
/// head and several.
#[test]
fn equals_the_reference_on_wgpu() {
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    let cases = [
        (2, 9, 3, 4),
        (1, 1, 2, 7),
        (3, 37, 2, 16),
        (2, 70, 1, 32),
        (1, 150, 2, 64),
        (1, 40, 1, 128),
    ];
    for (b, t, heads, k) in cases {
        let d = heads * k;
        let draw = |dims: [usize; 3]| {
            Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &device).into_data()
        };
        let (x, g) = (draw([b, t, 3 * d]), draw([b, t, d]));
        for on in [device.clone(), device.clone().autodiff()] {
            let qkv = Tensor::<3>::from_data(x.clone(), &on);
            assert!(
                super::super::gpu_kernel_takes(GpuKernel::Attention, &qkv),
                "kernels take wgpu f32"
            );
        }
        op_equals_the_reference(
            &device,
            &x,
            &g,
            heads,
            &format!("{b}x{t}, {heads} heads of {k}"),
        );
    }
}

/// The op on wgpu `f32` against the reference ([`agrees_on`]: plain, under autodiff and with
/// checkpointing), output and projection gradient within 1e-4.
fn op_equals_the_reference(
    device: &Device,
    x: &burn::tensor::TensorData,
    g: &burn::tensor::TensorData,
    heads: usize,
    what: &str,
) {
    agrees_on(
        device,
        x,
        g,
        |qkv| causal_self_attention(qkv, heads, 0.0).expect("a wgpu f32 tensor"),
        |qkv| crate::causal_self_attention_reference(qkv, heads),
        1e-4,
        what,
    );
}

/// A policy in force on this thread until dropped (for a loop body).
struct PolicyScope(Option<crate::GpuPolicy>);

impl PolicyScope {
    fn enter(policy: crate::GpuPolicy) -> Self {
        let before = crate::gpu_kernels::scoped();
        crate::gpu_kernels::set_scoped(Some(policy));
        PolicyScope(before)
    }
}

impl Drop for PolicyScope {
    fn drop(&mut self) {
        crate::gpu_kernels::set_scoped(self.0);
    }
}

/// The policy in force with the attention's knobs `tuning` (products on wgpu: Burn's products
/// standing in for cuBLAS, the path CUDA takes).
fn tuned(tuning: crate::AttentionTuning) -> crate::GpuPolicy {
    crate::GpuPolicy {
        attention: tuning,
        ..crate::gpu_kernels::policy()
    }
}

/// The attention as batched products, output and gradient, against the reference with the
/// same dropout mask, plain, under autodiff and with checkpointing: head sizes 4 to 128, one
/// position and several, lengths that are not a multiple of a cube's units, one head and
/// several, with dropout and without, all sequences in one call and a few at a time, in one
/// block of query rows and in several (the last one shorter, or of one row).
#[test]
fn products_equal_the_reference_on_wgpu() {
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    for (b, t, heads, k, p, per_call, block) in [
        (2, 9, 3, 4, 0.0, 0, 0),
        (1, 1, 1, 8, 0.25, 0, 0),
        (3, 37, 2, 16, 0.25, 0, 0),
        (3, 37, 2, 16, 0.25, 2, 8),
        (1, 70, 1, 32, 0.0, 0, 32),
        (2, 33, 2, 64, 0.25, 1, 16),
        (1, 40, 1, 128, 0.0, 0, 0),
        (2, 9, 3, 4, 0.25, 0, 1),
    ] {
        let tuning = crate::AttentionTuning {
            products_anywhere: true,
            sequences_per_call: (per_call > 0).then_some(per_call),
            block_rows: (block > 0).then_some(block),
            ..Default::default()
        };
        let seed = 0.125_f32;
        crate::gpu_kernels::with_policy(tuned(tuning), || {
            agrees_with_the_masked_reference(
                &device,
                [b, t, heads, k],
                seed,
                p,
                &format!(
                    "products, dropout {p}, {b}x{t}, {heads} heads of {k}, {per_call} per call, \
                     blocks of {block}"
                ),
            )
        });
    }
}

/// The check CUDA runs before the attention takes the products passes on wgpu, where the
/// products are Burn's: in f32, and in f16 (lavapipe has no bf16).
#[test]
fn the_products_check_passes_on_wgpu() {
    let like = crate::cube::attention_products::tests::cube(&[0.0], [1, 1, 1]);
    products_agree(&like).unwrap();
    let narrow = float_cast_to::<CubeBackend>(like, DType::F16);
    products_agree(&narrow).unwrap();
}

/// Mixed precision's f16 projection (lavapipe has no bf16; the path is the same) through the
/// batched products under autodiff, with dropout and without, all sequences per call and
/// one: the output stays f16, and output and gradient are near the reference's in f32 on
/// the same values with the same mask (the weights and outputs rounded to f16, the rest
/// computed in f32). A wrong matrix, mask or type is off by far more.
#[test]
fn narrow_products_stay_narrow_near_the_reference_on_wgpu() {
    use burn::tensor::FloatDType;
    let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
    for (b, t, heads, k, p, per_call, block) in [
        (2, 45, 3, 8, 0.0, 0, 0),
        (3, 37, 2, 16, 0.25, 1, 0),
        (1, 70, 1, 64, 0.25, 0, 0),
        (2, 45, 3, 8, 0.25, 0, 16),
    ] {
        let tuning = crate::AttentionTuning {
            products_anywhere: true,
            sequences_per_call: (per_call > 0).then_some(per_call),
            block_rows: (block > 0).then_some(block),
            ..Default::default()
        };
        let _scope = PolicyScope::enter(tuned(tuning));
        let what = format!("f16 products, dropout {p}, {b}x{t}, {heads} heads of {k}");
        let d = heads * k;
        let (x, g) = (
            f16_exact([b, t, 3 * d], &device),
            f16_exact([b, t, d], &device),
        );
        let seed = 0.125_f32;
        let factors = dropout_factors(b, heads, t, seed, p);
        let leaf = |data| Tensor::<3>::from_data(data, &device).require_grad();
        let (narrow_in, wide_in) = (leaf(x.clone()), leaf(x));
        let narrow = seeded(
            narrow_in.clone().cast(FloatDType::F16),
            heads,
            p as f64,
            |on| Tensor::<1>::from_floats([seed], on),
        )
        .unwrap_or_else(|_| panic!("{what}: the kernels take an f16 projection"));
        assert_eq!(narrow.dtype(), DType::F16, "{what}");
        let narrow = narrow.cast(FloatDType::F32);
        let wide = crate::attention::masked_reference(wide_in.clone(), heads, &factors);
        let weights = Tensor::<3>::from_data(g, &device);
        let near = |a: Tensor<3>, r: Tensor<3>, part: &str| {
            let scale = r.clone().abs().max().into_scalar::<f32>();
            let diff = (a - r).abs().max().into_scalar::<f32>();
            assert!(
                diff < 5e-3 * scale,
                "{what}: {part} off by {diff} (scale {scale})"
            );
        };
        near(narrow.clone().inner(), wide.clone().inner(), "output");
        let loss = |y: Tensor<3>| (y * weights.clone()).sum();
        let (gn, gw) = (loss(narrow).backward(), loss(wide).backward());
        let (gn, gw) = (narrow_in.grad(&gn).unwrap(), wide_in.grad(&gw).unwrap());
        near(gn, gw, "gradient");
    }
}

/// The one-row forward pass (heads other than 32 and 64) with one rescale per key, per 2
/// keys and per 8, against the reference: groups cut by a query's last key (the causal
/// edge), by the sequence's end and by tiles, with dropout and without.
#[test]
fn every_group_of_keys_equals_the_reference() {
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    for group in [1, 2, 8] {
        let _scope = PolicyScope::enter(tuned(crate::AttentionTuning {
            keys_per_rescale: Some(group),
            ..Default::default()
        }));
        for (b, t, heads, k, p) in [(2, 9, 3, 4, 0.0), (1, 45, 2, 16, 0.0), (1, 70, 2, 8, 0.25)] {
            let seed = 0.25_f32;
            agrees_with_the_masked_reference(
                &device,
                [b, t, heads, k],
                seed,
                p,
                &format!("groups of {group}, dropout {p}, {b}x{t}, {heads} heads of {k}"),
            );
        }
    }
}

/// The register-tiled forward pass and backward pass of keys and values (head sizes 32 and
/// 64) against the reference, output and gradient: one position, a block's rows minus
/// one, exactly one block, one more, several blocks ending inside a tile, several heads
/// and sequences, with dropout and without; and the launches take the tiled kernels with
/// cubes of both sizes.
#[test]
fn tiled_kernels_equal_the_reference() {
    use super::dims::Tiled;
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    // The cube sizes each kernel family is launched with, over the cases.
    let mut sizes = [Vec::new(), Vec::new(), Vec::new()];
    for (b, t, heads, k, p) in [
        (1, 1, 1, 64, 0.0),
        (2, 63, 2, 32, 0.0),
        (1, 64, 1, 64, 0.0),
        (1, 65, 3, 32, 0.25),
        (2, 150, 2, 64, 0.0),
        (1, 200, 1, 64, 0.25),
    ] {
        let seed = 0.75_f32;
        agrees_with_the_masked_reference(
            &device,
            [b, t, heads, k],
            seed,
            p,
            &format!("tiled, dropout {p}, {b}x{t}, {heads} heads of {k}"),
        );
        let qkv = crate::cube::attention_products::tests::cube(
            &vec![0.0; b * t * 3 * heads * k],
            [b, t, 3 * heads * k],
        );
        let dims = Dims::of(&qkv, heads);
        let families = [
            &[Tiled::Forward][..],
            &[Tiled::Queries][..],
            &[Tiled::Keys, Tiled::Values][..],
        ];
        for (family, kinds) in families.iter().enumerate() {
            for &kind in kinds.iter() {
                sizes[family].extend(dims.tiled_rows(&qkv, kind));
            }
        }
    }
    // lavapipe's 32 KiB of shared memory hold cubes of 64 rows (keys) for heads of 32 and
    // of 32 for heads of 64 (32 for both in the values' kernel): both sizes of every
    // kernel ran.
    for (family, name) in ["forward", "queries' backward", "keys' backward"]
        .iter()
        .enumerate()
    {
        for rows in [32, 64] {
            assert!(
                sizes[family].contains(&rows),
                "the register-tiled {name} pass never ran with cubes of {rows} rows"
            );
        }
    }
}

/// The op with dropout `p` by the mask of `seed` (0 for none) against the reference with
/// the same mask applied to its weights (rebuilt on the host from the kernels' hash), on
/// random `[B, T, 3D]` inputs of `heads` heads of `k`: output and gradient, plain, under
/// autodiff and with checkpointing ([`agrees_on`], to 1e-4 of the largest value).
fn agrees_with_the_masked_reference(
    device: &Device,
    [b, t, heads, k]: [usize; 4],
    seed: f32,
    p: f32,
    what: &str,
) {
    let d = heads * k;
    let draw = |dims: [usize; 3]| {
        Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), device).into_data()
    };
    let (x, g) = (draw([b, t, 3 * d]), draw([b, t, d]));
    let factors = dropout_factors(b, heads, t, seed, p);
    agrees_on(
        device,
        &x,
        &g,
        |qkv| {
            let seed = |on: &Device| Tensor::<1>::from_floats([seed], on);
            seeded(qkv, heads, p as f64, seed).expect("a wgpu f32 tensor")
        },
        |qkv| crate::attention::masked_reference(qkv, heads, &factors),
        1e-4,
        what,
    );
}

/// Queries over a cache's whole buffer against the reference (scores, mask by position,
/// softmax): the queries a view with heads swapped in (as the model passes them), every
/// buffer row filled (rows past `start + T` must be hidden by position alone), first step,
/// middle and last rows of the buffer, one query and several.
#[test]
fn cached_attention_equals_the_reference_on_wgpu() {
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    let normal = Distribution::Normal(0.0, 1.0);
    for (b, heads, head, capacity, start, t) in [
        (2, 2, 8, 32, 0, 1),
        (1, 3, 16, 32, 5, 3),
        (2, 2, 8, 32, 29, 3),
        (1, 1, 4, 7, 6, 1),
        (1, 2, 64, 300, 250, 2),
        // A batch of long prompts: more query rows (66,560) than a launch has cubes a side.
        (64, 4, 8, 300, 0, 260),
    ] {
        let q = Tensor::<4>::random([b, t, heads, head], normal, &device).swap_dims(1, 2);
        let k = Tensor::<4>::random([b, heads, capacity, head], normal, &device) * 2.0;
        let v = Tensor::<4>::random([b, heads, capacity, head], normal, &device);
        let fast = cached_causal_attention(q.clone(), k.clone(), v.clone(), start)
            .expect("plain wgpu f32 tensors");
        // The same with the position read from a device tensor (a replayed step).
        let position = Tensor::<1, Int>::from_ints([start as i32], &device);
        let at = cached_causal_attention_at(q.clone(), k.clone(), v.clone(), &position)
            .expect("plain wgpu f32 tensors");
        let reference = crate::cached_causal_attention_reference(q, k, v, start, None);
        let diff = (fast - reference.clone()).abs().max().into_scalar::<f32>();
        assert!(
            diff < 1e-5,
            "{b}x{heads}x{head}, start {start}, {t} rows: {diff}"
        );
        let diff = (at - reference).abs().max().into_scalar::<f32>();
        assert!(diff < 1e-5, "at {start}, {t} rows: {diff}");
    }
    // Tracked tensors go back to the caller (decoding is never differentiated).
    let tracked = device.clone().autodiff();
    let x = Tensor::<4>::random([1, 1, 1, 4], normal, &tracked);
    assert!(cached_causal_attention(x.clone(), x.clone(), x, 0).is_err());
}

/// Mixed precision's f16 projection under autodiff (lavapipe has no bf16; the path is the
/// same): the kernels take it, the output is f16, the f32 kernels' output on the same values
/// rounded once; the projection's gradient comes back through the f16 op near the f32 one.
#[test]
fn a_narrow_projection_stays_narrow_and_is_computed_in_f32_on_wgpu() {
    use burn::tensor::FloatDType;
    let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
    let (b, t, heads, k) = (2, 45, 3, 8);
    let d = heads * k;
    let (x, g) = (
        f16_exact([b, t, 3 * d], &device),
        f16_exact([b, t, d], &device),
    );
    let leaf = |data| Tensor::<3>::from_data(data, &device).require_grad();
    let (narrow_in, wide_in) = (leaf(x.clone()), leaf(x));
    let narrow = causal_self_attention(narrow_in.clone().cast(FloatDType::F16), heads, 0.0)
        .unwrap_or_else(|_| panic!("the kernels take an f16 projection under autodiff"));
    assert_eq!(narrow.dtype(), DType::F16);
    let wide = causal_self_attention(wide_in.clone(), heads, 0.0).expect("f32");
    narrow.clone().cast(FloatDType::F32).into_data().assert_eq(
        &wide
            .clone()
            .cast(FloatDType::F16)
            .cast(FloatDType::F32)
            .into_data(),
        true,
    );
    let weights = Tensor::<3>::from_data(g, &device);
    let loss = |y: Tensor<3>| (y.cast(FloatDType::F32) * weights.clone()).sum();
    let (gn, gw) = (loss(narrow).backward(), loss(wide).backward());
    let (gn, gw) = (narrow_in.grad(&gn).unwrap(), wide_in.grad(&gw).unwrap());
    let scale = gw.clone().abs().max().into_scalar::<f32>();
    let diff = (gn - gw).abs().max().into_scalar::<f32>();
    assert!(
        diff < 5e-3 * scale,
        "gradient off by {diff} (scale {scale})"
    );
}

/// The same f16 projection without autodiff (an evaluation in mixed precision): the kernels
/// take it as it is (on CUDA, cuDNN's flash attention), the output is f16 and equals the f32
/// kernels' output on the same values rounded once, as widening it first gave.
#[test]
fn a_narrow_projection_is_taken_in_evaluation_on_wgpu() {
    use burn::tensor::FloatDType;
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    let (b, t, heads, k) = (2, 45, 3, 8);
    let x = Tensor::<3>::from_data(f16_exact([b, t, 3 * heads * k], &device), &device);
    let narrow = causal_self_attention(x.clone().cast(FloatDType::F16), heads, 0.0)
        .unwrap_or_else(|_| panic!("the kernels take a plain f16 projection"));
    assert_eq!(narrow.dtype(), DType::F16);
    let wide = causal_self_attention(x, heads, 0.0).expect("f32");
    narrow.cast(FloatDType::F32).into_data().assert_eq(
        &wide.cast(FloatDType::F16).cast(FloatDType::F32).into_data(),
        true,
    );
}

/// Normal random values that f16 holds exactly, so that an f16 path and an f32 one start
/// from the same numbers.
pub(super) fn f16_exact(dims: [usize; 3], device: &Device) -> burn::tensor::TensorData {
    use burn::tensor::FloatDType;
    Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), device)
        .cast(FloatDType::F16)
        .cast(FloatDType::F32)
        .into_data()
}

/// The kernels' dropout factors `[B, H, T, T]` (0 or `1 / (1 - p)`), computed on the host.
fn dropout_factors(b: usize, heads: usize, t: usize, seed: f32, p: f32) -> Vec<f32> {
    crate::cube::hashed_mask::host_factors(seed, p, b * heads * t * t)
}

/// With dropout: output and gradient against the reference with the same mask applied to
/// its weights (the mask rebuilt on the host from the kernels' hash), on wgpu plain, under
/// autodiff and with checkpointing, one block of rows and two; and the mask drops about `p`
/// of the weights.
#[test]
fn dropout_equals_the_reference_with_the_same_mask() {
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    let (seed, p) = (0.6180339_f32, 0.25_f32);
    for (b, t, heads, k) in [(2, 9, 3, 4), (1, 45, 2, 16), (1, 70, 2, 8)] {
        agrees_with_the_masked_reference(
            &device,
            [b, t, heads, k],
            seed,
            p,
            &format!("dropout {p}, {b}x{t}, {heads} heads of {k}"),
        );
    }
    let factors = dropout_factors(4, 4, 64, seed, p);
    let dropped = factors.iter().filter(|&&f| f == 0.0).count() as f32 / factors.len() as f32;
    assert!(
        (dropped - p).abs() < 0.01,
        "dropped {dropped} of the weights, not {p}"
    );
}

/// Through the op layer: a training-mode `Dropout` on an autodiff device drops weights (the
/// output changes), repeatably under `Device::seed`; on a plain device it does nothing.
#[test]
fn dropout_in_training_only_and_repeatable() {
    use burn::nn::DropoutConfig;
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    let (heads, dropout) = (2, DropoutConfig::new(0.3).init());
    let none = DropoutConfig::new(0.0).init();
    let x =
        Tensor::<3>::random([2, 17, 3 * 16], Distribution::Normal(0.0, 1.0), &device).into_data();
    let run = |device: &Device, dropout: &burn::nn::Dropout, seed: u64| {
        crate::seed_random(device, seed);
        let qkv = Tensor::<3>::from_data(x.clone(), device);
        crate::causal_self_attention(qkv, heads, dropout)
            .expect("kernels take wgpu")
            .into_data()
    };
    let tracked = device.clone().autodiff();
    let plain = run(&tracked, &none, 1);
    // Burn's CubeCL backends keep one random generator for the process: a test drawing beside
    // this one between `seed` and the op's own draw changes the mask. A repeatable mask shows
    // it in one of three tries; a mask that is not repeatable, in none.
    let repeatable = (0..3).any(|_| run(&tracked, &dropout, 1) == run(&tracked, &dropout, 1));
    assert!(repeatable, "the same seed, another mask, three times");
    let (a, other) = (run(&tracked, &dropout, 1), run(&tracked, &dropout, 2));
    assert_ne!(a, plain, "dropout changed nothing");
    assert_ne!(a, other, "another seed, the same mask");
    run(&device, &dropout, 1).assert_approx_eq::<f32>(&plain, Default::default());
}

/// `x` as the backend's tensor (a wgpu or Vulkan tensor is CubeCL's).
pub(super) fn cube_tensor(x: Tensor<3>) -> burn_cubecl::tensor::CubeTensor {
    use burn::backend::{BackendTensor, DispatchTensorKind};
    match x.into_dispatch().kind {
        DispatchTensorKind::Cube(BackendTensor::Float(x)) => x,
        _ => panic!("a wgpu or Vulkan tensor is CubeCL's"),
    }
}

/// Under `policy`, every path that applies to calls of `cases` (`b, t, heads, k, dropout`) in
/// `dtype`, forward pass on one and backward pass on another (as `attention-tune` may choose
/// them), against the fused kernels on both: output, log-sum-exps and gradient within
/// `tolerance` of the largest value. Returns the paths seen, for the caller to check.
pub(super) fn every_pair_of_paths_agrees(
    device: &Device,
    dtype: DType,
    cases: &[(usize, usize, usize, usize, f32)],
    tolerance: f32,
    policy: crate::GpuPolicy,
) -> Vec<super::tune::Path> {
    use super::backend::{backward_on, forward_on};
    use super::tune::{Path, paths};
    use burn::backend::TensorMetadata;
    use burn::backend::ops::FloatTensorOps;
    use burn::tensor::{FloatDType, TensorData};
    let _scope = PolicyScope::enter(policy);
    let mut seen = Vec::new();
    for &(b, t, heads, k, p) in cases {
        let what = format!("{dtype:?}, dropout {p}, {b}x{t}, {heads} heads of {k}");
        let d = heads * k;
        let load = |dims: [usize; 3]| {
            let x = Tensor::<3>::from_data(f16_exact(dims, device), device);
            cube_tensor(x.cast(FloatDType::from(dtype)))
        };
        let (qkv, grad) = (load([b, t, 3 * d]), load([b, t, d]));
        let seed = CubeBackend::float_from_data(TensorData::new(vec![0.375_f32], [1]), &qkv.device);
        let read = |x: burn_cubecl::tensor::CubeTensor| {
            burn_cubecl::ops::into_data_sync(wide::<CubeBackend>(x))
                .try_to_vec::<f32>()
                .unwrap()
        };
        let near = |ours: Vec<f32>, fused: &[f32], part: &str| {
            let scale = fused.iter().fold(1e-6_f32, |m, v| m.max(v.abs()));
            let diff = ours
                .iter()
                .zip(fused)
                .fold(0_f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                diff <= tolerance * scale,
                "{what}: {part} off by {diff} (scale {scale})"
            );
        };
        let (fused_out, fused_lse) = forward_on(Path::Fused, &qkv, &seed, heads, p);
        let fused_grad = read(backward_on(
            Path::Fused,
            &qkv,
            &seed,
            &fused_out,
            &fused_lse,
            &grad,
            heads,
            p,
        ));
        let (fused_out, fused_lse) = (read(fused_out), read(fused_lse));
        let paths = paths(&qkv, &Dims::of(&qkv, heads));
        for &forward in &paths {
            let (out, lse) = forward_on(forward, &qkv, &seed, heads, p);
            assert_eq!(out.dtype(), dtype, "{what}: {forward:?}'s output");
            near(
                read(out.clone()),
                &fused_out,
                &format!("{forward:?}'s output"),
            );
            near(
                read(lse.clone()),
                &fused_lse,
                &format!("{forward:?}'s log-sum-exps"),
            );
            for &backward in &paths {
                let dqkv = backward_on(backward, &qkv, &seed, &out, &lse, &grad, heads, p);
                assert_eq!(dqkv.dtype(), dtype, "{what}: {backward:?}'s gradient");
                near(
                    read(dqkv),
                    &fused_grad,
                    &format!("gradient, forward {forward:?}, backward {backward:?}"),
                );
            }
        }
        for path in paths {
            if !seen.contains(&path) {
                seen.push(path);
            }
        }
    }
    seen
}

/// The batched products (Burn's on wgpu) and the fused kernels in f32, forward pass on one
/// and backward pass on the other: the same output, log-sum-exps and gradient, with dropout
/// and without (what lets `attention-tune` choose each pass on its own).
#[test]
fn a_pass_on_one_path_pairs_with_a_pass_on_another_on_wgpu() {
    use super::tune::Path;
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    let policy = tuned(crate::AttentionTuning {
        products_anywhere: true,
        ..Default::default()
    });
    let cases = [
        (2, 37, 2, 16, 0.25),
        (1, 70, 3, 32, 0.0),
        (2, 9, 1, 4, 0.25),
    ];
    let seen = every_pair_of_paths_agrees(&device, DType::F32, &cases, 1e-4, policy);
    assert_eq!(seen, [Path::Products, Path::Fused]);
}

/// With `attention-tune` on and every call timed, the op under autodiff equals the reference
/// (output and gradient) whichever path each pass chose; both passes of each shape are timed
/// on both paths once and a choice kept (the shape called twice, on three devices: plain,
/// autodiff, checkpointed); with the strategy off nothing is timed.
#[test]
fn tuned_attention_equals_the_reference_on_wgpu() {
    use super::tune::{CHOICES, Pass, Path};
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    let timed = |sizes| {
        let choices = CHOICES.lock().unwrap_or_else(|e| e.into_inner());
        choices.as_ref().map_or(0, |c| c.timed(sizes))
    };
    let kept = |pass, sizes| {
        let choices = CHOICES.lock().unwrap_or_else(|e| e.into_inner());
        choices.as_ref().and_then(|c| c.kept(pass, sizes))
    };
    // Shapes of their own (timings are counted shape by shape).
    for (b, t, heads, k, tune) in [
        (2, 41, 3, 16, true),
        (1, 66, 2, 32, true),
        (3, 23, 2, 8, false),
    ] {
        let mut policy = tuned(crate::AttentionTuning {
            products_anywhere: true,
            tune_min_scores: Some(0),
            ..Default::default()
        });
        policy.kernels = policy
            .kernels
            .with_strategy(crate::GpuStrategy::AttentionTune, tune);
        let d = heads * k;
        let (x, g) = (
            f16_exact([b, t, 3 * d], &device),
            f16_exact([b, t, d], &device),
        );
        let what = format!("tuned {tune}, {b}x{t}, {heads} heads of {k}");
        for _ in 0..2 {
            crate::gpu_kernels::with_policy(policy, || {
                op_equals_the_reference(&device, &x, &g, heads, &what)
            });
        }
        let sizes = [b, t, heads, k];
        let both = vec![Path::Products, Path::Fused];
        for pass in [Pass::Forward, Pass::Backward] {
            match kept(pass, sizes) {
                Some((path, paths)) => {
                    assert!(tune, "{what}: {pass:?} timed with the strategy off");
                    assert_eq!(paths, both, "{what}: {pass:?}'s paths");
                    assert!(paths.contains(&path), "{what}: {pass:?} chose {path:?}");
                }
                None => assert!(!tune, "{what}: no choice kept for the {pass:?} pass"),
            }
        }
        // Two paths timed for each pass, once.
        let timings = timed(sizes);
        match tune {
            true => assert_eq!(timings, 4, "{what}"),
            false => assert_eq!(timings, 0, "{what}"),
        }
    }
}

/// While a graph is being recorded, a shape timed before takes the path kept for it (not the
/// first: the fused kernels here, kept because the products were made slow) and nothing is
/// timed; a shape not timed before takes the first path. (Said to be recording rather than
/// recording on the device: a recording there would take the launches of the tests running
/// beside this one.)
#[test]
fn a_recording_takes_the_path_kept_for_its_shape_on_wgpu() {
    use super::tune::{Call, Pass, Path, choose, choose_while, paths};
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    let _scope = PolicyScope::enter(tuned(crate::AttentionTuning {
        products_anywhere: true,
        tune_min_scores: Some(0),
        ..Default::default()
    }));
    // Shapes of their own (no other test times them).
    let call = |t: usize| {
        let qkv = cube_tensor(Tensor::<3>::zeros([3, t, 3 * 2 * 8], &device));
        let dims = Dims::of(&qkv, 2);
        let paths = paths(&qkv, &dims);
        assert_eq!(paths, [Path::Products, Path::Fused]);
        (qkv, dims, paths)
    };
    let (qkv, dims, both) = call(29);
    let slow_products = |path: Path| {
        if path == Path::Products {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let forward = |qkv, dims| Call::of(qkv, dims, 0.0, Pass::Forward);
    let kept = choose(forward(&qkv, &dims), both.clone(), slow_products);
    assert_eq!(kept, Path::Fused);
    let (new_qkv, new_dims, new_paths) = call(31);
    let not_timed = |path: Path| panic!("{path:?} timed in a recording");
    let recorded = choose_while(true, forward(&qkv, &dims), both, not_timed);
    let new = choose_while(true, forward(&new_qkv, &new_dims), new_paths, not_timed);
    assert_eq!((recorded, new), (Path::Fused, Path::Products));
}
