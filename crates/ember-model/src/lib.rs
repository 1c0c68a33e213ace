//! # ember-model
//!
//! The transformer exactly as the classic material teaches it, on [Burn](https://burn.dev)
//! 0.22: scaled dot-product attention with padding and causal masks, multi-head self- and
//! cross-attention with a KV cache, sinusoidal / learned / rotary positions, pre- or
//! post-norm encoder and decoder blocks, a GPT-style [`DecoderOnly`] language model and an
//! [`EncoderDecoder`] translation model.
//!
//! Shape letters used everywhere: `B` batch, `T` target length, `S` source (key) length,
//! `D` model width, `H` heads, `K` head size, `F` MLP width, `V` vocabulary.
//!
//! ```
//! use burn::tensor::{Device, Int, Tensor};
//! use ember_model::DecoderOnlyConfig;
//!
//! let device = Device::flex();
//! let config = DecoderOnlyConfig { vocab_size: 65, n_layers: 2, d_model: 64, ..Default::default() };
//! let model = config.init(&device).expect("a valid config");
//! let tokens = Tensor::<2, Int>::from_ints([[1, 2, 3]], &device);
//! let logits = model.forward(tokens); // [1, 3, 65]
//! assert_eq!(logits.dims(), [1, 3, 65]);
//! ```

pub mod activation;
pub mod attention;
pub mod attention_kernel;
mod block_config;
#[cfg(feature = "flex")]
mod decode_attention;
pub mod decoder_block;
pub mod decoder_only;
pub mod decoder_only_config;
pub mod encoder_block;
pub mod encoder_decoder;
pub mod encoder_decoder_config;
pub mod error;
#[cfg(feature = "flex")]
mod flex_attention;
#[cfg(feature = "flex")]
mod flex_layer_norm;
#[cfg(feature = "flex")]
mod flex_matmul;
#[cfg(feature = "flex")]
mod flex_rotary;
#[cfg(feature = "flex")]
mod flex_softmax;
#[cfg(feature = "flex")]
pub mod flex_tensor;
pub mod gelu_kernel;
#[cfg(all(test, feature = "flex"))]
mod kernel_check;
pub mod kv_cache;
pub mod layer_norm;
pub mod layer_norm_kernel;
pub mod linear;
pub mod loss;
pub mod mlp;
pub mod multi_head_attention;
pub mod positional;
pub mod residual;
pub mod softmax_kernel;
pub mod summary;
#[cfg(feature = "flex")]
pub mod threads;
mod vector_math;

pub use attention::{AttentionOutput, scaled_dot_product_attention};
pub use block_config::BlockConfig;
pub use decoder_block::{BlockWeights, DecoderBlock, Memory};
pub use decoder_only::{DecoderOnly, DecoderOutput};
pub use decoder_only_config::DecoderOnlyConfig;
pub use encoder_block::EncoderBlock;
pub use encoder_decoder::EncoderDecoder;
pub use encoder_decoder_config::EncoderDecoderConfig;
pub use error::ConfigError;
pub use kv_cache::{DecoderCache, KvCache};
pub use mlp::{Activation, Mlp};
pub use multi_head_attention::{MultiHeadAttention, MultiHeadAttentionConfig};
pub use positional::{PositionInit, PositionalKind};

/// Whether ember's own flex kernels take `x` (a flex `f32` tensor, tracked by autodiff or not)
/// rather than Burn's operations; always false without the `flex` feature.
pub(crate) fn kernels_take<const D: usize>(x: &burn::tensor::Tensor<D>) -> bool {
    #[cfg(feature = "flex")]
    {
        flex_tensor::takes_kernels(x)
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = x;
        false
    }
}

/// The README's code, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
