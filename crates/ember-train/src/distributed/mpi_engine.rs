//! The collective engine of CPU devices (feature `mpi`): MPI through the `mpi` crate (Open MPI,
//! MPICH), launched by `mpirun` (or `srun` with MPI's Slurm support). The buffers go through
//! host memory, which on CPU devices is where they are.

use std::sync::Mutex;

use burn::tensor::{Tensor, TensorData};
use mpi::collective::SystemOperation;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};

use super::Engine;
use super::launcher::Ranks;
use crate::error::{Result, TrainError};

/// MPI's world communicator, and MPI itself (finalized when this is dropped).
pub(super) struct Mpi {
    world: Mutex<SimpleCommunicator>,
    _universe: mpi::environment::Universe,
}

// SAFETY: MPI is initialized with `MPI_THREAD_SERIALIZED` at least, and every call goes through
// the lock of `world`: one thread at a time.
unsafe impl Send for Mpi {}
unsafe impl Sync for Mpi {}

impl Mpi {
    /// Initializes MPI and checks that its world is the launcher's.
    pub(super) fn start(ranks: &Ranks) -> Result<Self> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| TrainError::Distributed("MPI was initialized twice".into()))?;
        if threading < mpi::Threading::Serialized {
            return Err(TrainError::Distributed(format!(
                "this MPI offers only {threading:?} threading; ember needs Serialized"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        if (rank, size) != (ranks.rank, ranks.size) {
            return Err(TrainError::Distributed(format!(
                "MPI sees rank {rank} of {size} where {} says rank {} of {}: CPU devices train \
                 across processes through MPI, so launch them with mpirun (or srun with MPI \
                 support), not {}",
                ranks.launcher, ranks.rank, ranks.size, ranks.launcher
            )));
        }
        Ok(Self {
            world: Mutex::new(world),
            _universe: universe,
        })
    }
}

/// `x`'s values on the host.
fn host(x: Tensor<1>) -> Result<Vec<f32>> {
    x.try_into_vec_as::<f32>()
        .map_err(|e| TrainError::Distributed(format!("read a buffer for MPI: {e:?}")))
}

impl Engine for Mpi {
    fn name(&self) -> String {
        let (major, minor) = mpi::environment::version();
        let library = mpi::environment::library_version().unwrap_or_default();
        // The library's own words, first line, without the C string's end.
        let library = library
            .lines()
            .next()
            .unwrap_or("")
            .trim_end_matches('\0')
            .trim();
        format!("MPI {major}.{minor} ({library})")
    }

    fn all_reduce_sum(&self, x: Tensor<1>) -> Result<Tensor<1>> {
        let device = x.device();
        let mine = host(x)?;
        let mut sum = vec![0f32; mine.len()];
        let world = self.world.lock().unwrap_or_else(|e| e.into_inner());
        world.all_reduce_into(&mine[..], &mut sum[..], SystemOperation::sum());
        Ok(Tensor::from_data(
            TensorData::new(sum, [mine.len()]),
            &device,
        ))
    }

    fn broadcast(&self, x: Tensor<1>) -> Result<Tensor<1>> {
        let device = x.device();
        let mut values = host(x)?;
        let world = self.world.lock().unwrap_or_else(|e| e.into_inner());
        world.process_at_rank(0).broadcast_into(&mut values[..]);
        let n = values.len();
        Ok(Tensor::from_data(TensorData::new(values, [n]), &device))
    }
}
