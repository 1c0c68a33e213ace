//! The two models:
//!
//! - [`decoder_only`]: the GPT-style language model, configured by [`decoder_only_config`].
//! - [`encoder_decoder`]: the translation model of "Attention Is All You Need", configured by
//!   [`encoder_decoder_config`].

pub mod decoder_only;
pub mod decoder_only_config;
pub mod encoder_decoder;
pub mod encoder_decoder_config;

pub use decoder_only::{DecoderOnly, DecoderOutput};
pub use decoder_only_config::DecoderOnlyConfig;
pub use encoder_decoder::EncoderDecoder;
pub use encoder_decoder_config::EncoderDecoderConfig;
