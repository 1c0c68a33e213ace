//! AdamW with weight decay on weight matrices only, and clipping of the *global* gradient norm
//! (Burn's own clipping is per tensor; nanoGPT and PyTorch clip the norm of all gradients).

use burn::module::{Module, ModuleVisitor, Param, ParamGroup, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;
use ember_kernels::global_norm;

use crate::adamw::{FusedAdamW, GradScale};
use crate::config::TrainingConfig;

/// Collects the ids of parameters with fewer than two axes: biases, LayerNorm scales.
struct VectorParams(Vec<ParamId>);

impl ModuleVisitor for VectorParams {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if D < 2 {
            self.0.push(param.id);
        }
    }
}

/// AdamW as the config says; biases and norm parameters get no weight decay (as in GPT-2 and
/// nanoGPT), weight matrices and embeddings do.
pub fn adamw<M: Module>(config: &TrainingConfig, model: &M) -> ModuleOptimizer {
    adamw_scaled(config, model, &GradScale::default())
}

/// [`adamw`] whose gradients are multiplied by `grad_scale`'s factor whenever one is set (the
/// trainer's clipping: [`clip_factor`]).
pub fn adamw_scaled<M: Module>(
    config: &TrainingConfig,
    model: &M,
    grad_scale: &GradScale,
) -> ModuleOptimizer {
    let adam = |weight_decay: f64| {
        FusedAdamW::new(
            config.beta1 as f32,
            config.beta2 as f32,
            config.eps as f32,
            weight_decay as f32,
        )
        .with_grad_scale(grad_scale.clone())
    };
    let mut vectors = VectorParams(Vec::new());
    model.visit(&mut vectors);
    ModuleOptimizer::from(adam(config.weight_decay)).with_group(
        ParamGroup::from_ids(vectors.0),
        adam(0.0),
        None,
    )
}

/// Collects every gradient of `model`'s parameters, flattened, in the model's order.
struct Gradients<'a> {
    grads: &'a GradientsParams,
    flat: Vec<Tensor<1>>,
}

impl ModuleVisitor for Gradients<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(grad) = self.grads.get::<D>(param.id) {
            self.flat.push(grad.reshape([-1]));
        }
    }
}

/// Multiplies every gradient by a `[1]` factor.
struct Scale<'a> {
    grads: &'a mut GradientsParams,
    factor: Tensor<1>,
}

impl ModuleVisitor for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(grad) = self.grads.remove::<D>(param.id) {
            let factor = self.factor.clone().reshape([1; D]);
            self.grads.register(param.id, grad * factor);
        }
    }
}

/// Scales all gradients so that their global L2 norm is at most `max_norm`, and returns the
/// norm before clipping as a `[1]` tensor (read it only when logging: reading syncs the device).
pub fn clip_global_norm<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> Option<Tensor<1>> {
    let (norm, factor) = clip_factor(model, grads, max_norm)?;
    if let Some(factor) = factor {
        model.visit(&mut Scale { grads, factor });
    }
    Some(norm)
}

/// The global L2 norm of all gradients (`[1]`) and the factor that clips it to `max_norm`,
/// `min(1, max_norm / norm)` (`None` when `max_norm` is 0: no clipping), both computed on the
/// device without a synchronisation; the gradients are left as they are, for an optimizer that
/// applies the factor itself ([`adamw_scaled`]). `None` without gradients.
pub fn clip_factor<M: Module>(
    model: &M,
    grads: &GradientsParams,
    max_norm: f64,
) -> Option<(Tensor<1>, Option<Tensor<1>>)> {
    let mut gradients = Gradients {
        grads,
        flat: Vec::new(),
    };
    model.visit(&mut gradients);
    // On GPUs one launch per 8 gradients and one more that writes the norm and the factor
    // (Burn's ops take about three per gradient and six more).
    global_norm(gradients.flat, (max_norm > 0.0).then_some(max_norm as f32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::Device;

    #[derive(Module, Debug)]
    struct Two {
        a: Linear,
        b: Linear,
    }

    #[test]
    fn global_norm_clipping_scales_all_gradients_together() {
        let device = Device::flex().autodiff();
        let model = Two {
            a: LinearConfig::new(2, 2).init(&device),
            b: LinearConfig::new(2, 1).with_bias(false).init(&device),
        };
        let x = Tensor::<2>::from_floats([[1.0, 2.0], [3.0, -1.0]], &device);
        let loss = model.b.forward(model.a.forward(x)).sum().mul_scalar(10.0);
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        // The global norm by hand, from the gradients before clipping.
        let parts: Vec<Tensor<1>> = vec![
            grads
                .get::<2>(model.a.weight.id)
                .unwrap()
                .powi_scalar(2)
                .sum(),
            grads
                .get::<1>(model.a.bias.as_ref().unwrap().id)
                .unwrap()
                .powi_scalar(2)
                .sum(),
            grads
                .get::<2>(model.b.weight.id)
                .unwrap()
                .powi_scalar(2)
                .sum(),
        ];
        let want: f32 = parts
            .into_iter()
            .map(|p| p.into_scalar::<f32>())
            .sum::<f32>()
            .sqrt();
        let before_b = grads.get::<2>(model.b.weight.id).unwrap();
        let norm = clip_global_norm(&model, &mut grads, 0.5)
            .unwrap()
            .into_scalar::<f32>();
        assert!((norm - want).abs() < 1e-3 * want, "{norm} vs {want}");
        assert!(want > 0.5, "test needs a norm above the limit");
        let after_b = grads.get::<2>(model.b.weight.id).unwrap();
        let ratio = (after_b / before_b).try_into_vec_as::<f32>().unwrap();
        for r in ratio {
            assert!((r - 0.5 / want).abs() < 1e-4, "scaled by {r}");
        }
    }

    #[test]
    fn gradients_under_the_limit_are_left_as_they_are() {
        let device = Device::flex().autodiff();
        let model = LinearConfig::new(3, 2).init(&device);
        let x = Tensor::<2>::from_floats([[1.0, 2.0, -0.5]], &device);
        let mut grads = GradientsParams::from_grads(model.forward(x).sum().backward(), &model);
        let before = grads.get::<2>(model.weight.id).unwrap().to_data();
        // d sum / d weight is x for each output: norm sqrt(2 * 5.25 + 2) (bias gradient 1, 1).
        let want = (2.0f32 * 5.25 + 2.0).sqrt();
        let norm = clip_global_norm(&model, &mut grads, 100.0).unwrap();
        assert!((norm.into_scalar::<f32>() - want).abs() < 1e-5);
        assert_eq!(grads.get::<2>(model.weight.id).unwrap().to_data(), before);
    }

    #[test]
    fn biases_are_exempt_from_weight_decay() {
        let device = Device::flex();
        let model = Two {
            a: LinearConfig::new(2, 2).init(&device),
            b: LinearConfig::new(2, 1).init(&device),
        };
        let mut v = VectorParams(Vec::new());
        model.visit(&mut v);
        assert_eq!(v.0.len(), 2);
        assert!(v.0.contains(&model.a.bias.as_ref().unwrap().id));
        assert!(!v.0.contains(&model.a.weight.id));
    }
}
