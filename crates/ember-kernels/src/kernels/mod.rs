//! The loops under ember's CPU kernels, over plain `f32` slices: no tensor type, no backend.
//! Each is compiled for AVX-512, AVX2 with FMA, or the baseline, chosen at run time.

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod dropout;
pub mod few_rows;
pub mod gelu;
pub mod layer_norm;
pub mod softmax;
pub(crate) mod vector_math;
