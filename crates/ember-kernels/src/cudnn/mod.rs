//! NVIDIA's cuDNN for the training attention on CUDA (feature `cudnn`): FlashAttention's
//! forward and backward passes on tensor cores, fused by cuDNN from an operation graph, for the
//! bf16 (or f16) projection of mixed precision.
//!
//! - [`graph`]: an operation graph as plain data;
//! - [`attention_graph`]: the attention's two graphs on ember's layouts, node for node what
//!   cudnn-frontend builds;
//! - `interpret` (tests): the graphs evaluated on the CPU against the attention's reference;
//! - `library` (feature `cudnn`): finding and loading cuDNN 9 at run time;
//! - `lowering` (feature `cudnn`): a graph as cuDNN's backend descriptors, its execution plan.
//!
//! The op that calls them, on CubeCL's CUDA buffers, is `cube::cudnn_attention`.

pub(crate) mod attention_graph;
pub(crate) mod graph;
#[cfg(feature = "cudnn")]
pub(crate) mod library;
#[cfg(feature = "cudnn")]
pub(crate) mod lowering;

#[cfg(test)]
mod interpret;
#[cfg(test)]
mod tests;
