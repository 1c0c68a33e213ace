//! AdamW in one pass over each parameter on Burn's flex backend.
//!
//! Burn 0.22.1's `AdamW` updates a parameter with about fifteen tensor ops (moments, bias
//! corrections, square root, division, decay), each a new buffer: a fifth of a baby-GPT
//! training step on flex. [`FusedAdamW`] computes the same expressions, in the same order and
//! precision, in one loop that updates the parameter and both moments in place; for every other
//! tensor (another backend, AMSGrad state) it is Burn's `AdamW`. Its state is Burn's
//! [`AdamWState`], so checkpoints of either load into the other.

use burn::backend::TensorMetadata;
use burn::backend::flex::FlexTensor;
use burn::optim::{AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, LearningRate, Optimizer};
use burn::tensor::{Device, Tensor};
use ember_model::ops::flex::tensor::{
    as_flex, contiguous, from_flex, from_values, values, values_mut,
};

/// AdamW (decoupled weight decay, bias-corrected moments), fused on flex.
#[derive(Clone)]
pub struct FusedAdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    /// Burn's AdamW with the same settings, for tensors the fused loop does not take.
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
            burn,
        }
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
        if !fusable(&tensor, &grad, state.as_ref()) {
            return self.burn.step(lr, tensor, grad, state);
        }
        let (param, grad) = (take(tensor), take(grad));
        let (time, moments) = match state {
            Some(state) => {
                let m = state.momentum;
                (m.time + 1, Some((take(m.moment_1), take(m.moment_2))))
            }
            None => (1, None),
        };
        let (param, m1, m2) = self.update(lr, time, param, &grad, moments);
        let momentum = AdaptiveMomentumState::new(time, from_flex(m1), from_flex(m2));
        (from_flex(param), Some(AdamWState::new(momentum)))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        AdamW::to_device(state, device)
    }
}

/// Whether the fused loop takes this step: plain flex `f32` tensors of one size, and moments
/// without AMSGrad's maximum.
fn fusable<const D: usize>(
    tensor: &Tensor<D>,
    grad: &Tensor<D>,
    state: Option<&AdamWState<D>>,
) -> bool {
    let flex = |t: &Tensor<D>| as_flex(t).is_some();
    let moments_fit = state.is_none_or(|s| {
        let m = &s.momentum;
        m.max_moment_2.is_none() && flex(&m.moment_1) && flex(&m.moment_2)
    });
    flex(tensor) && flex(grad) && tensor.shape() == grad.shape() && moments_fit
}

/// The flex tensor behind `t`, which [`fusable`] checked; dropping `t` leaves the buffer to it
/// alone when no one else holds it, so it can be updated in place.
fn take<const D: usize>(t: Tensor<D>) -> FlexTensor {
    let flex = as_flex(&t).expect("checked by fusable");
    drop(t);
    contiguous(flex)
}

impl FusedAdamW {
    /// One step at `time` (1 for the first): new parameter, first and second moments.
    fn update(
        &self,
        lr: LearningRate,
        time: usize,
        mut param: FlexTensor,
        grad: &FlexTensor,
        moments: Option<(FlexTensor, FlexTensor)>,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        let g = values(grad);
        let zeros = || from_values(vec![0.0; g.len()], grad.shape());
        let (mut m1, mut m2) = moments.unwrap_or_else(|| (zeros(), zeros()));
        let k = Constants::new(self, lr, time);
        adamw_in_place(
            &k,
            values_mut(&mut param),
            g,
            values_mut(&mut m1),
            values_mut(&mut m2),
        );
        (param, m1, m2)
    }
}

/// The scalars of one step, rounded to `f32` where Burn's tensor ops round them.
struct Constants {
    beta_1: f32,
    beta_2: f32,
    /// `1 - beta_1`, `1 - beta_2`.
    factor_1: f32,
    factor_2: f32,
    /// Bias corrections `1 - beta^time`.
    correction_1: f32,
    correction_2: f32,
    epsilon: f32,
    lr: f32,
    /// `1 - lr * weight_decay`, or `None` when there is no decay (Burn then skips the product).
    keep: Option<f32>,
}

impl Constants {
    fn new(o: &FusedAdamW, lr: LearningRate, time: usize) -> Self {
        let decay = lr * o.weight_decay as f64;
        Self {
            beta_1: o.beta_1,
            beta_2: o.beta_2,
            factor_1: 1.0 - o.beta_1,
            factor_2: 1.0 - o.beta_2,
            correction_1: 1.0 - o.beta_1.powi(time as i32),
            correction_2: 1.0 - o.beta_2.powi(time as i32),
            epsilon: o.epsilon,
            lr: lr as f32,
            keep: (decay != 0.0).then_some((1.0 - decay) as f32),
        }
    }
}

/// Burn's AdamW step element by element: `m1 = b1 m1 + (1 - b1) g`, `m2 = b2 m2 + (1 - b2) g^2`,
/// `p = p (1 - lr wd) - lr (m1 / c1) / (sqrt(m2 / c2) + eps)`.
fn adamw_in_place(k: &Constants, p: &mut [f32], g: &[f32], m1: &mut [f32], m2: &mut [f32]) {
    assert!(p.len() == g.len() && m1.len() == g.len() && m2.len() == g.len());
    for (((p, &g), m1), m2) in p.iter_mut().zip(g).zip(m1.iter_mut()).zip(m2.iter_mut()) {
        *m1 = *m1 * k.beta_1 + g * k.factor_1;
        *m2 = *m2 * k.beta_2 + (g * g) * k.factor_2;
        let delta = (*m1 / k.correction_1) / ((*m2 / k.correction_2).sqrt() + k.epsilon);
        let decayed = match k.keep {
            Some(keep) => *p * keep,
            None => *p,
        };
        *p = decayed - delta * k.lr;
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
                    assert!(fusable(&ours, &grad, our_state.as_ref()));
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
        assert!(!fusable(&param, &grad, None));
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
