//! The SiLU op, `x * sigmoid(x)` (LLaMA's gated MLP).
//!
//! Reference: Burn's `silu`, a sigmoid and a product (under autodiff each with its own backward
//! pass, its intermediate kept). Kernel (flex `f32` tensors): [`crate::kernels::gelu`]'s
//! vectorised loops, one pass each way, as the GELUs'. On GPU backends the reference runs.

use burn::tensor::Tensor;

/// SiLU, `x * sigmoid(x)`, element-wise.
///
/// # Shapes
/// - x: any
/// - output: same as x
///
/// A bf16 or f16 `x` is computed in `f32` and rounded once to its type.
pub fn silu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "flex")]
    let x = match super::flex::gelu::gelu::<super::kernels::gelu::Silu, D>(x) {
        Ok(y) => return y,
        Err(x) => x,
    };
    super::gelu::in_f32(x, silu, silu_reference)
}

/// [`silu`] in Burn's tensor ops, on every backend.
pub fn silu_reference<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    burn::tensor::activation::silu(x)
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use crate::check::agrees_on;
    use burn::tensor::{Device, Distribution};

    /// The op (ember's kernel on flex) against its reference, output and gradient, over
    /// negative and positive inputs (`agrees_on` feeds `e^x`; 3 less spans both signs).
    #[test]
    fn equals_its_reference() {
        let draw = |dims: [usize; 3]| {
            Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.5), &Device::flex()).into_data()
        };
        let (x, g) = (draw([3, 70, 129]), draw([3, 70, 129]));
        assert!(crate::kernels_take(&Tensor::<3>::from_data(
            x.clone(),
            &Device::flex()
        )));
        agrees_on(
            &Device::flex(),
            &x,
            &g,
            |x| silu(x.sub_scalar(3.0)),
            |x| silu_reference(x.sub_scalar(3.0)),
            2e-6,
            "SiLU",
        );
    }
}
