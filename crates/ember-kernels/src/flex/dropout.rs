//! Dropout on flex through [`crate::kernels::dropout`]'s hashed mask (split over rayon's
//! threads for tensors of 64k values or more), with its own backward pass: the same factors on
//! the gradient, the mask computed again from the seed. Nothing is kept for the backward pass
//! but the mask's three numbers.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::Tensor;

use super::op;
use super::tensor::{Tracked, contiguous, from_values};
use super::threads::spread;
use crate::kernels::dropout::Mask;

/// `x` times `mask`'s factors (element `i` of `x` in row-major order: `mask.factor(i)`) where
/// ember's kernels take `x` (a flex `f32` tensor); otherwise `x` back.
pub(crate) fn dropout<const D: usize>(x: Tensor<D>, mask: Mask) -> Result<Tensor<D>, Tensor<D>> {
    op::unary(x, FlexDropout { mask })
}

#[derive(Debug)]
struct FlexDropout {
    mask: Mask,
}

impl op::Unary for FlexDropout {
    fn plain(self, x: FlexTensor) -> FlexTensor {
        apply(x, self.mask)
    }

    fn tracked<C: CheckpointStrategy>(self, x: Tracked) -> Tracked {
        let mask = self.mask;
        match self.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(mask, apply(x.primitive().clone(), mask)),
            OpsKind::UnTracked(prep) => prep.finish(apply(x.into_primitive(), mask)),
        }
    }
}

impl Backward<Flex, 1> for FlexDropout {
    /// The mask.
    type State = Mask;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let mask = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| apply(grad, mask));
    }
}

/// `t` times the mask's factors: in place when no one else holds its buffer.
fn apply(t: FlexTensor, mask: Mask) -> FlexTensor {
    let mut t = contiguous(t);
    let (start, end) = t.layout().contiguous_offsets().expect("contiguous");
    if let Some(storage) = t.try_storage_mut::<f32>() {
        spread(&mut storage[start..end], |xs, at| {
            mask.apply_in_place(xs, at)
        });
        return t;
    }
    let xs = &t.storage::<f32>()[start..end];
    let mut out = vec![0.0; xs.len()];
    spread(&mut out, |ys, at| {
        mask.apply_into(&xs[at..at + ys.len()], ys, at)
    });
    from_values(out, t.shape())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::dropout::seed_of;
    use burn::nn::DropoutConfig;
    use burn::tensor::{Device, Distribution, TensorData};

    /// Output and input gradient against the reference's arithmetic (`x * mask`, the mask's
    /// factors as a tensor), bit for bit, under autodiff and with checkpointing, through a graph
    /// (`exp` before), for a tensor that spreads over threads and one that does not, and a
    /// transposed view (its elements in row-major order of its shape); a plain tensor is
    /// multiplied the same.
    #[test]
    fn equals_the_reference_with_the_same_mask() {
        let base = Device::flex();
        let (seed, p) = (seed_of(0.381_966), 0.2_f32);
        let mask = Mask::new(seed, p);
        let normal = Distribution::Normal(0.0, 1.0);
        for dims in [[3, 50, 70], [4, 128, 300]] {
            let n: usize = dims.iter().product();
            let factors = TensorData::new((0..n).map(|i| mask.factor(i)).collect(), dims);
            let x = Tensor::<3>::random(dims, normal, &base).into_data();
            let swapped = [dims[2], dims[1], dims[0]];
            let x_swapped = Tensor::<3>::random(swapped, normal, &base).into_data();
            let g = Tensor::<3>::random(dims, normal, &base).into_data();
            for device in [
                base.clone().autodiff(),
                base.clone().autodiff().gradient_checkpointing(),
            ] {
                for transposed in [false, true] {
                    let run = |ours: bool| {
                        let data = if transposed { &x_swapped } else { &x };
                        let input = Tensor::<3>::from_data(data.clone(), &device).require_grad();
                        let mut h = input.clone().exp();
                        if transposed {
                            // A view of shape `dims` whose elements are not in row-major order.
                            h = h.swap_dims(0, 2);
                        }
                        let out = match ours {
                            true => dropout(h, mask).expect("a tracked flex f32 tensor"),
                            false => h * Tensor::<3>::from_data(factors.clone(), &device),
                        };
                        let grads = (out.clone() * Tensor::from_data(g.clone(), &device))
                            .sum()
                            .backward();
                        (out.inner(), input.grad(&grads).expect("a gradient"))
                    };
                    let ((y, dx), (y_ref, dx_ref)) = (run(true), run(false));
                    y.into_data().assert_eq(&y_ref.into_data(), true);
                    dx.into_data().assert_eq(&dx_ref.into_data(), true);
                }
            }
            let plain = Tensor::<3>::from_data(x.clone(), &base);
            let reference = plain.clone() * Tensor::<3>::from_data(factors, &base);
            let ours = dropout(plain, mask).expect("a flex f32 tensor");
            ours.into_data().assert_eq(&reference.into_data(), true);
        }
    }

    /// The op drops on a training device only, about `p` of the elements, scaled by
    /// `1 / (1 - p)`; the same masks after the same seed, others after another, another at
    /// each call; the seed is the first uniform number the device draws, as the GPU kernels
    /// read theirs.
    #[test]
    fn the_op_draws_its_seed_from_the_device() {
        let device = Device::flex().autodiff();
        let module = DropoutConfig::new(0.3).init();
        let x = Tensor::<2>::ones([200, 500], &device);
        // Flex's own generator, seeded directly: `crate::seed_random` would also empty the GPU
        // devices' seed pools, under the feet of the GPU tests running beside this one.
        let run = |seed: u64| {
            device.seed(seed);
            let a = crate::dropout(&module, x.clone()).into_data();
            let b = crate::dropout(&module, x.clone()).into_data();
            (a, b)
        };
        let ((a, b), (again, _), (other, _)) = (run(5), run(5), run(6));
        assert_eq!(a, again);
        assert_ne!(a, b, "two calls, one mask");
        assert_ne!(a, other, "two seeds, one mask");
        device.seed(5);
        let u = Tensor::<1>::random([1], Distribution::Uniform(0.0, 1.0), &device);
        let mask = Mask::new(seed_of(u.into_scalar::<f32>()), 0.3);
        let values = a.try_to_vec::<f32>().unwrap();
        for (i, v) in values.iter().enumerate() {
            assert_eq!(*v, mask.factor(i), "element {i}");
        }
        let dropped = values.iter().filter(|&&v| v == 0.0).count() as f32 / values.len() as f32;
        assert!((dropped - 0.3).abs() < 0.01, "dropped {dropped}");
        assert!(values.iter().all(|&v| v == 0.0 || v == 1.0 / 0.7));
        let plain = Tensor::<2>::ones([20, 50], &Device::flex());
        let kept = crate::dropout(&module, plain.clone());
        kept.into_data().assert_eq(&plain.into_data(), true);
    }
}
