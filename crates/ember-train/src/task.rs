//! What the training loop asks of a task (language modelling, translation), and the
//! micro-batch arithmetic that one device and data-parallel training share.

use std::path::Path;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor};

use crate::error::Result;
use crate::precision::Precision;

/// Which part of the data an evaluation reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// The training split.
    Train,
    /// The held-out split.
    Val,
}

/// What the loop needs from a task: losses, evaluations and the files of a checkpoint.
pub trait Task: Sync {
    /// The model being trained.
    type Model: Module + Clone + Send;

    /// Loss of micro-batch `micro` of the `micros` of optimizer step `step` (numbered over every
    /// process of a run across processes), with the batch built on `device` (the autodiff
    /// device `model` lives on), and the number of tokens it covers. The batch must depend only
    /// on `(seed, step, micro, micros)`.
    fn train_loss(
        &self,
        model: &Self::Model,
        step: u64,
        micro: u64,
        micros: u64,
        device: &Device,
    ) -> (Tensor<1>, usize);

    /// Mean loss over `batches` batches of `split`, on a model without autodiff. The same
    /// batches every time, so evaluations are comparable.
    fn eval_loss(&self, model: &Self::Model, split: Split, batches: usize) -> f64;

    /// Extra figures printed at each evaluation (e.g. BLEU), as `(name, value)`.
    fn extra_eval(&self, _model: &Self::Model) -> Vec<(String, f64)> {
        Vec::new()
    }

    /// Writes the tokenizer(s) and the resolved config into a checkpoint folder.
    fn write_files(&self, dir: &Path) -> Result<()>;

    /// `decoder_only` or `encoder_decoder`, recorded in checkpoints.
    fn model_kind(&self) -> &'static str;
}

/// Salt that separates dropout seeds from batch seeds.
pub(crate) const DROPOUT_SALT: u64 = 0x0D20_0F00;

/// The dropout seed of micro-batch `micro` of `step`: each micro-batch its own, so that its
/// masks do not depend on which process or device runs it (micro-batch 0's is the step's).
pub(crate) fn micro_seed(seed: u64, step: u64, micro: u64) -> u64 {
    ember_data::batch_seed(seed, step, DROPOUT_SALT ^ (micro << 32))
}

/// Forward and backward over the micro-batches `micros` of a step of `total` (the loss of each
/// divided by `total`) at `precision`; with `total` 1 the one micro-batch's loss as it is. With
/// `live`, raises it to the bytes of live tensors on the device (where its allocator reports
/// them) after each forward pass, just before its backward pass: the weights, the optimizer's
/// moments and the pass's saved activations, the most a step keeps alive besides the backward
/// pass's own buffers.
#[allow(clippy::too_many_arguments)]
pub(crate) fn accumulate<T: Task>(
    task: &T,
    model: &T::Model,
    step: u64,
    micros: std::ops::Range<u64>,
    total: u64,
    seed: u64,
    precision: Precision,
    mut live: Option<&mut u64>,
) -> (Tensor<1>, usize, GradientsParams) {
    let device = param_device(model);
    // Each forward pass runs a fresh `compute` model (a backward pass consumes the casts of a
    // bf16 view); the gradients are read off `model`'s own parameters.
    if total == 1 {
        ember_kernels::seed_random(&device, micro_seed(seed, step, micros.start));
        let (loss, tokens) = task.train_loss(
            &precision.compute(model),
            step,
            micros.start,
            total,
            &device,
        );
        note_live(&device, live);
        let grads = GradientsParams::from_grads(loss.backward(), model);
        return (loss.detach(), tokens, grads);
    }
    combine(
        model,
        micros.map(|micro| {
            ember_kernels::seed_random(&device, micro_seed(seed, step, micro));
            let compute = precision.compute(model);
            let (loss, tokens) = task.train_loss(&compute, step, micro, total, &device);
            note_live(&device, live.as_deref_mut());
            let loss = loss.div_scalar(total as f64);
            let grads = GradientsParams::from_grads(loss.backward(), model);
            (loss.detach(), tokens, grads)
        }),
    )
}

/// `live` raised to the bytes of live tensors on `device` now, where both are there. The
/// allocator answers in the order of the ops queued before (which allocate as they are queued),
/// without waiting for the device to run them.
fn note_live(device: &Device, live: Option<&mut u64>) {
    if let Some(live) = live
        && let Some(usage) = device.memory_pool_usage()
    {
        *live = (*live).max(usage.bytes_in_use);
    }
}

/// Sums micro-batches' (loss, tokens, gradients), in the order given: the step's loss (each
/// micro-batch loss already divided by their number), tokens and gradients.
pub(crate) fn combine<M: Module>(
    model: &M,
    micros: impl IntoIterator<Item = (Tensor<1>, usize, GradientsParams)>,
) -> (Tensor<1>, usize, GradientsParams) {
    let mut acc = GradientsAccumulator::<M>::new();
    let mut total: Option<Tensor<1>> = None;
    let mut tokens = 0;
    for (loss, t, grads) in micros {
        acc.accumulate(model, grads);
        total = Some(match total {
            Some(sum) => sum + loss,
            None => loss,
        });
        tokens += t;
    }
    (
        total.expect("at least one micro-batch"),
        tokens,
        acc.grads(),
    )
}

/// The device a model's parameters live on.
pub(crate) fn param_device<M: Module>(model: &M) -> Device {
    model
        .devices()
        .into_iter()
        .next()
        .expect("a model has parameters on some device")
}
