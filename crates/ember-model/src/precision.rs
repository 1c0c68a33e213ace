//! Mixed precision: matrix products in a narrow float type (bf16), everything else in f32.
//!
//! The model keeps its parameters in `f32` (the master weights the optimizer updates).
//! [`products_in`] gives a view of it whose product matrices, the weights of every `Linear`
//! and every `Embedding` table (a token table is also the tied output head), are cast to the
//! narrow type. The casts are tracked by autodiff, so gradients flow back through them into
//! the `f32` parameters and arrive in `f32`. The ops then follow one rule
//! ([`crate::ops::affine`], [`crate::ops::matmul`], [`crate::ops::embed`]):
//!
//! - a product runs in its weight's type: the activation is rounded to it, and the result is
//!   widened back to the activation's type (bias added there);
//! - activations stay `f32`: embedding rows are widened when read, and so layer norms, softmax
//!   (attention and loss), the residual stream and the logits are all computed in `f32`;
//! - except the MLP's hidden layer ([`crate::ops::linear_gelu`]) and the fused attention's
//!   projection and output ([`crate::ops::linear_in_products`],
//!   [`crate::ops::causal_self_attention`]), which stay in the products' type: biases added
//!   there, the GELU and the attention computed in `f32` and rounded once (on CUDA, where the
//!   attention runs as cuBLAS's products, its weights and their gradient are rounded too before
//!   the products that read them, as FlashAttention rounds them). A training step keeps
//!   them for its backward pass; in bf16 that is half the bytes, and the values are the ones the
//!   next product rounded them to anyway.
//!
//! This is what PyTorch's autocast does for these layers (`torch.autocast(dtype=bfloat16)`:
//! linear layers in bf16, softmax, layer norm and cross-entropy in f32), made explicit: no global
//! state, the dtype of a weight says how its product is computed.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{FloatDType, Tensor};

/// `model` with the weights of its `Linear` layers and its `Embedding` tables cast to `dtype`
/// (biases, layer norms and every other parameter unchanged). Parameter ids are kept, so the
/// gradients of a loss computed with the view are found on `model`'s own parameters
/// (`GradientsParams::from_grads(loss.backward(), &model)`), in their own type. A backward pass
/// consumes the casts: build one view per forward pass.
pub fn products_in<M: Module>(model: M, dtype: FloatDType) -> M {
    // Parameters still waiting for their lazy initialisation are initialised now, all of them
    // in module order (as a forward pass would): mapping only some would initialise those
    // first, and the random draws of the others would come in another order.
    initialize(&model);
    model.map(&mut CastProducts {
        dtype,
        containers: Vec::new(),
    })
}

/// Initialises every lazy parameter of `model`, in module order (a forward pass initialises them
/// in the order it first reads them).
pub fn initialize<M: Module>(model: &M) {
    model.visit(&mut Initialize);
}

/// Touches every float parameter, which initialises a lazy one.
struct Initialize;

impl ModuleVisitor for Initialize {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let _ = param.val();
    }
}

/// Casts the rank-2 parameters found directly inside a `Linear` or an `Embedding`.
struct CastProducts {
    dtype: FloatDType,
    /// The container types entered, innermost last (`Struct:Linear`, `Vec`, ...).
    containers: Vec<String>,
}

impl ModuleMapper for CastProducts {
    fn enter_module(&mut self, _name: &str, container_type: &str) {
        self.containers.push(container_type.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.containers.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let in_product = matches!(
            self.containers.last().map(String::as_str),
            Some("Struct:Linear" | "Struct:Embedding")
        );
        if D == 2 && in_product {
            let dtype = self.dtype;
            // The cast, or the copy ember's AdamW kernel wrote as it updated the weight.
            param.map(|tensor| ember_kernels::weight_in(tensor, dtype))
        } else {
            param
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DecoderOnlyConfig, PositionalKind};
    use burn::optim::GradientsParams;
    use burn::tensor::{DType, Device, Int, TensorData};

    /// Every float parameter's dtype, in visiting order.
    struct Dtypes(Vec<(usize, DType)>);

    impl ModuleVisitor for Dtypes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push((D, param.val().dtype()));
        }
    }

    fn dtypes<M: Module>(model: &M) -> Vec<(usize, DType)> {
        let mut v = Dtypes(Vec::new());
        model.visit(&mut v);
        v.0
    }

    fn config(positional: PositionalKind, tie_weights: bool) -> DecoderOnlyConfig {
        DecoderOnlyConfig {
            vocab_size: 40,
            d_model: 32,
            n_heads: 4,
            n_layers: 2,
            context_len: 24,
            positional,
            tie_weights,
            ..DecoderOnlyConfig::default()
        }
    }

    fn tokens(device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let ids: Vec<i64> = (0..2 * 13).map(|i| (i * 7 + 3) % 40).collect();
        let all = Tensor::<1, Int>::from_data(TensorData::new(ids, [26]), device).reshape([2, 13]);
        (all.clone().slice([0..2, 0..12]), all.slice([0..2, 1..13]))
    }

    fn cosine(a: Tensor<1>, b: Tensor<1>) -> f32 {
        let dot = (a.clone() * b.clone()).sum().into_scalar::<f32>();
        let na = a.powi_scalar(2).sum().sqrt().into_scalar::<f32>();
        let nb = b.powi_scalar(2).sum().sqrt().into_scalar::<f32>();
        dot / (na * nb)
    }

    #[test]
    fn only_product_matrices_are_cast() {
        let device = Device::flex();
        for positional in [PositionalKind::Learned, PositionalKind::Sinusoidal] {
            let model = config(positional, true).init(&device).unwrap();
            let view = products_in(model.clone(), FloatDType::BF16);
            let (before, after) = (dtypes(&model), dtypes(&view));
            assert_eq!(before.len(), after.len());
            assert!(before.iter().all(|&(_, t)| t == DType::F32));
            for &(rank, dtype) in &after {
                let expected = if rank == 2 { DType::BF16 } else { DType::F32 };
                assert_eq!(dtype, expected, "a rank-{rank} parameter");
            }
            // Every matrix of this model is a linear weight or a table: some were cast.
            assert!(after.iter().any(|&(_, t)| t == DType::BF16));
        }
    }

    #[test]
    fn a_view_initialises_every_lazy_parameter_in_module_order() {
        // Mapping only the matrices would initialise them first and leave the biases for the
        // forward pass: the random draws would come in another order than without the view.
        struct Lazy(usize, usize);
        impl ModuleVisitor for Lazy {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0 += 1;
                self.1 += usize::from(!param.is_initialized());
            }
        }
        let model = config(PositionalKind::Learned, false)
            .init(&Device::flex())
            .unwrap();
        let mut before = Lazy(0, 0);
        model.visit(&mut before);
        assert!(before.1 > 0, "the model's parameters start lazy");
        let _view = products_in(model.clone(), FloatDType::BF16);
        let mut after = Lazy(0, 0);
        model.visit(&mut after);
        assert_eq!((after.0, after.1), (before.0, 0));
    }

    #[test]
    fn bf16_products_track_the_f32_model_and_train_its_f32_weights() {
        let device = Device::flex().autodiff();
        for tied in [true, false] {
            let model = config(PositionalKind::Learned, tied).init(&device).unwrap();
            let (x, y) = tokens(&device);
            let view = products_in(model.clone(), FloatDType::BF16);

            // Activations and logits stay f32, and differ from the f32 model's by bf16 rounding.
            let exact = model.forward(x.clone());
            let mixed = view.forward(x.clone());
            assert_eq!(mixed.dtype(), DType::F32);
            let scale = exact.clone().abs().max().into_scalar::<f32>();
            let diff = (exact - mixed).abs().max().into_scalar::<f32>();
            assert!(diff > 0.0, "the products were not computed in bf16");
            assert!(
                diff < 0.01 * scale,
                "logits differ by {diff} (scale {scale})"
            );

            // Gradients arrive on the f32 parameters, in f32, pointing where the f32 ones do.
            let exact =
                GradientsParams::from_grads(model.loss(x.clone(), y.clone()).backward(), &model);
            let mixed = GradientsParams::from_grads(view.loss(x, y).backward(), &model);
            let mut grads = Vec::new();
            struct Collect<'a>(
                &'a GradientsParams,
                &'a GradientsParams,
                &'a mut Vec<(Tensor<1>, Tensor<1>)>,
            );
            impl ModuleVisitor for Collect<'_> {
                fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                    let a = self.0.get::<D>(param.id).expect("an f32 gradient");
                    let b = self
                        .1
                        .get::<D>(param.id)
                        .expect("a gradient through the cast");
                    assert_eq!(b.dtype(), DType::F32);
                    self.2.push((a.flatten(0, D - 1), b.flatten(0, D - 1)));
                }
            }
            model.visit(&mut Collect(&exact, &mixed, &mut grads));
            assert_eq!(grads.len(), dtypes(&model).len());
            let (a, b): (Vec<_>, Vec<_>) = grads.into_iter().unzip();
            let c = cosine(Tensor::cat(a, 0), Tensor::cat(b, 0));
            assert!(c > 0.999, "tied {tied}: gradient cosine {c}");
        }
    }

    /// The MLP's hidden layer stays in the products' type: the bf16 product, its bias added in
    /// bf16, the GELU computed in f32 and rounded once (what PyTorch's autocast keeps); the
    /// projection back comes out in f32, near the f32 MLP's.
    #[test]
    fn the_mlp_hidden_layer_stays_in_the_products_type() {
        use crate::ops::{affine_reference, gelu_reference, linear_gelu};
        use crate::{Activation, Mlp};
        use burn::tensor::Distribution;
        let device = Device::flex();
        let mlp = Mlp::new(8, 32, Activation::Gelu, false, 0.0, true, 0.02, &device);
        let view = products_in(mlp.clone(), FloatDType::BF16);
        let x = Tensor::<3>::random([2, 3, 8], Distribution::Normal(0.0, 1.0), &device);
        let hidden = linear_gelu(&view.c_fc, x.clone(), false);
        assert_eq!(hidden.dtype(), DType::BF16);
        let bias = view.c_fc.bias.as_ref().expect("a bias").val();
        let product = affine_reference(
            x.clone().cast(FloatDType::BF16),
            view.c_fc.weight.val(),
            Some(bias.cast(FloatDType::BF16)),
        );
        let want = gelu_reference(product.cast(FloatDType::F32)).cast(FloatDType::BF16);
        hidden.into_data().assert_eq(&want.into_data(), true);
        let (exact, mixed) = (mlp.forward(x.clone()), view.forward(x));
        assert_eq!(mixed.dtype(), DType::F32);
        let scale = exact.clone().abs().max().into_scalar::<f32>();
        let diff = (exact - mixed).abs().max().into_scalar::<f32>();
        assert!(diff > 0.0 && diff < 0.02 * scale, "{diff} (scale {scale})");
    }
}
