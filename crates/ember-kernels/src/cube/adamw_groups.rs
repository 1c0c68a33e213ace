//! AdamW's steps launched [`SLOTS`] parameters at a time: while a group is open on this thread
//! ([`crate::AdamWGroups`], what ember's trainer opens around an optimizer step), the kernel of
//! [`super::adamw`] hands back each parameter's new tensors at once and defers the launch that
//! writes them until [`SLOTS`] steps that share their scalars are waiting, or the group closes.
//!
//! Why: a model's parameters are dozens of tensors, many of them small (biases, LayerNorm
//! gains), and a launch each is mostly the launch's fixed cost: 39 of the 353 launches of a bf16
//! step of nanoGPT's GPU config, 148 of GPT-2 small's (with its biases). Three to a launch
//! (each step's 8 buffers are bindings: Vulkan devices such as lavapipe allow 31), about a third
//! as many.
//!
//! The tensors handed back are written by the deferred launch: nothing may read them before the
//! group closes, which a module optimizer's step does not (it only moves them into the model and
//! its state). Every element is computed as the one-parameter kernel computes it.

use std::cell::RefCell;

use burn::tensor::{DType, bf16, f16};
use burn_cubecl::tensor::CubeTensor;

use super::adamw::Scalars;

/// Parameters per launch.
pub(crate) const SLOTS: usize = 3;

/// Bindings a launch takes: 8 per step and the gradients' scale.
const BINDINGS: usize = 8 * SLOTS + 1;

/// One parameter's step: its contiguous inputs (parameter, gradient, moments), the outputs
/// already handed back (parameter, moments) and the copy of the new parameter in the products'
/// type (a one-value stand-in without one).
pub(crate) struct Step {
    pub inputs: [CubeTensor; 4],
    pub outputs: [CubeTensor; 3],
    pub copy: CubeTensor,
}

/// What the steps of one launch share: the device, the scalars (compared bit for bit), whether
/// the gradients are scaled and by which tensor, the copies' type.
struct Group {
    scalars: Scalars,
    scale: Option<CubeTensor>,
    copy: Option<DType>,
    steps: Vec<Step>,
}

impl Group {
    fn takes(
        &self,
        step: &Step,
        scalars: &Scalars,
        scale: Option<&CubeTensor>,
        copy: Option<DType>,
    ) -> bool {
        let same_device = self.steps[0].inputs[0].device == step.inputs[0].device;
        let same_scale = match (&self.scale, scale) {
            (None, None) => true,
            (Some(a), Some(b)) => {
                a.handle.memory.descriptor().id == b.handle.memory.descriptor().id
            }
            _ => false,
        };
        same_device && self.scalars.bits() == scalars.bits() && same_scale && self.copy == copy
    }
}

thread_local! {
    /// The groups waiting on this thread, `None` while no group is open.
    static OPEN: RefCell<Option<Vec<Group>>> = const { RefCell::new(None) };
}

/// Opens grouping on this thread (false where it already was open: the caller then leaves it to
/// the one who opened it). Not under Burn's fusion, which defers the ops.
#[cfg_attr(feature = "fusion", allow(dead_code))]
pub(crate) fn open() -> bool {
    OPEN.with_borrow_mut(|open| match open {
        Some(_) => false,
        None => {
            *open = Some(Vec::new());
            true
        }
    })
}

/// Launches every waiting step and closes grouping on this thread.
#[cfg_attr(feature = "fusion", allow(dead_code))]
pub(crate) fn close() {
    let groups = OPEN.with_borrow_mut(Option::take);
    for group in groups.into_iter().flatten() {
        launch(group);
    }
}

/// Whether `client`'s device takes a launch of [`SLOTS`] steps.
fn fits(like: &CubeTensor) -> bool {
    like.client.properties().hardware.max_bindings as usize >= BINDINGS
}

/// Keeps `step` for a grouped launch where grouping is open on this thread and the device takes
/// the launch (launching its group when it fills); `step` back otherwise.
pub(crate) fn defer(
    step: Step,
    scalars: Scalars,
    scale: Option<&CubeTensor>,
    copy: Option<DType>,
) -> Result<(), Step> {
    if !fits(&step.inputs[0]) {
        return Err(step);
    }
    OPEN.with_borrow_mut(|open| {
        let Some(groups) = open else {
            return Err(step);
        };
        let at = match groups
            .iter()
            .position(|g| g.takes(&step, &scalars, scale, copy))
        {
            Some(at) => at,
            None => {
                groups.push(Group {
                    scalars,
                    scale: scale.cloned(),
                    copy,
                    steps: Vec::with_capacity(SLOTS),
                });
                groups.len() - 1
            }
        };
        groups[at].steps.push(step);
        if groups[at].steps.len() == SLOTS {
            launch(groups.swap_remove(at));
        }
        Ok(())
    })
}

/// One launch for the steps of `group` (at most [`SLOTS`]; a slot without a step is bound to
/// the first step's buffers and never read).
fn launch(group: Group) {
    let Some(first) = group.steps.first() else {
        return;
    };
    #[cfg(all(test, feature = "wgpu"))]
    tests::LAUNCHES.with(|n| n.set(n.get() + 1));
    let client = first.inputs[0].client.clone();
    let sizes: Vec<usize> = group
        .steps
        .iter()
        .map(|s| s.inputs[0].meta.shape().num_elements())
        .collect();
    let (count, dim) = super::launch_size(&first.inputs[0], sizes.iter().sum());
    let slot = |i: usize| group.steps.get(i).unwrap_or(first);
    let arg = |t: &CubeTensor| t.clone().into_tensor_arg();
    let scale = group.scale.as_ref().unwrap_or(&first.inputs[1]);
    let [b1, b2, f1, f2, c1, c2, eps, lr, keep] = group.scalars.values();
    let used = group.steps.len() as u32;
    macro_rules! go {
        ($copy:ty) => {
            kernel::adamw_steps::launch::<f32, $copy>(
                &client,
                count,
                dim,
                arg(&slot(0).inputs[0]),
                arg(&slot(0).inputs[1]),
                arg(&slot(0).inputs[2]),
                arg(&slot(0).inputs[3]),
                arg(&slot(0).outputs[0]),
                arg(&slot(0).outputs[1]),
                arg(&slot(0).outputs[2]),
                arg(&slot(0).copy),
                arg(&slot(1).inputs[0]),
                arg(&slot(1).inputs[1]),
                arg(&slot(1).inputs[2]),
                arg(&slot(1).inputs[3]),
                arg(&slot(1).outputs[0]),
                arg(&slot(1).outputs[1]),
                arg(&slot(1).outputs[2]),
                arg(&slot(1).copy),
                arg(&slot(2).inputs[0]),
                arg(&slot(2).inputs[1]),
                arg(&slot(2).inputs[2]),
                arg(&slot(2).inputs[3]),
                arg(&slot(2).outputs[0]),
                arg(&slot(2).outputs[1]),
                arg(&slot(2).outputs[2]),
                arg(&slot(2).copy),
                arg(scale),
                b1,
                b2,
                f1,
                f2,
                c1,
                c2,
                eps,
                lr,
                keep,
                used,
                group.scale.is_some(),
                group.copy.is_some(),
            )
        };
    }
    match group.copy {
        None => go!(f32),
        Some(DType::BF16) => go!(bf16),
        Some(DType::F16) => go!(f16),
        Some(other) => unreachable!("a weight's copy in {other:?} (bf16 or f16 only)"),
    }
}

mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use crate::cube::adamw::kernel::{scalars, update};

    /// The launch of [`SLOTS`](super::SLOTS) steps, eight buffers each (parameter, gradient,
    /// moments, and their outputs with the parameter's copy): unit `i` updates element `i` of
    /// the `used` steps' parameters laid end to end, with `adamw_step`'s expressions in their
    /// order.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    pub(super) fn adamw_steps<F: Float, N: Float>(
        p0: &Tensor<F>,
        g0: &Tensor<F>,
        a0: &Tensor<F>,
        b0: &Tensor<F>,
        po0: &mut Tensor<F>,
        ao0: &mut Tensor<F>,
        bo0: &mut Tensor<F>,
        c0: &mut Tensor<N>,
        p1: &Tensor<F>,
        g1: &Tensor<F>,
        a1: &Tensor<F>,
        b1: &Tensor<F>,
        po1: &mut Tensor<F>,
        ao1: &mut Tensor<F>,
        bo1: &mut Tensor<F>,
        c1: &mut Tensor<N>,
        p2: &Tensor<F>,
        g2: &Tensor<F>,
        a2: &Tensor<F>,
        b2: &Tensor<F>,
        po2: &mut Tensor<F>,
        ao2: &mut Tensor<F>,
        bo2: &mut Tensor<F>,
        c2: &mut Tensor<N>,
        scale: &Tensor<F>,
        beta_1: f32,
        beta_2: f32,
        factor_1: f32,
        factor_2: f32,
        correction_1: f32,
        correction_2: f32,
        epsilon: f32,
        lr: f32,
        keep: f32,
        #[comptime] used: u32,
        #[comptime] has_scale: bool,
        #[comptime] has_copy: bool,
    ) {
        let i = ABSOLUTE_POS;
        let n0 = p0.len();
        let mut n1 = 0;
        let mut n2 = 0;
        if comptime!(used > 1) {
            n1 = p1.len();
        }
        if comptime!(used > 2) {
            n2 = p2.len();
        }
        if i >= n0 + n1 + n2 {
            terminate!();
        }
        let mut factor = F::new(1.0);
        if has_scale {
            factor = scale[0];
        }
        let k = scalars::<F>(
            beta_1,
            beta_2,
            factor_1,
            factor_2,
            correction_1,
            correction_2,
            epsilon,
            lr,
            keep,
        );
        if i < n0 {
            update::<F, N>(
                p0, g0, a0, b0, po0, ao0, bo0, c0, i, factor, &k, has_scale, has_copy,
            );
        } else if i < n0 + n1 {
            let j = i - n0;
            update::<F, N>(
                p1, g1, a1, b1, po1, ao1, bo1, c1, j, factor, &k, has_scale, has_copy,
            );
        } else {
            let j = i - n0 - n1;
            update::<F, N>(
                p2, g2, a2, b2, po2, ao2, bo2, c2, j, factor, &k, has_scale, has_copy,
            );
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use crate::{AdamWGroups, AdamWStep, adamw_step};
    use burn::tensor::{Device, DeviceKind, Distribution, Tensor};

    thread_local! {
        /// Grouped launches made on this thread.
        pub(super) static LAUNCHES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    fn values(t: &Tensor<2>) -> Vec<u32> {
        t.to_data().iter::<f32>().map(f32::to_bits).collect()
    }

    /// Seven parameters of six lengths (one a transposed view), five with weight decay and two
    /// without, three steps, the gradients scaled on the second: grouped, the same parameters
    /// and moments as one launch each, bit for bit, in three launches a step (the decayed five
    /// as three and two, the other two as one), all made by the time the group closes.
    #[test]
    fn grouped_steps_equal_one_launch_each_bit_for_bit() {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let normal = Distribution::Normal(0.0, 1.0);
        let shapes = [[37, 19], [5, 1], [64, 3], [1, 1], [19, 37], [7, 11], [5, 1]];
        let start: Vec<Tensor<2>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &[r, c])| match i {
                4 => Tensor::<2>::random([c, r], normal, &device).transpose(),
                _ => Tensor::<2>::random([r, c], normal, &device),
            })
            .collect();
        type State = (Tensor<2>, Option<(Tensor<2>, Tensor<2>)>);
        let mut apart: Vec<State> = start.iter().map(|p| (p.clone(), None)).collect();
        let mut grouped = apart.clone();
        for step in 1..=3 {
            let grads: Vec<Tensor<2>> = apart
                .iter()
                .map(|(p, _)| Tensor::<2>::random(p.shape(), normal, &device))
                .collect();
            let scale = (step == 2).then(|| Tensor::<1>::from_floats([0.37], &device));
            let k = |i: usize| {
                let decay = if i < 5 { 0.1 } else { 0.0 };
                AdamWStep::new(0.9, 0.99, 1e-8, decay, 1e-2 * step as f64, step)
            };
            let run = |states: &mut Vec<State>| {
                for (i, (state, grad)) in states.iter_mut().zip(&grads).enumerate() {
                    let (p, moments) = state.clone();
                    let out = adamw_step(p, grad.clone(), moments, &k(i), scale.as_ref())
                        .unwrap_or_else(|_| panic!("the kernel takes wgpu f32 tensors"));
                    *state = (out.0, Some((out.1, out.2)));
                }
            };
            run(&mut apart);
            LAUNCHES.with(|n| n.set(0));
            {
                let _group = AdamWGroups::open();
                run(&mut grouped);
                assert_eq!(
                    LAUNCHES.with(|n| n.get()),
                    1,
                    "the decayed group's first three"
                );
            }
            assert_eq!(LAUNCHES.with(|n| n.get()), 3, "step {step}");
            for (i, ((p, m), (q, n))) in apart.iter().zip(&grouped).enumerate() {
                let (m, n) = (m.as_ref().unwrap(), n.as_ref().unwrap());
                assert_eq!(values(p), values(q), "step {step}, parameter {i}");
                assert_eq!(values(&m.0), values(&n.0), "step {step}, first moment {i}");
                assert_eq!(values(&m.1), values(&n.1), "step {step}, second moment {i}");
            }
            // The step moved the parameters.
            assert_ne!(values(&grouped[0].0), values(&start[0]));
        }
        // Closed, the steps launch one by one again.
        LAUNCHES.with(|n| n.set(0));
        let k = AdamWStep::new(0.9, 0.99, 1e-8, 0.0, 1e-3, 1);
        let _ = adamw_step(start[0].clone(), start[0].clone(), None, &k, None);
        assert_eq!(LAUNCHES.with(|n| n.get()), 0);
    }
}
