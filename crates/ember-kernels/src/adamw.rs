//! One AdamW step of one parameter, in one pass: both moments and the parameter together.
//!
//! Burn 0.22.1's `AdamW` updates a parameter with about fifteen tensor ops (moments, bias
//! corrections, square root, division, decay), each a new buffer and, on a GPU without fusion, a
//! kernel launch of its own: 400 of a tiny model's 880 launches per training step on wgpu
//! (`ember train --profile-steps`). The kernels here compute the same expressions, in the same
//! order and `f32` precision, in one pass per parameter: on flex a loop that updates the buffers
//! in place ([`crate::kernels::adamw`]), on the GPU backends one CubeCL kernel
//! (`cube/adamw`). The reference is [`adamw_step_reference`] (Burn's tensor ops, the
//! expression of Burn's `AdamW`); ember-train's optimizer holds the kernels to Burn's `AdamW`
//! itself.
//!
//! `m1 = b1 m1 + (1 - b1) g`, `m2 = b2 m2 + (1 - b2) g^2`,
//! `p = p (1 - lr wd) - lr (m1 / c1) / (sqrt(m2 / c2) + eps)`, with the bias corrections
//! `c = 1 - b^t` at step `t` (1 for the first) and the moments zero before it.

use burn::tensor::Tensor;

/// While it lives, the AdamW steps this thread makes on GPU backends (CubeCL's, without Burn's
/// fusion) are launched three parameters at a time instead of one by one (`cube/adamw_groups`;
/// `EMBER_GPU_KERNELS=-grouped-adamw` turns it off): the tensors [`adamw_step`] hands back are
/// written when their group's launch runs, at the latest when this value is dropped, so nothing
/// may read them before that. Opened around a module optimizer's step, which only moves them
/// into the model and its state. A group opened inside another leaves the closing to the outer.
pub struct AdamWGroups {
    #[cfg_attr(not(all(feature = "cube", not(feature = "fusion"))), allow(dead_code))]
    opened: bool,
}

impl AdamWGroups {
    /// Groups the AdamW steps made on this thread until the value is dropped.
    pub fn open() -> Self {
        #[cfg(all(feature = "cube", not(feature = "fusion")))]
        let opened = crate::gpu_kernels::applies(crate::GpuStrategy::GroupedAdamW)
            && super::cube::adamw_groups::open();
        #[cfg(not(all(feature = "cube", not(feature = "fusion"))))]
        let opened = false;
        Self { opened }
    }
}

impl Drop for AdamWGroups {
    /// Launches the steps still waiting.
    fn drop(&mut self) {
        #[cfg(all(feature = "cube", not(feature = "fusion")))]
        if self.opened {
            super::cube::adamw_groups::close();
        }
    }
}

/// The scalars of one step, rounded to `f32` where Burn's tensor ops round them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Decay rates of the first and second moments.
    pub beta_1: f32,
    pub beta_2: f32,
    /// `1 - beta_1`, `1 - beta_2`.
    pub factor_1: f32,
    pub factor_2: f32,
    /// Bias corrections `1 - beta^time`.
    pub correction_1: f32,
    pub correction_2: f32,
    pub epsilon: f32,
    /// The learning rate of this step.
    pub lr: f32,
    /// `1 - lr * weight_decay`, or `None` without decay (Burn then skips the product).
    pub keep: Option<f32>,
}

impl AdamWStep {
    /// The scalars of step `time` (1 for the first) at learning rate `lr`.
    pub fn new(
        beta_1: f32,
        beta_2: f32,
        epsilon: f32,
        weight_decay: f32,
        lr: f64,
        time: usize,
    ) -> Self {
        let decay = lr * weight_decay as f64;
        Self {
            beta_1,
            beta_2,
            factor_1: 1.0 - beta_1,
            factor_2: 1.0 - beta_2,
            correction_1: 1.0 - beta_1.powi(time as i32),
            correction_2: 1.0 - beta_2.powi(time as i32),
            epsilon,
            lr: lr as f32,
            keep: (decay != 0.0).then_some((1.0 - decay) as f32),
        }
    }
}

/// A parameter, its gradient and its moments (`None` before the first step).
pub type AdamWInputs<const D: usize> = (Tensor<D>, Tensor<D>, Option<(Tensor<D>, Tensor<D>)>);

/// The new parameter and moments `(param, m1, m2)` after one step of `k` on the gradient times
/// `grad_scale` (a `[1]` factor, such as global-norm clipping's; `None`: 1); the inputs back,
/// the gradient already scaled, where no kernel takes them (not plain `f32` tensors of one shape
/// on flex or a CubeCL device, or moments elsewhere than the parameter).
///
/// The GPU kernel multiplies each gradient value by the factor as it reads it, so clipping
/// costs no launch and no pass over the gradients of its own; elsewhere the product is a
/// tensor op first. Either way the same `f32` product as multiplying first.
pub fn adamw_step<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    moments: Option<(Tensor<D>, Tensor<D>)>,
    k: &AdamWStep,
    grad_scale: Option<&Tensor<1>>,
) -> Result<(Tensor<D>, Tensor<D>, Tensor<D>), AdamWInputs<D>> {
    if param.shape() != grad.shape() {
        return Err((param, scaled(grad, grad_scale), moments));
    }
    #[cfg(feature = "cube")]
    let (param, grad, moments) = match super::cube::adamw::step(param, grad, moments, k, grad_scale)
    {
        Ok(out) => return Ok(out),
        Err(inputs) => inputs,
    };
    let grad = scaled(grad, grad_scale);
    #[cfg(feature = "flex")]
    let (param, grad, moments) = match super::flex::adamw::step(param, grad, moments, k) {
        Ok(out) => return Ok(out),
        Err(inputs) => inputs,
    };
    Err((param, grad, moments))
}

/// `grad * scale` (the `[1]` factor broadcast), or `grad` without one.
pub fn scaled<const D: usize>(grad: Tensor<D>, scale: Option<&Tensor<1>>) -> Tensor<D> {
    match scale {
        Some(scale) => grad * scale.clone().reshape([1; D]),
        None => grad,
    }
}

/// [`adamw_step`] in Burn's tensor ops, the expression of Burn's `AdamW` (on any backend).
pub fn adamw_step_reference<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    moments: Option<(Tensor<D>, Tensor<D>)>,
    k: &AdamWStep,
    grad_scale: Option<&Tensor<1>>,
) -> (Tensor<D>, Tensor<D>, Tensor<D>) {
    let grad = scaled(grad, grad_scale);
    let (m1, m2) = match moments {
        Some((m1, m2)) => (
            m1.mul_scalar(k.beta_1) + grad.clone().mul_scalar(k.factor_1),
            m2.mul_scalar(k.beta_2) + grad.clone().square().mul_scalar(k.factor_2),
        ),
        // Burn's first step: the moments start from the gradient's terms alone.
        None => (
            grad.clone().mul_scalar(k.factor_1),
            grad.square().mul_scalar(k.factor_2),
        ),
    };
    let delta = m1.clone().div_scalar(k.correction_1)
        / (m2
            .clone()
            .div_scalar(k.correction_2)
            .sqrt()
            .add_scalar(k.epsilon));
    let param = match k.keep {
        Some(keep) => param.mul_scalar(keep),
        None => param,
    };
    (param - delta.mul_scalar(k.lr), m1, m2)
}
