//! AdamW in one pass over each parameter (ember-model's [`adamw_step`] op: a loop on flex, one
//! kernel on the GPU backends).
//!
//! Burn 0.22.1's `AdamW` updates a parameter with about fifteen tensor ops (moments, bias
//! corrections, square root, division, decay), each a new buffer: a fifth of a baby-GPT
//! training step on flex, and on a GPU without fusion fifteen kernel launches per parameter.
//! [`FusedAdamW`] computes the same expressions, in the same order and precision, in one pass;
//! for every tensor the op does not take (another backend, AMSGrad state) it is Burn's `AdamW`.
//! Its state is Burn's [`AdamWState`], so checkpoints of either load into the other.

use std::sync::{Arc, Mutex};

use burn::optim::{AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, LearningRate, Optimizer};
use burn::tensor::{Device, Tensor};
use ember_kernels::adamw::scaled;
use ember_kernels::{AdamWStep, adamw_step};

/// A factor for the gradients of the next optimizer steps (global-norm clipping's), shared by
/// the trainer, which sets it, and the [`FusedAdamW`]s it was given to, which apply it: on GPUs
/// the AdamW kernel multiplies each gradient value as it reads it, so clipping launches nothing
/// per gradient beyond its norm.
#[derive(Clone, Default)]
pub struct GradScale(Arc<Mutex<Option<Tensor<1>>>>);

impl GradScale {
    /// Scale the gradients by `factor` (`[1]`, on the gradients' device) from now on; `None`: 1.
    pub fn set(&self, factor: Option<Tensor<1>>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = factor;
    }

    /// The factor now.
    fn get(&self) -> Option<Tensor<1>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// AdamW (decoupled weight decay, bias-corrected moments), fused.
#[derive(Clone)]
pub struct FusedAdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    /// The gradients' factor ([`GradScale`]; 1 unless set).
    grad_scale: GradScale,
    /// Burn's AdamW with the same settings, for tensors the fused step does not take.
    burn: AdamW,
}

impl FusedAdamW {
    /// AdamW with these betas, epsilon and weight decay (no AMSGrad, no clipping).
    pub fn new(beta_1: f32, beta_2: f32, epsilon: f32, weight_decay: f32) -> Self {
        let burn = AdamWConfig::new()
            .with_beta_1(beta_1)
            .with_beta_2(beta_2)
            .with_epsilon(epsilon)
            .with_weight_decay(weight_decay)
            .build();
        Self {
            beta_1,
            beta_2,
            epsilon,
            weight_decay,
            grad_scale: GradScale::default(),
            burn,
        }
    }

    /// The same optimizer, its gradients multiplied by `grad_scale`'s factor whenever one is set.
    pub fn with_grad_scale(mut self, grad_scale: GradScale) -> Self {
        self.grad_scale = grad_scale;
        self
    }
}

impl Optimizer for FusedAdamW {
    type State<const D: usize> = AdamWState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let scale = self.grad_scale.get();
        // AMSGrad's running maximum is Burn's alone.
        if state
            .as_ref()
            .is_some_and(|s| s.momentum.max_moment_2.is_some())
        {
            return self
                .burn
                .step(lr, tensor, scaled(grad, scale.as_ref()), state);
        }
        let (time, moments) = match state {
            Some(state) => {
                let m = state.momentum;
                (m.time + 1, Some((m.moment_1, m.moment_2)))
            }
            None => (1, None),
        };
        let k = AdamWStep::new(
            self.beta_1,
            self.beta_2,
            self.epsilon,
            self.weight_decay,
            lr,
            time,
        );
        // Handed back (not taken), the gradient comes scaled.
        match adamw_step(tensor, grad, moments, &k, scale.as_ref()) {
            Ok((param, m1, m2)) => {
                let momentum = AdaptiveMomentumState::new(time, m1, m2);
                (param, Some(AdamWState::new(momentum)))
            }
            Err((tensor, grad, moments)) => {
                let state = moments
                    .map(|(m1, m2)| AdamWState::new(AdaptiveMomentumState::new(time - 1, m1, m2)));
                self.burn.step(lr, tensor, grad, state)
            }
        }
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        AdamW::to_device(state, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;

    /// Five steps from the same start, with and without weight decay, on a contiguous and a
    /// transposed parameter: the fused loop gives Burn's parameters and moments to the bit.
    #[test]
    fn equals_burns_adamw_bit_for_bit() {
        let device = Device::flex();
        let normal = Distribution::Normal(0.0, 1.0);
        for weight_decay in [0.0, 0.1] {
            for transposed in [false, true] {
                let fused = FusedAdamW::new(0.9, 0.99, 1e-8, weight_decay);
                let burn = AdamWConfig::new()
                    .with_beta_1(0.9)
                    .with_beta_2(0.99)
                    .with_epsilon(1e-8)
                    .with_weight_decay(weight_decay)
                    .build();
                let start = Tensor::<2>::random([37, 19], normal, &device);
                let start = if transposed { start.transpose() } else { start };
                let (mut ours, mut theirs) = (start.clone(), start);
                let (mut our_state, mut their_state) = (None, None);
                for step in 0..5 {
                    let grad = Tensor::<2>::random(ours.shape(), normal, &device);
                    let lr = 1e-3 * (step + 1) as f64;
                    assert!(takes(&ours, &grad, our_state.as_ref()), "{step}");
                    (ours, our_state) = fused.step(lr, ours, grad.clone(), our_state);
                    (theirs, their_state) = burn.step(lr, theirs, grad, their_state);
                    let (a, b) = (our_state.as_ref().unwrap(), their_state.as_ref().unwrap());
                    assert_eq!(a.momentum.time, b.momentum.time);
                    let what =
                        format!("decay {weight_decay}, transposed {transposed}, step {step}");
                    same(&ours, &theirs, &format!("{what}: parameter"));
                    same(&a.momentum.moment_1, &b.momentum.moment_1, &what);
                    same(&a.momentum.moment_2, &b.momentum.moment_2, &what);
                }
            }
        }
    }

    /// With a gradient scale set, the steps equal Burn's `AdamW` given the scaled gradient, to
    /// the bit (flex multiplies first, with the same `f32` product), on the op's path and on
    /// Burn's (an autodiff device's tensors); cleared, the gradient is used as it is.
    #[test]
    fn a_grad_scale_scales_the_gradients() {
        for device in [Device::flex(), Device::flex().autodiff()] {
            let scale = GradScale::default();
            let fused = FusedAdamW::new(0.9, 0.99, 1e-8, 0.1).with_grad_scale(scale.clone());
            let burn = AdamWConfig::new()
                .with_beta_2(0.99)
                .with_epsilon(1e-8)
                .with_weight_decay(0.1)
                .build();
            let normal = Distribution::Normal(0.0, 1.0);
            let (mut ours, mut theirs) = {
                let start = Tensor::<2>::random([7, 5], normal, &device);
                (start.clone(), start)
            };
            let (mut our_state, mut their_state) = (None, None);
            for step in 0..4 {
                let grad = Tensor::<2>::random([7, 5], normal, &device);
                let factor = (step % 2 == 0).then(|| Tensor::<1>::from_floats([0.3], &device));
                scale.set(factor.clone());
                (ours, our_state) = fused.step(1e-2, ours, grad.clone(), our_state);
                let grad = scaled(grad, factor.as_ref());
                (theirs, their_state) = burn.step(1e-2, theirs, grad, their_state);
                same(&ours, &theirs, &format!("{device:?}, step {step}"));
            }
        }
    }

    /// Whether ember-model's op (not Burn's AdamW) takes this step.
    fn takes<const D: usize>(p: &Tensor<D>, g: &Tensor<D>, state: Option<&AdamWState<D>>) -> bool {
        let moments = state.map(|s| (s.momentum.moment_1.clone(), s.momentum.moment_2.clone()));
        let k = AdamWStep::new(0.9, 0.99, 1e-8, 0.0, 1e-3, 1);
        adamw_step(p.clone(), g.clone(), moments, &k, None).is_ok()
    }

    fn same(a: &Tensor<2>, b: &Tensor<2>, what: &str) {
        assert_eq!(a.shape(), b.shape(), "{what}");
        let (a, b) = (a.to_data(), b.to_data());
        let (a, b) = (
            a.try_to_vec::<f32>().unwrap(),
            b.try_to_vec::<f32>().unwrap(),
        );
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(differ, 0, "{what}: {differ} of {} values differ", a.len());
    }

    /// A parameter the optimizer does not own the buffer of (held elsewhere too) is copied, not
    /// overwritten: the other holder still sees the old values.
    #[test]
    fn shared_parameter_buffers_are_left_alone() {
        let device = Device::flex();
        let param = Tensor::<1>::from_floats([1.0, -2.0, 3.0], &device);
        let held = param.clone();
        let grad = Tensor::<1>::from_floats([0.5, 0.5, -0.5], &device);
        let (updated, _) = FusedAdamW::new(0.9, 0.99, 1e-8, 0.1).step(0.1, param, grad, None);
        assert_eq!(
            held.to_data().try_to_vec::<f32>().unwrap(),
            vec![1.0, -2.0, 3.0]
        );
        let moved = updated.to_data().try_to_vec::<f32>().unwrap();
        assert!(moved.iter().zip([1.0, -2.0, 3.0]).all(|(a, b)| a != &b));
    }

    /// Off flex's plain tensors (here: AMSGrad-free state on an autodiff device), the step is
    /// Burn's.
    #[test]
    fn other_tensors_take_burns_step() {
        let device = Device::flex().autodiff();
        let param = Tensor::<1>::from_floats([1.0, -2.0], &device);
        let grad = Tensor::<1>::from_floats([0.5, 0.5], &device);
        assert!(!takes(&param, &grad, None));
        let (ours, _) =
            FusedAdamW::new(0.9, 0.99, 1e-8, 0.0).step(0.1, param.clone(), grad.clone(), None);
        let burn = AdamWConfig::new()
            .with_beta_2(0.99)
            .with_epsilon(1e-8)
            .with_weight_decay(0.0);
        let (theirs, _) = burn.build().step(0.1, param, grad, None);
        assert_eq!(ours.to_data(), theirs.to_data());
    }
}
