//! The collective engine of CUDA devices (feature `nccl`): NCCL, on the stream ember's kernels
//! run on ([`ember_kernels::nccl`]); rank 0 makes the communicator's id and the rendezvous
//! hands it to the others.

use burn::tensor::{Device, Tensor};
use ember_kernels::nccl::{Communicator, UniqueId};

use super::Engine;
use crate::error::{Result, TrainError};

/// One rank's NCCL communicator.
pub(super) struct Nccl {
    comm: Communicator,
    library: String,
}

/// A new communicator id (rank 0's, handed out at the rendezvous).
pub(super) fn unique_id() -> Result<Vec<u8>> {
    ember_kernels::nccl::unique_id()
        .map(|id| id.to_vec())
        .map_err(|e| TrainError::Distributed(format!("NCCL: {e}")))
}

impl Nccl {
    /// Joins the communicator of `id` as `rank` of `size`, on `device`.
    pub(super) fn join(id: &[u8], size: usize, rank: usize, device: &Device) -> Result<Self> {
        let id: UniqueId = id.try_into().map_err(|_| {
            TrainError::Distributed(format!(
                "NCCL: rank 0 handed out {} bytes, not 128",
                id.len()
            ))
        })?;
        let library = ember_kernels::nccl::describe()
            .map_err(|e| TrainError::Distributed(format!("NCCL: {e}")))?;
        let like = Tensor::<1>::zeros([1], device);
        let comm = Communicator::join(&id, size, rank, &like)
            .map_err(|e| TrainError::Distributed(format!("NCCL on {device:?}: {e}")))?;
        Ok(Self { comm, library })
    }
}

impl Engine for Nccl {
    fn name(&self) -> String {
        self.library.clone()
    }

    fn all_reduce_sum(&self, x: Tensor<1>) -> Result<Tensor<1>> {
        self.comm
            .all_reduce_sum(x)
            .map_err(|e| TrainError::Distributed(format!("NCCL: {e}")))
    }

    fn all_reduce_sum_each(&self, xs: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>> {
        self.comm
            .all_reduce_sum_each(xs)
            .map_err(|e| TrainError::Distributed(format!("NCCL: {e}")))
    }

    fn broadcast(&self, x: Tensor<1>) -> Result<Tensor<1>> {
        self.comm
            .broadcast(x, 0)
            .map_err(|e| TrainError::Distributed(format!("NCCL: {e}")))
    }
}
