//! Attention, as the lecture notes build it up:
//!
//! - [`scaled_dot_product`]: `softmax(Q K^T / sqrt(d_k)) V`, and its causal form.
//! - [`masks`]: the causal (look-ahead) mask and the padding mask.
//! - [`multi_head`]: `H` heads over one fused `[Q | K | V]` projection, merged and projected back.
//! - [`self_attention`]: masked (causal) self-attention, with positions `start..` when a KV
//!   cache holds the past.
//! - [`grouped`]: grouped-query attention, key/value heads shared by groups of query heads.
//! - [`cross_attention`]: encoder-decoder attention, queries from the decoder, keys and values
//!   from the encoder output.
//! - [`kv_cache`]: the keys and values of tokens already seen, for autoregressive decoding.

pub mod cross_attention;
pub mod grouped;
pub mod kv_cache;
pub mod masks;
pub mod multi_head;
pub mod scaled_dot_product;
pub mod self_attention;

pub use kv_cache::{DecoderCache, Keys, KvCache};
pub use masks::{MASKED_SCORE, causal_mask, combine_masks, padding_mask};
pub use multi_head::{AttentionResult, MultiHeadAttention, MultiHeadAttentionConfig};
pub use scaled_dot_product::{
    AttentionOutput, attend_keys, causal_attention, scaled_dot_product_attention,
};
