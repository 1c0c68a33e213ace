//! The blocks a transformer stacks:
//!
//! - [`mlp`]: the position-wise feed-forward network.
//! - [`norm`]: LayerNorm or RMSNorm.
//! - [`residual`]: a residual connection with its norm before (pre-norm) or after (post-norm).
//! - [`encoder_block`]: self-attention over the whole source, then the MLP.
//! - [`decoder_block`]: masked self-attention, attention over the encoder output, then the MLP.
//! - [`config`]: the settings both blocks share.

pub mod config;
pub mod decoder_block;
pub mod encoder_block;
pub mod mlp;
pub mod norm;
pub mod residual;

pub use config::BlockConfig;
pub use decoder_block::{BlockWeights, DecoderBlock, Memory};
pub use encoder_block::EncoderBlock;
pub use mlp::{Activation, Mlp};
pub use norm::NormKind;
