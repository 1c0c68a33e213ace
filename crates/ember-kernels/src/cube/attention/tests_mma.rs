//! The tensor-core kernels' tests on Vulkan (`--features wgpu,vulkan`: SPIR-V, where CubeCL's
//! `cmma` becomes cooperative matrices). Mesa 26's lavapipe has cooperative matrices (8x8x8 f16
//! fragments on 256-bit vectors; Mesa 25.0's has none); `scripts/lavapipe-coopmat.sh` runs these
//! tests on one. A device without f16 fragments skips them with a line saying so, unless
//! `EMBER_REQUIRE_MMA` is set (as that script sets it): then it fails.

use super::dims::Dims;
use super::mma::{MmaPlan, Operand, mma_agrees};
use super::tests::{cube_tensor, f16_exact};
use super::*;
use burn::tensor::{Device, DeviceKind, FloatDType};
use burn_cubecl::tensor::CubeTensor;

/// The first plan that applies to a call.
fn first_plan(dims: &Dims, like: &CubeTensor, dtype: DType) -> Option<MmaPlan> {
    MmaPlan::all_that_apply(dims, like, dtype).first().copied()
}

/// The Vulkan device, and whether it has a plan in f16 for heads of `k` (`false`: skip).
fn device_with_fragments(k: usize) -> (Device, bool) {
    let device = Device::vulkan(DeviceKind::DefaultDevice);
    let qkv = Tensor::<3>::zeros([1, 1, 3 * k], &device);
    let qkv = cube_tensor(qkv.cast(FloatDType::F16));
    let plans = MmaPlan::all_for_device(qkv.client.properties(), k, Operand::F16);
    if plans.is_empty() {
        let required = std::env::var_os("EMBER_REQUIRE_MMA").is_some();
        assert!(
            !required,
            "EMBER_REQUIRE_MMA is set but this Vulkan device has no f16 matrix fragments \
             for heads of {k} (Mesa 26's lavapipe has them)"
        );
        eprintln!("no f16 matrix fragments on this Vulkan device: tensor-core tests skipped");
    }
    (device, !plans.is_empty())
}

/// Mixed precision's f16 projection through the op under autodiff, on the tensor cores:
/// output and projection gradient near the reference's in f32 on the same values with the
/// same dropout mask (the kernels round the weights and the score gradients to f16 and sum
/// in f32): one position, a block's rows, blocks ending inside a tile, several heads and
/// sequences, heads of 8 to 64, with dropout and without; with one unit per row (lavapipe's
/// planes of 8 over fragments of 8 rows) and with 2 (as on CUDA: partial maxima and sums;
/// here also planes that take no part in the products). With `attention-mma` off the same
/// calls take the fused kernels, and the two agree.
#[test]
fn tensor_core_kernels_stay_near_the_reference() {
    let (device, run) = device_with_fragments(64);
    if !run {
        return;
    }
    let plain = device.clone();
    let device = device.autodiff();
    for (b, t, heads, k, p) in [
        (1, 1, 1, 8, 0.0),
        (2, 16, 2, 16, 0.0),
        (1, 45, 3, 8, 0.25),
        (2, 70, 2, 32, 0.0),
        (1, 100, 1, 64, 0.25),
        (3, 33, 2, 64, 0.0),
    ] {
        let what = format!("tensor cores, dropout {p}, {b}x{t}, {heads} heads of {k}");
        let d = heads * k;
        let (x, g) = (
            f16_exact([b, t, 3 * d], &device),
            f16_exact([b, t, d], &device),
        );
        let seed = 0.375_f32;
        let factors = crate::cube::hashed_mask::host_factors(seed, p, b * heads * t * t);
        let leaf = |data| Tensor::<3>::from_data(data, &device).require_grad();
        let weights = Tensor::<3>::from_data(g, &device);
        let loss = |y: Tensor<3>| (y * weights.clone()).sum();
        let wide_in = leaf(x.clone());
        let wide = crate::attention::masked_reference(wide_in.clone(), heads, &factors);
        let reference_grad = wide_in.grad(&loss(wide.clone()).backward()).unwrap();
        let near = |a: Tensor<3>, r: Tensor<3>, part: &str, path: &str| {
            let scale = r.clone().abs().max().into_scalar::<f32>();
            let diff = (a - r).abs().max().into_scalar::<f32>();
            assert!(
                diff < 5e-3 * scale,
                "{what} ({path}): {part} off by {diff} (scale {scale})"
            );
        };
        for (path, mma, row_units) in [
            ("tensor cores", true, None),
            ("tensor cores, 2 units per row", true, Some(2)),
            ("fused kernels", false, None),
        ] {
            let kernels =
                crate::GpuKernels::default().with_strategy(crate::GpuStrategy::AttentionMma, mma);
            let mut policy = crate::GpuPolicy {
                kernels,
                ..Default::default()
            };
            policy.attention.mma_row_units = row_units;
            let (out, grad) = crate::gpu_kernels::with_policy(policy, || {
                let like = Tensor::<3>::zeros([b, t, 3 * d], &plain).cast(FloatDType::F16);
                let like = cube_tensor(like);
                let plan = first_plan(&Dims::of(&like, heads), &like, DType::F16);
                assert_eq!(plan.is_some(), mma, "{what} ({path}): {plan:?}");
                let narrow_in = leaf(x.clone());
                let narrow = seeded(
                    narrow_in.clone().cast(FloatDType::F16),
                    heads,
                    p as f64,
                    |on| Tensor::<1>::from_floats([seed], on),
                )
                .unwrap_or_else(|_| panic!("{what}: the kernels take an f16 projection"));
                assert_eq!(narrow.dtype(), DType::F16, "{what}");
                let narrow = narrow.cast(FloatDType::F32);
                let grad = narrow_in.grad(&loss(narrow.clone()).backward()).unwrap();
                (narrow.inner(), grad)
            });
            near(out, wide.clone().inner(), "output", path);
            near(grad, reference_grad.clone(), "gradient", path);
        }
    }
}

/// The operand type follows the projection: an `f32` projection on a Vulkan device (no TF32
/// fragments) never runs its attention in f16, and the strategy off leaves every type to
/// the fused kernels.
#[test]
fn an_f32_projection_never_takes_f16_fragments() {
    let (device, run) = device_with_fragments(64);
    if !run {
        return;
    }
    let qkv = cube_tensor(Tensor::<3>::zeros([2, 70, 3 * 64], &device));
    let dims = Dims::of(&qkv, 1);
    assert_eq!(first_plan(&dims, &qkv, DType::F32), None);
    assert!(first_plan(&dims, &qkv, DType::F16).is_some());
    let off = crate::GpuPolicy {
        kernels: crate::GpuKernels::default()
            .with_strategy(crate::GpuStrategy::AttentionMma, false),
        ..Default::default()
    };
    crate::gpu_kernels::with_policy(off, || {
        assert_eq!(first_plan(&dims, &qkv, DType::F16), None);
    });
}

/// The start-up check that guards the tensor-core kernels on a device agrees on this one, in
/// f16; with `f32` values there are no fragments to check (no TF32 on Vulkan) and it says so.
#[test]
fn the_start_up_check_agrees_in_f16() {
    let (device, run) = device_with_fragments(32);
    if !run {
        return;
    }
    let narrow = cube_tensor(Tensor::<3>::zeros([1, 1, 96], &device).cast(FloatDType::F16));
    mma_agrees(&narrow, Operand::F16, 32).unwrap();
    let wide = cube_tensor(Tensor::<3>::zeros([1, 1, 96], &device));
    let refused = mma_agrees(&wide, Operand::Tf32, 32).unwrap_err();
    assert!(refused.contains("no Tf32 fragments"), "{refused}");
}

/// On an f16 projection, the tensor-core kernels, the batched products (Burn's on Vulkan) and
/// the fused kernels, forward pass on one and backward pass on another (as `attention-tune`
/// may choose them): output, log-sum-exps and gradient within 1% of the largest value of the
/// fused kernels' (each path rounds the weights to f16 at another point).
#[test]
fn tensor_core_passes_pair_with_the_other_paths() {
    let (device, run) = device_with_fragments(32);
    if !run {
        return;
    }
    let mut policy = crate::GpuPolicy::default();
    policy.attention.products_anywhere = true;
    let cases = [(2, 45, 2, 32, 0.25), (1, 70, 1, 64, 0.0)];
    let seen = super::tests::every_pair_of_paths_agrees(&device, DType::F16, &cases, 1e-2, policy);
    assert!(
        seen.iter().any(|p| matches!(p, super::tune::Path::Mma(_))),
        "no tensor-core path: {seen:?}"
    );
}
