//! # ember-kernels
//!
//! ember's op layer: every computation that has a faster path than its plain tensor maths.
//! `ember-model` re-exports this crate as `ember_model::ops`; its concept files (`attention`,
//! `positions`, `blocks`, `models`) call these ops and nothing below them, and nothing here
//! reaches back into them (the maths an op needs lives here: [`masks`], [`rotation`]).
//!
//! Each op is a public function with a reference implementation beside it (`*_reference`, Burn
//! tensor ops, on every backend), and kernels that take over where they apply: ember's flex CPU
//! kernels, on `f32` flex tensors with or without autodiff, and (features `wgpu`, `vulkan`,
//! `cuda`) its GPU kernels on Burn's CubeCL backends, with or without fusion and autodiff
//! (`cube`; the environment variable `EMBER_GPU_KERNELS` turns them off, all or some:
//! [`gpu_kernels`]); on CUDA, cuBLAS's products (`cublas`) and cuDNN's attention (`cudnn`,
//! opt-in), both loaded at run time.
//!
//! | op | reference | kernel (flex) |
//! |---|---|---|
//! | [`linear`], [`affine`], [`matmul`] | Burn's `module::linear`, `matmul` | `gemm` into a new buffer, own backward (`products::flex`); on CUDA cuBLAS's products (forward and backward, transposed operands read in place: `products::cube`, `products::cublas`, [`blas`]); on other GPUs all rows as one product in Burn's `matmul` (in training, chunks of rows as one batched product, so that the weight's gradient is a sum of partial products: [`matmul_split_rows`]), and a plain input of up to eight rows (a decoding step) takes one kernel for the product and the bias (`cube::linear`) |
//! | [`linear_gelu`] | Burn's `module::linear`, then `gelu` | [`linear`] then [`gelu`]; on GPUs a plain input of up to eight rows takes one kernel for the product, the bias and the GELU (`cube::linear`) |
//! | [`gelu`], [`gelu_tanh`] | Burn's `gelu`, `gelu_approximate` | vectorised loops ([`kernels::gelu`]); on GPUs one kernel each way, the exact derivative (`cube::gelu`) |
//! | [`silu`], [`gated_silu`] | Burn's `silu`; for the gate two slices, `silu`, a product | the GELUs' vectorised loops ([`kernels::gelu`]; the gate in one pass each way, `flex::gated`); on GPUs the gate one kernel each way (`cube::gated`), SiLU alone the reference |
//! | [`layer_norm`] | Burn's `LayerNorm::forward` | one pass each way ([`kernels::layer_norm`]); on GPUs one kernel each way, one cube per row, the bias in the same pass (`cube::layer_norm`) |
//! | [`rms_norm`] | RMSNorm in Burn's tensor ops | LayerNorm's pass without the centring ([`kernels::layer_norm`]); on GPUs LayerNorm's kernels likewise (`cube::layer_norm`) |
//! | [`causal_softmax`] | scale, mask, softmax | one pass each way ([`kernels::softmax`]) |
//! | [`causal_self_attention`] | split heads, causal attention, merge | one task per sequence and head (`flex::attention`), from 256 positions in blocks of 64 query rows over the keys they see, the weights recomputed in the backward pass instead of kept (`flex::attention_blocks`); on GPUs one unit per query row, keys and values tiled through shared memory, online softmax, dropout inside, FlashAttention-2 backward (`cube::attention`); on CUDA with cuBLAS, cuBLAS's batched products over one head's stored scores and small kernels between them (`cube::attention_products`) |
//! | [`rotate_qk`] | split, [`crate::rotation::apply_rotary`], merge | in place on the fused projection (`flex::rotary`); [`rotate_qk_by`] (a replayed decoding step's rows of `cos`/`sin` tables) is its reference alone |
//! | [`cached_causal_attention`] | scores, mask by position, softmax, values | none on flex; on GPUs one cube per query row over the cache's whole buffer (`cube::attention`) |
//! | [`write_cache_rows`] (a decoding step's keys and values into the KV cache) | two `slice_assign`s | none on flex; on GPUs one kernel writes both buffers, in place where they are not shared (`cube::cache_write`) |
//! | [`single_query_attention`] | softmax of one row, times `V` | loops over the cache in place ([`kernels::attention`]) |
//! | [`dropout`] | Burn's `Dropout::forward` | none on flex; on GPUs one kernel each way, a hashed mask recomputed from a seed, nothing stored (`cube::dropout`) |
//! | [`sum_of_squares`] (a gradient norm, squared, over all of a step's gradients), [`global_norm`] (the norm and clipping's factor) | `sum(x^2)` of each tensor, added up (then the root and the factor's ops) | none on flex; on GPUs one launch per 8 tensors, cubes striding over each in turn and reducing in shared memory, then one cube adding their sums (and writing the norm and the factor) (`cube::sum_of_squares`) |
//! | [`cross_entropy`] (a training step's loss) | `log_softmax`, `gather`, the padding mask, the mean | none on flex; on GPUs a cube per row for its log-sum-exp and loss, one cube for the mean, one launch backward from the kept log-sum-exps (`cube::cross_entropy`) |
//! | [`embed`] | Burn's `Embedding::forward` | none on flex; on GPUs, for a tracked table of a small vocabulary (a bf16 one widened to `f32` first), the table's gradient with one unit per table element (`cube::embedding`) |
//! | [`draw`] (a token drawn from `softmax(logits / temperature)` by a uniform number, when decoding) | max, `exp`, `cumsum`, the count at or below `u`, the argmax past them all | none on flex (it samples on the host); on GPUs one kernel, a cube per row: chunk sums, then one unit walks to the token (`cube::draw`) |
//! | [`cached_causal_attention_at`], [`write_cache_rows_at`], [`draw_at`] (a decoding step's position or uniform number read from a device tensor, so that one captured step replays at every position) | the position or number read back to the host, then the op above | none on flex; on GPUs the kernels above, reading it on the device |
//! | [`write_token`] (a decoding step's chosen token into the window's token buffer, at a position read on the device) | the position read back, `slice_assign` | none on flex; on GPUs one unit, in place where the buffer is not shared (`cube::step_inputs`) |
//! | [`write_in_place`] (the host's new position and number for the next replay) | none: false where tensors cannot be written in place | on GPUs (without fusion) a copy into the tensor's own memory (`cube::step_inputs`) |
//! | [`adamw_step`] (one optimizer step of one parameter) | [`adamw_step_reference`]: Burn's `AdamW` expressions | one loop in place ([`kernels::adamw`]); on GPUs one kernel per parameter, the clipping factor applied as the gradient is read (`cube::adamw`) |
//!
//! Mixed precision (`ember_model::precision`): [`affine`] and [`matmul`] compute in their weight's
//! float type when it differs from the activation's, and [`embed`] reads tables into `f32`.
//!
//! Layout: [`kernels`] holds the backend-free loops over `f32` slices; [`flex`] (feature
//! `flex`) reaches flex tensors' buffers, wraps the loops as autodiff ops through one helper
//! (`flex::op`), and checks each against its reference (output and gradients).
//! [`kernels_take`] answers "does a CPU kernel take this tensor" (flex `f32`); the GPU kernels
//! ask `cube::gpu_kernel_takes` (a CubeCL tensor of their type, the kernel switched on).
//! [`cast_to`] is the one float cast of tensors (`cube` casts backend primitives with
//! `float_cast_to`).
//!
//! With the `cublas` or `cudnn` feature, a project that depends on this crate needs ember's
//! copy of cubecl-cuda (its CUDA buffers' streams public): `vendor/cubecl-cuda` and the
//! `[patch.crates-io]` entry of ember's workspace `Cargo.toml` (vendor/README.md).
//!
//! A kernel that does not take its input hands it back as `Err` for the reference path. A
//! `Tensor` is a few hundred bytes, the `Ok` side as large as the `Err` side, so boxing it (as
//! clippy's `result_large_err` suggests) would only add an allocation per call.
#![allow(clippy::result_large_err)]

pub mod adamw;
mod attention;
mod cache_write;
mod cross_entropy;
mod draw;
mod dropout;
mod embedding;
pub mod external_launches;
mod gelu;
pub mod gpu_kernels;
mod layer_norm;
mod log_softmax;
pub mod masks;
mod products;
pub mod recording;
/// BLAS's column-major calls for row-major tensors (cuBLAS's products).
pub use products::blas;
mod rotary;
pub mod rotation;
mod silu;
mod softmax;
mod step_inputs;
mod sum_of_squares;

/// Test helpers (one of ember's kernels against the same computation in Burn's ops), public
/// for the model crate's tests.
#[doc(hidden)]
pub mod check;
#[cfg(feature = "cube")]
pub(crate) mod cube;
#[cfg(any(test, feature = "cudnn"))]
pub(crate) mod cudnn;
#[cfg(feature = "flex")]
pub mod flex;
pub mod kernels;
/// Where NVIDIA's run-time libraries may lie (cuDNN, NCCL).
#[cfg(any(feature = "cudnn", feature = "nccl"))]
mod libraries;
/// NCCL's collectives across processes on CUDA devices (data-parallel training's gradients).
#[cfg(feature = "nccl")]
pub mod nccl;

pub use adamw::{AdamWGroups, AdamWStep, adamw_step, adamw_step_reference};
pub use attention::{
    cached_causal_attention, cached_causal_attention_at, cached_causal_attention_reference,
    causal_self_attention, causal_self_attention_reference, fused_causal_self_attention, repeat_kv,
    single_query_attention, single_query_attention_reference,
};
pub use cache_write::{write_cache_rows, write_cache_rows_at, write_cache_rows_reference};
pub use cross_entropy::{cross_entropy, cross_entropy_reference};
pub use draw::{MIN_TEMPERATURE, draw, draw_at, draw_reference};
pub use dropout::{add_dropout, dropout, dropout_reference};
pub use embedding::{embed, embed_range, embed_reference};
pub use gelu::{gelu, gelu_reference, gelu_tanh, gelu_tanh_reference};
pub use gpu_kernels::{AttentionTuning, GpuKernel, GpuKernels, GpuPolicy, GpuStrategy};
pub use layer_norm::{layer_norm, layer_norm_reference, rms_norm, rms_norm_reference};
pub use log_softmax::{log_softmax, log_softmax_reference};
pub use products::{
    affine, affine_reference, linear, linear_gelu, linear_gelu_reference, linear_in_products,
    linear_into, matmul, matmul_reference, matmul_split_rows, weight_gradient_splits,
};
pub use recording::LibraryCallsRecorded;
pub use rotary::{
    RotaryAt, rotate_qk, rotate_qk_at, rotate_qk_by, rotate_qk_reference, rotate_qk_rows,
};
pub use silu::{gated_silu, gated_silu_reference, silu, silu_reference};
pub use softmax::{causal_softmax, causal_softmax_reference};
pub use step_inputs::{write_in_place, write_token, write_token_reference};
pub use sum_of_squares::{
    global_norm, global_norm_reference, sum_of_squares, sum_of_squares_reference,
};

use burn::tensor::Tensor;

/// Whether `device` runs on Burn's CubeCL backends (wgpu, vulkan, cuda, with or without fusion):
/// the ones that compile a kernel per shape and whose kernels CubeCL's launch observer sees.
pub fn on_cubecl(device: &burn::tensor::Device) -> bool {
    use burn::backend::{Backend, Dispatch};
    Dispatch::name(device.as_dispatch()).contains("cubecl<")
}

/// Seeds `device`'s random numbers (Burn's `Device::seed`) and starts ember's dropout seeds
/// afresh from them (on CubeCL devices they are drawn many at a time: `cube::hashed_mask`), so
/// that the dropout masks after it depend on `seed` alone. What a training step seeds its
/// micro-batches with.
pub fn seed_random(device: &burn::tensor::Device, seed: u64) {
    device.seed(seed);
    #[cfg(feature = "cube")]
    cube::hashed_mask::forget_pools();
}

/// `x` in the float type `dtype`: itself when it is already (mixed precision moves tensors
/// between f32 and the products' type at the edges of the ops that keep them narrow).
pub fn cast_to<const D: usize>(x: Tensor<D>, dtype: burn::tensor::DType) -> Tensor<D> {
    match x.dtype() == dtype {
        true => x,
        false => x.cast(burn::tensor::FloatDType::from(dtype)),
    }
}

/// A model's `f32` weight `w` in the float type `dtype` for its products (mixed precision's
/// view of a linear layer or an embedding table), tracked by autodiff as a cast is (its
/// gradient arrives in `f32`). On CubeCL devices (`weight-copies` on) the copy ember's AdamW
/// kernel wrote when it last updated `w`, or a cast kept for it to update: a forward pass then
/// casts no weight (`cube::weight_copies`); elsewhere a cast.
pub fn weight_in<const D: usize>(w: Tensor<D>, dtype: burn::tensor::FloatDType) -> Tensor<D> {
    #[cfg(feature = "cube")]
    let w = match cube::weight_copies::weight_in(w, burn::tensor::DType::from(dtype)) {
        Ok(copy) => return copy,
        Err(w) => w,
    };
    w.cast(dtype)
}

/// Drops the weights' copies [`weight_in`] keeps (each holds a weight's buffer and its copy's
/// until the weight is replaced): for a process that is done training a model and goes on.
pub fn forget_weight_copies() {
    #[cfg(feature = "cube")]
    cube::weight_copies::forget();
}

/// The position a decoding step reads from the device (`[1]`), on the host: what the reference
/// implementations of the `*_at` ops take. A read waits for the device, so GPU kernels read the
/// position where it is instead.
pub(crate) fn read_position(position: &Tensor<1, burn::tensor::Int>) -> usize {
    let value = position.clone().into_scalar::<i64>();
    usize::try_from(value).expect("a decoding position is not negative")
}

/// Whether ember's kernels take `x` (a flex `f32` tensor, tracked by autodiff or not) rather
/// than the reference implementations; always false without the `flex` feature.
pub fn kernels_take<const D: usize>(x: &Tensor<D>) -> bool {
    #[cfg(feature = "flex")]
    {
        flex::tensor::is_flex_f32(x)
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = x;
        false
    }
}
