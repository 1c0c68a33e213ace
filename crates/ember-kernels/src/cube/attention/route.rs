//! Whether a training pass runs as batched products (`cube::attention_products`: cuBLAS on
//! CUDA) or as the fused kernels, and the products' start-up check against the fused kernels.

use super::dims::{float_cast_to, wide};
use super::launch::{fused_backward, fused_forward};
use burn::backend::TensorMetadata;
use burn::tensor::DType;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

/// `pass` (one of the attention's passes as batched products) run on CubeCL's device thread
/// ([`crate::cube::on_device_thread`]): its cuBLAS calls and kernel launches are then enqueued there
/// in order, where each cuBLAS call from another thread is a blocking round trip of its own (42
/// a layer for the two passes, against 2).
pub(super) fn on_device_thread<R: Send + 'static>(
    client: &burn_cubecl::cubecl::client::Client,
    pass: impl FnOnce() -> R + Send,
) -> R {
    crate::cube::on_device_thread(client, pass)
        .unwrap_or_else(|| panic!("attention products failed on the device thread"))
}

/// Whether the training attention runs as batched products ([`crate::cube::attention_products`]):
/// `attention-products` and `cublas` on, `qkv` on a CUDA device whose cuBLAS loads, no graph being recorded that leaves libraries out,
/// and the products found to agree with the fused kernels there ([`products_agree`], once).
pub(super) fn by_products(qkv: &CubeTensor) -> bool {
    if crate::gpu_kernels::policy().attention.products_anywhere {
        return true;
    }
    #[cfg(feature = "cublas")]
    {
        use crate::gpu_kernels::applies;
        applies(crate::GpuStrategy::AttentionProducts)
            && applies(crate::GpuStrategy::Cublas)
            && matches!(qkv.device, burn_cubecl::CubeDevice::Cuda(_))
            && crate::products::cublas::loadable()
            && !crate::recording::leaves_libraries_out(qkv.client.is_capturing())
            && products_agree_on(qkv)
    }
    #[cfg(not(feature = "cublas"))]
    {
        let _ = qkv;
        false
    }
}

/// Whether [`products_agree`] on `like`'s device, checked on the first call in the process (a
/// few small launches), so that a wrong call never trains a model: where they do not agree, says
/// so once on stderr, and the fused kernels run.
#[cfg(feature = "cublas")]
pub(super) fn products_agree_on(like: &CubeTensor) -> bool {
    // Once for each float type: f32, bf16, f16.
    static AGREES: [std::sync::OnceLock<bool>; 3] = [const { std::sync::OnceLock::new() }; 3];
    let slot = match like.dtype() {
        DType::F32 => 0,
        DType::BF16 => 1,
        _ => 2,
    };
    *AGREES[slot].get_or_init(|| match products_agree(like) {
        Ok(()) => true,
        Err(why) => {
            eprintln!(
                "warning: the attention as cuBLAS's batched products disagrees with ember's fused \
                 kernels on this device ({why}); the attention runs on the fused kernels"
            );
            false
        }
    })
}

/// The attention as batched products against the fused kernels on `like`'s device, in
/// `like`'s float type ([`agrees_with_fused`]), in blocks of 16 query rows with `causal-blocks`
/// on (the last one of 13).
#[cfg_attr(not(feature = "cublas"), allow(dead_code))] // run by CUDA builds and tests
pub(crate) fn products_agree(like: &CubeTensor) -> Result<(), String> {
    agrees_with_fused(
        like,
        like.dtype(),
        [45, 32],
        1.0,
        |qkv, seed, grad, heads, dropout| {
            let mut policy = crate::gpu_kernels::policy();
            policy.attention.block_rows = Some(16);
            crate::gpu_kernels::with_policy(policy, || {
                use crate::cube::attention_products::{backward, forward};
                let (out, lse) = forward(qkv, seed, heads, dropout);
                let dqkv = backward(qkv, seed, &lse, grad, heads, dropout);
                (out, lse, dqkv)
            })
        },
    )
}

/// One path's passes against the fused kernels on `like`'s device, in float type `dtype`:
/// `passes(qkv, seed, grad, heads, dropout)` gives the output, log-sum-exps and the
/// projection's gradient of 3 sequences of `t` positions, 2 heads of `head`, with dropout
/// (inputs spread over `spread` times `-0.5..0.5`; wider spreads the scores, so that a row's
/// maximum moves from tile to tile), within 1% of the largest value in f32 (TF32 products
/// round to 11 bits), 2% in bf16 or f16 (weights and outputs rounded to 8 or 11 bits, about
/// 0.05% of the largest value in f16 on lavapipe; the fused kernels compute from the same
/// rounded values in f32); a wrong matrix or dropout mask is off by its whole size. The error
/// names the first value that differs, or the failure to read one.
pub(super) fn agrees_with_fused(
    like: &CubeTensor,
    dtype: DType,
    [t, head]: [usize; 2],
    spread: f32,
    passes: impl FnOnce(
        &CubeTensor,
        &CubeTensor,
        &CubeTensor,
        usize,
        f32,
    ) -> (CubeTensor, CubeTensor, CubeTensor),
) -> Result<(), String> {
    use burn::backend::ops::FloatTensorOps;
    use burn::tensor::TensorData;
    let (b, heads, k, dropout) = (3, 2, head, 0.25_f32);
    let d = heads * k;
    let tolerance = match dtype {
        DType::F32 => 0.01,
        _ => 0.02,
    };
    // Values of the check's type, and the same values in f32 for the fused kernels.
    let load = |n: usize, seed: usize, shape: Vec<usize>| {
        let values: Vec<f32> = (0..n)
            .map(|i| (((i * 7919 + seed) % 61) as f32 / 60.0 - 0.5) * spread)
            .collect();
        let x = CubeBackend::float_from_data(TensorData::new(values, shape), &like.device);
        let narrow = float_cast_to::<CubeBackend>(x, dtype);
        (narrow.clone(), wide::<CubeBackend>(narrow))
    };
    let (qkv, wide_qkv) = load(b * t * 3 * d, 1, vec![b, t, 3 * d]);
    let (grad, wide_grad) = load(b * t * d, 2, vec![b, t, d]);
    let seed = CubeBackend::float_from_data(TensorData::new(vec![0.375_f32], [1]), &like.device);
    let (out, lse, dqkv) = passes(&qkv, &seed, &grad, heads, dropout);
    let (fused_out, fused_lse) = fused_forward(wide_qkv.clone(), seed.clone(), heads, dropout);
    let fused_dqkv = fused_backward(
        wide_qkv,
        seed,
        fused_out.clone(),
        fused_lse.clone(),
        wide_grad,
        heads,
        dropout,
    );
    for (what, ours, fused) in [
        ("output", out, fused_out),
        ("log-sum-exp", lse, fused_lse),
        ("gradient", dqkv, fused_dqkv),
    ] {
        let read = |x: CubeTensor| {
            burn_cubecl::ops::into_data_sync(wide::<CubeBackend>(x))
                .try_to_vec::<f32>()
                .map_err(|e| format!("reading the {what} back: {e:?}"))
        };
        let (ours, fused) = (read(ours)?, read(fused)?);
        let scale = fused.iter().fold(1f32, |m, v| m.max(v.abs()));
        for (i, (p, q)) in ours.iter().zip(&fused).enumerate() {
            let close = (p - q).abs() <= tolerance * scale;
            // A NaN is never close.
            if !close {
                return Err(format!(
                    "{dtype:?} {what} value {i} is {p}, the fused kernels' {q}"
                ));
            }
        }
    }
    Ok(())
}
