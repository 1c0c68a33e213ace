//! Data-parallel training steps over several devices (`device = "cuda:0,cuda:1"`).
//!
//! The scheme of Burn's own multi-device learner (`MultiDeviceOptim::OptimMainDevice` in
//! `burn-train`), built from the same Burn pieces so that it fits ember's step-based loop: each
//! device gets a fork of the model (`Module::fork`, its own autodiff graph) and runs its share of
//! the step's micro-batches in its own thread; the gradients are moved to the first device
//! (`GradientsParams::to_device`) and summed there (`GradientsAccumulator`), in micro-batch
//! order, and the optimizer steps once on the first device. The result equals the same step on
//! one device with the same `grad_accum`, up to the order of floating-point sums inside each
//! device's kernels (on CPU `flex,flex` it is bit for bit the same without dropout).

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

use crate::config::TrainingConfig;
use crate::task::{Task, combine, micro_seed};

/// One micro-batch's share of a step: its index, loss (already divided by the number of
/// micro-batches, detached, on the main device), tokens and gradients (on the main device).
type Micro = (u64, Tensor<1>, usize, GradientsParams);

/// Forward and backward over the step's `config.grad_accum` micro-batches, micro-batch `i` on
/// `devices[i % devices.len()]`, all devices at once. Returns the mean loss, the tokens and the
/// summed gradients, on the device of `model` (which must be `devices[0]`).
pub fn accumulate<T: Task>(
    task: &T,
    model: &T::Model,
    step: u64,
    config: &TrainingConfig,
    devices: &[Device],
) -> (Tensor<1>, usize, GradientsParams) {
    let n = config.grad_accum as u64;
    let k = devices.len() as u64;
    let main = devices[0].clone();
    // Burn initialises parameters lazily, on first use, from the process-wide RNG. Do it here,
    // in order, before the workers start: otherwise the first step's workers would race to
    // initialise the shared parameters while seeding and drawing from the same RNG.
    // From the generator as the first micro-batch sets it, as one device's first forward pass
    // initialises them.
    ember_kernels::seed_random(&main.clone().autodiff(), micro_seed(config.seed, step, 0));
    ember_model::precision::initialize(model);
    // Device `j`'s share of the step, on a fork of the model on that device.
    let share = |j: usize, device: &Device, model: T::Model| -> Vec<Micro> {
        let device = device.clone().autodiff();
        let model = model.fork(&device);
        (j as u64..n)
            .step_by(k as usize)
            .map(|micro| {
                ember_kernels::seed_random(&device, micro_seed(config.seed, step, micro));
                let compute = config.precision.compute(&model);
                let (loss, tokens) = task.train_loss(&compute, step, micro, n, &device);
                let loss = loss.div_scalar(n as f64);
                let grads =
                    GradientsParams::from_grads(loss.backward(), &model).to_device(&main, &model);
                (micro, loss.detach().to_device(&main), tokens, grads)
            })
            .collect()
    };
    // The first device's share runs on this thread, which may be one of rayon's (the `ember`
    // binary makes its main thread one): waiting idle for the others, it would leave the CPU
    // kernels one thread fewer to run on.
    let mut micros: Vec<Micro> = std::thread::scope(|scope| {
        let others: Vec<_> = devices
            .iter()
            .enumerate()
            .skip(1)
            .map(|(j, device)| {
                let model = model.clone();
                scope.spawn(move || share(j, device, model))
            })
            .collect();
        let mut micros = share(0, &devices[0], model.clone());
        for other in others {
            match other.join() {
                Ok(more) => micros.extend(more),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        micros
    });
    micros.sort_by_key(|m| m.0);
    combine(
        model,
        micros
            .into_iter()
            .map(|(_, loss, tokens, grads)| (loss, tokens, grads)),
    )
}
