//! # ember-model
//!
//! The transformer exactly as the classic material teaches it, on [Burn](https://burn.dev)
//! 0.22: scaled dot-product attention with padding and causal masks, multi-head self- and
//! cross-attention with a KV cache, sinusoidal / learned / rotary positions, pre- or
//! post-norm encoder and decoder blocks, a GPT-style [`DecoderOnly`] language model and an
//! [`EncoderDecoder`] translation model; and the parts later decoders changed (LLaMA's RMSNorm,
//! gated MLP and grouped-query attention; GPT-NeoX's partial rotation and parallel blocks),
//! each a config field of [`DecoderOnlyConfig`].
//!
//! Shape letters used everywhere: `B` batch, `T` target length, `S` source (key) length,
//! `D` model width, `H` heads, `K` head size, `F` MLP width, `V` vocabulary.
//!
//! Repeatable training: seed with [`ops::seed_random`] (Burn's `Device::seed`, and on GPUs the
//! dropout seeds ember draws many at a time started afresh), before each forward pass whose
//! dropout masks should depend on the seed alone.
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

pub mod attention;
pub mod blocks;
pub mod error;
pub mod loss;
pub mod models;
pub mod positions;
pub mod precision;
pub mod summary;

/// The op layer (the `ember-kernels` crate): each op's public function with its reference,
/// and the kernels behind it.
pub use ember_kernels as ops;

pub use attention::{
    AttentionOutput, DecoderCache, KvCache, MultiHeadAttention, MultiHeadAttentionConfig,
    scaled_dot_product_attention,
};
pub use blocks::{
    Activation, BlockConfig, BlockWeights, DecoderBlock, EncoderBlock, Memory, Mlp, NormKind,
};
pub use error::ConfigError;
pub use models::{
    DecoderOnly, DecoderOnlyConfig, DecoderOutput, EncoderDecoder, EncoderDecoderConfig,
};
pub use positions::{PositionInit, PositionalKind, Rope, RopeScaling};

/// The README's code, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
