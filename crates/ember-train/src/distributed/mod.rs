//! Training across processes: one process per device, launched as `torchrun` (or `mpirun`,
//! `srun`) launches them, each step's gradients summed over the processes by an established
//! collective library: NCCL on CUDA devices (feature `nccl`, in the binary's `cuda` build), MPI
//! on the others (feature `mpi`).
//!
//! The scheme is nanoGPT's and PyTorch DDP's. A step's micro-batches are numbered globally,
//! `0 .. grad_accum x world size`; rank `r` runs `r x grad_accum .. (r + 1) x grad_accum`, each
//! drawn from the seed, the step and its number (as one process draws them), each loss divided
//! by the global count. The ranks' gradients, the loss, the tokens and the stop flag travel in
//! one flattened buffer, summed by one collective ([`World::all_reduce_step`]); every rank then
//! holds the same gradients and takes the same optimizer step, so the weights stay equal
//! without being sent (they are compared once at the start: [`World::check_same_weights`]).
//! Rank 0 alone logs, evaluates, plots and writes checkpoints; the others wait for it after an
//! evaluation or a save, where it tells them whether the run stops early ([`World::decide`]).
//!
//! [`launcher`] reads the launcher's variables, [`rendezvous`] meets the ranks and watches
//! them (a rank that ends ends them all, in one line), and each engine file binds a library.

pub mod launcher;
#[cfg(feature = "mpi")]
mod mpi_engine;
#[cfg(feature = "nccl")]
mod nccl_engine;
pub mod rendezvous;

pub use launcher::Ranks;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

use crate::error::{Result, TrainError};
use rendezvous::Link;

/// A fingerprint of a run's resolved config (its TOML), equal on every rank launched with the
/// same config and overrides (the standard library's SipHash with its fixed keys).
pub fn fingerprint(config_toml: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    config_toml.hash(&mut hasher);
    hasher.finish()
}

/// A collective library's two operations, on flattened `f32` buffers of one length on every
/// rank.
pub(crate) trait Engine: Send + Sync {
    /// The library and its version, for the start-up line.
    fn name(&self) -> String;
    /// The sum over every rank of `x`, on every rank.
    fn all_reduce_sum(&self, x: Tensor<1>) -> Result<Tensor<1>>;
    /// Rank 0's `x`, on every rank.
    fn broadcast(&self, x: Tensor<1>) -> Result<Tensor<1>>;
    /// [`Engine::all_reduce_sum`] of each of `xs` (of one device); by default packed into one
    /// buffer, summed, and cut back.
    fn all_reduce_sum_each(&self, xs: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>> {
        let lengths: Vec<usize> = xs.iter().map(|x| x.dims()[0]).collect();
        let summed = self.all_reduce_sum(Tensor::cat(xs, 0))?;
        let mut at = 0;
        Ok(lengths
            .into_iter()
            .map(|n| {
                at += n;
                summed.clone().slice(at - n..at)
            })
            .collect())
    }
}

/// This process's membership of a run across processes.
pub struct World {
    /// Where this process stands.
    pub ranks: Ranks,
    engine: Box<dyn Engine>,
    link: Link,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "World({:?}, {})", self.ranks, self.engine.name())
    }
}

impl World {
    /// Meets the other ranks (the rendezvous, [`rendezvous::timeout`]) and starts the collective
    /// library for `device` (named `device_name` in the config): NCCL for CUDA devices, MPI for
    /// the others. `fingerprint` must be equal on every rank (the run's config).
    pub fn join(
        ranks: Ranks,
        device: &Device,
        device_name: &str,
        fingerprint: u64,
    ) -> Result<Self> {
        let timeout = rendezvous::timeout()?;
        let nccl = device_name.starts_with("cuda");
        Self::engine_available(nccl, device_name)?;
        // Rank 0 makes NCCL's id; where it cannot, every rank hears why at the rendezvous.
        let payload: std::result::Result<Vec<u8>, String> = match (nccl, ranks.is_main()) {
            #[cfg(feature = "nccl")]
            (true, true) => {
                nccl_engine::unique_id().map_err(|e| format!("rank 0 cannot start NCCL: {e}"))
            }
            _ => Ok(Vec::new()),
        };
        let (link, payload) = Link::join(
            &ranks,
            fingerprint,
            payload.as_deref().map_err(Clone::clone),
            timeout,
        )?;
        let engine = Self::start_engine(nccl, &ranks, device, &payload)?;
        Ok(Self {
            ranks,
            engine,
            link,
        })
    }

    /// Whether this build has the engine a device needs; else one line saying which feature.
    fn engine_available(nccl: bool, device_name: &str) -> Result<()> {
        // Which engine this build has for the device (cfg! values, so not a plain bool).
        const NCCL: bool = cfg!(feature = "nccl");
        const MPI: bool = cfg!(feature = "mpi");
        let built = (nccl && NCCL) || (!nccl && MPI);
        match (built, nccl) {
            (true, _) => Ok(()),
            (false, true) => Err(TrainError::Distributed(format!(
                "training {device_name} across processes needs NCCL, and this ember was built \
                 without it (the `cuda` feature of ember-cli brings it)"
            ))),
            (false, false) => Err(TrainError::Distributed(format!(
                "training {device_name} across processes needs MPI, and this ember was built \
                 without it (build with `--features mpi`, with Open MPI or MPICH installed)"
            ))),
        }
    }

    #[allow(unused_variables)]
    fn start_engine(
        nccl: bool,
        ranks: &Ranks,
        device: &Device,
        payload: &[u8],
    ) -> Result<Box<dyn Engine>> {
        #[cfg(feature = "nccl")]
        if nccl {
            return Ok(Box::new(nccl_engine::Nccl::join(
                payload, ranks.size, ranks.rank, device,
            )?));
        }
        #[cfg(feature = "mpi")]
        if !nccl {
            return Ok(Box::new(mpi_engine::Mpi::start(ranks)?));
        }
        unreachable!("engine_available checked the build")
    }

    /// Whether this is rank 0 (it logs, evaluates and saves).
    pub fn is_main(&self) -> bool {
        self.ranks.is_main()
    }

    /// The number of processes.
    pub fn size(&self) -> usize {
        self.ranks.size
    }

    /// The collective library, for the start-up line.
    pub fn engine_name(&self) -> String {
        self.engine.name()
    }

    /// Says this rank is done: the others take its end for a clean one.
    pub fn finish(&self) {
        self.link.finish();
    }

    /// Sums one step's share over every rank in one collective: the gradients (each flattened;
    /// NCCL sums them where they lie, in one group; MPI in one packed buffer), the loss (each
    /// micro-batch's already divided by the step's global count) and `extra` (tokens, a stop
    /// flag: summed as `f32`, exact below 2^24). Returns the summed loss `[1]`, the summed
    /// extras (on the device; read them when needed) and the gradients.
    pub(crate) fn all_reduce_step<M: Module>(
        &self,
        model: &M,
        loss: Tensor<1>,
        extra: &[f32],
        mut grads: GradientsParams,
    ) -> Result<(Tensor<1>, Tensor<1>, GradientsParams)> {
        let mut take = Take {
            grads: &mut grads,
            parts: Vec::new(),
            layout: Vec::new(),
        };
        model.visit(&mut take);
        let (mut parts, layout) = (take.parts, take.layout);
        let loss = loss.inner().reshape([1]);
        let device = loss.device();
        parts.push(Tensor::cat(
            vec![loss, Tensor::from_floats(extra, &device)],
            0,
        ));
        let mut summed = self.engine.all_reduce_sum_each(parts)?;
        let tail = summed.pop().expect("the loss and extras were pushed last");
        let mut put = Put {
            summed: summed.into_iter(),
            layout: layout.into_iter().peekable(),
            grads: &mut grads,
        };
        model.visit(&mut put);
        let loss = tail.clone().slice(0..1);
        let extra = tail.slice(1..1 + extra.len());
        Ok((loss, extra, grads))
    }

    /// Rank 0's `values` on every rank (rank 0's decision after an evaluation: stop early or
    /// not); also where the others wait while rank 0 evaluates and saves.
    pub(crate) fn decide(&self, values: &[f32], device: &Device) -> Result<Vec<f32>> {
        let x = Tensor::<1>::from_floats(values, device);
        self.engine
            .broadcast(x)?
            .try_into_vec_as::<f32>()
            .map_err(|e| TrainError::Distributed(format!("read rank 0's decision: {e:?}")))
    }

    /// Checks that every rank starts from rank 0's weights (the same config, seed and
    /// checkpoint give the same weights; anything else would train a different model per
    /// rank); one line naming the rank where not.
    pub(crate) fn check_same_weights<M: Module>(&self, model: &M) -> Result<()> {
        let mut all = Weights(Vec::new());
        model.visit(&mut all);
        let Some(first) = all.0.first() else {
            return Ok(());
        };
        let device = first.device();
        let mine = Tensor::cat(all.0, 0);
        let theirs = self.engine.broadcast(mine.clone())?;
        let differ = mine.not_equal(theirs).int().sum().into_scalar::<i64>();
        // Every rank learns whether any differs, so that all stop together.
        let flag = Tensor::<1>::from_floats([(differ > 0) as u8 as f32], &device);
        let ranks_differing = self.engine.all_reduce_sum(flag)?.into_scalar::<f32>();
        if differ > 0 {
            return Err(TrainError::Distributed(format!(
                "rank {} starts from other weights than rank 0 ({differ} values differ): every \
                 rank needs the same config, seed and checkpoint",
                self.ranks.rank
            )));
        }
        if ranks_differing > 0.0 {
            return Err(TrainError::Distributed(format!(
                "{ranks_differing} rank(s) start from other weights than rank 0; rank {} stops",
                self.ranks.rank
            )));
        }
        Ok(())
    }
}

/// Every gradient of a model's parameters taken out of `grads`, flattened (so that each is the
/// only holder of its buffer), with its parameter and shape.
struct Take<'a> {
    grads: &'a mut GradientsParams,
    parts: Vec<Tensor<1>>,
    layout: Vec<(ParamId, Vec<usize>)>,
}

impl ModuleVisitor for Take<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(grad) = self.grads.remove::<D>(param.id) {
            let dims = grad.dims().to_vec();
            self.parts.push(ember_kernels::cast_to(
                grad.reshape([-1]),
                burn::tensor::DType::F32,
            ));
            self.layout.push((param.id, dims));
        }
    }
}

/// The summed gradients put back, in the order [`Take`] took them.
struct Put<'a, I: Iterator<Item = Tensor<1>>> {
    summed: I,
    layout: std::iter::Peekable<std::vec::IntoIter<(ParamId, Vec<usize>)>>,
    grads: &'a mut GradientsParams,
}

impl<I: Iterator<Item = Tensor<1>>> ModuleVisitor for Put<'_, I> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.layout.peek().is_none_or(|(id, _)| *id != param.id) {
            return;
        }
        let (id, dims) = self.layout.next().expect("peeked");
        let dims: [usize; D] = dims
            .try_into()
            .expect("the gradient's rank is its parameter's");
        let grad = self.summed.next().expect("one sum per gradient");
        self.grads.register(id, grad.reshape(dims));
    }
}

/// Every weight of a model, flattened (without autodiff).
struct Weights(Vec<Tensor<1>>);

impl ModuleVisitor for Weights {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let weight = param.val().inner().reshape([-1]);
        self.0
            .push(ember_kernels::cast_to(weight, burn::tensor::DType::F32));
    }
}
