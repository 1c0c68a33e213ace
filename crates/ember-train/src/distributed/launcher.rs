//! Where this process stands in a run launched across processes: its rank, the world's size,
//! its place on its machine and the rendezvous address, read from the environment the usual
//! launchers set (`torchrun`, Open MPI's `mpirun`, Slurm's `srun`).

use crate::error::{Result, TrainError};

/// The rendezvous port when `MASTER_PORT` is not set (`torchrun`'s default).
pub const DEFAULT_PORT: u16 = 29500;

/// This process's place in a run across processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ranks {
    /// This process's rank, `0..size`; rank 0 logs, evaluates and saves.
    pub rank: usize,
    /// The number of processes.
    pub size: usize,
    /// This process's rank among those on its machine: its GPU (`cuda:LOCAL_RANK`).
    pub local_rank: usize,
    /// The number of processes on this machine.
    pub local_size: usize,
    /// Rank 0's address for the rendezvous (`MASTER_ADDR`; `127.0.0.1` where every rank is on
    /// one machine and it is not set).
    pub master_addr: Option<String>,
    /// Rank 0's rendezvous port (`MASTER_PORT`, else [`DEFAULT_PORT`]).
    pub master_port: u16,
    /// Which launcher's variables these came from (for messages).
    pub launcher: &'static str,
}

/// The variables each launcher sets: (launcher, rank, size, local rank, local size); the first
/// launcher whose rank and size are both set wins. Slurm's are read only inside a job step
/// (`SLURM_STEP_ID`: `srun`), not in a batch script, which has them for the whole job.
const LAUNCHERS: [(&str, &str, &str, &str, &str); 4] = [
    (
        "torchrun",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
    ),
    (
        "mpirun",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    (
        "MPI (PMI)",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
    ),
    (
        "srun",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NTASKS_PER_NODE",
    ),
];

impl Ranks {
    /// This process's place from the environment, or `None` where no launcher started it.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Ranks::from_env`] over any source of variables (tests pass a map).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        for (launcher, rank, size, local_rank, local_size) in LAUNCHERS {
            if launcher == "srun" && var("SLURM_STEP_ID").is_none() {
                continue;
            }
            let (Some(rank_text), Some(size_text)) = (var(rank), var(size)) else {
                continue;
            };
            let number = |name: &str, text: &str| -> Result<usize> {
                text.trim().parse::<usize>().map_err(|_| {
                    TrainError::Distributed(format!(
                        "{name}={text:?} (set by {launcher}) is not a whole number"
                    ))
                })
            };
            let size_n = number(size, &size_text)?;
            let rank_n = number(rank, &rank_text)?;
            if size_n == 0 || rank_n >= size_n {
                return Err(TrainError::Distributed(format!(
                    "{rank}={rank_n} is not a rank of {size}={size_n} (ranks are 0 to {size} - 1)"
                )));
            }
            let local = |name: &str, default: usize| -> Result<usize> {
                match var(name) {
                    // Slurm writes per-node task counts as e.g. "4(x2)": the first figure.
                    Some(text) => number(name, text.split('(').next().unwrap_or("")),
                    None => Ok(default),
                }
            };
            let local_rank_n = local(local_rank, rank_n)?;
            let local_size_n = local(local_size, size_n)?;
            if local_rank_n >= local_size_n.max(1) {
                return Err(TrainError::Distributed(format!(
                    "{local_rank}={local_rank_n} is not below {local_size}={local_size_n}"
                )));
            }
            let master_addr = var("MASTER_ADDR")
                .filter(|a| !a.trim().is_empty())
                .or_else(|| (local_size_n == size_n).then(|| "127.0.0.1".to_string()));
            let master_port = match var("MASTER_PORT") {
                Some(text) => text.trim().parse::<u16>().map_err(|_| {
                    TrainError::Distributed(format!("MASTER_PORT={text:?} is not a port number"))
                })?,
                None => DEFAULT_PORT,
            };
            return Ok(Some(Self {
                rank: rank_n,
                size: size_n,
                local_rank: local_rank_n,
                local_size: local_size_n,
                master_addr,
                master_port,
                launcher,
            }));
        }
        Ok(None)
    }

    /// Whether this is rank 0, the one that logs, evaluates and saves.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    /// `host:port` of the rendezvous, or why there is none (ranks on several machines without
    /// `MASTER_ADDR`).
    pub fn rendezvous_addr(&self) -> Result<String> {
        match &self.master_addr {
            Some(host) => Ok(format!("{host}:{}", self.master_port)),
            None => Err(TrainError::Distributed(format!(
                "{} ranks on several machines need MASTER_ADDR (rank 0's host name or address) \
                 and MASTER_PORT in every rank's environment",
                self.size
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn ranks(pairs: &[(&str, &str)]) -> Result<Option<Ranks>> {
        let vars: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Ranks::from_vars(|name| vars.get(name).cloned())
    }

    #[test]
    fn torchrun_s_variables_give_rank_device_and_rendezvous() {
        let r = ranks(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((r.rank, r.size, r.local_rank, r.local_size), (3, 8, 1, 4));
        assert_eq!(r.rendezvous_addr().unwrap(), "node0:1234");
        assert!(!r.is_main());
        assert_eq!(r.launcher, "torchrun");
    }

    #[test]
    fn mpirun_on_one_machine_needs_no_master_address() {
        let r = ranks(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(r.rendezvous_addr().unwrap(), "127.0.0.1:29500");
        assert!(r.is_main());
        // On two machines without MASTER_ADDR: one line saying what to set.
        let r = ranks(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap()
        .unwrap();
        let e = r.rendezvous_addr().unwrap_err().to_string();
        assert!(e.contains("MASTER_ADDR"), "{e}");
    }

    #[test]
    fn slurm_counts_only_inside_a_job_step() {
        let batch = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS_PER_NODE", "2(x2)"),
        ];
        assert_eq!(ranks(&batch).unwrap(), None);
        let mut step = batch.to_vec();
        step.push(("SLURM_STEP_ID", "0"));
        let r = ranks(&step).unwrap().unwrap();
        assert_eq!((r.size, r.local_size), (4, 2));
    }

    #[test]
    fn no_launcher_means_one_process_and_bad_values_one_line() {
        assert_eq!(ranks(&[]).unwrap(), None);
        let e = ranks(&[("RANK", "2"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "RANK=2 is not a rank of WORLD_SIZE=2 (ranks are 0 to WORLD_SIZE - 1)"
        );
        let e = ranks(&[("RANK", "x"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("RANK=\"x\""), "{e}");
        let e = ranks(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "http")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("MASTER_PORT"), "{e}");
    }
}
