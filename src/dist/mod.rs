//! Training over several processes: one per GPU (or CPU worker), on one machine or many.
//!
//! - [`ProcessGroup`]: rank, world size, in-place sums and broadcasts of tensors, sums of
//!   small host values, barriers, failure reports. [`TcpGroup`] is the group over TCP (the
//!   CPU implementation, and the rendezvous and control plane of every group); [`NcclGroup`]
//!   adds NCCL for the GPUs' tensors.
//! - [`Launch`]: where this process sits, from the environment torchrun and Slurm scripts
//!   set (`MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`, `LOCAL_RANK`).
//! - [`GradReducer`]: data-parallel gradient sums in buckets, started as the backward
//!   finishes each bucket's gradients and overlapped with the rest of it.

#[cfg(feature = "cuda")]
mod nccl;
mod reducer;
mod tcp;

#[cfg(feature = "cuda")]
pub use nccl::{nccl_available, nccl_unique_id, NcclComm};
pub use reducer::{GradReducer, BUCKET_BYTES};
pub use tcp::{free_port, AbortCause, OnAbort, TcpGroup};

use crate::{Device, Error, Result, Tensor};
use std::sync::Arc;
use std::time::Duration;

/// A collective started on the device: [`Pending::wait`] orders the device's later work
/// after it (on the CPU, collectives finish before they return).
#[must_use = "a collective's results are not ordered before later work until it is waited on"]
pub struct Pending(PendingInner);

enum PendingInner {
    Done,
    Deferred(Box<dyn FnOnce() -> Result<()> + Send>),
    #[cfg(feature = "cuda")]
    Cuda(crate::backend::cuda::CudaDevice, cudarc::driver::CudaEvent),
}

impl Pending {
    /// A collective that has already finished.
    pub fn done() -> Pending {
        Pending(PendingInner::Done)
    }

    /// A collective that `finish` completes when it is waited on (a group that queues its
    /// work, as NCCL does on the device, can be built on it and tested on the CPU).
    pub fn deferred(finish: impl FnOnce() -> Result<()> + Send + 'static) -> Pending {
        Pending(PendingInner::Deferred(Box::new(finish)))
    }

    /// Orders the device's later work after the collective (no host wait on a GPU).
    pub fn wait(self) -> Result<()> {
        match self.0 {
            PendingInner::Done => Ok(()),
            PendingInner::Deferred(f) => f(),
            #[cfg(feature = "cuda")]
            PendingInner::Cuda(dev, e) => dev
                .stream()
                .wait(&e)
                .map_err(|e| Error::Cuda(format!("waiting for a collective: {e:?}"))),
        }
    }
}

/// A group of processes that train together; every rank calls the same collectives in the
/// same order.
pub trait ProcessGroup: Send + Sync {
    /// This process's rank, from 0.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world(&self) -> usize;
    /// Sums each tensor over the ranks, in place: every rank ends with the same values.
    /// The tensors must stay alive until the returned [`Pending`] is waited on.
    fn all_reduce_sum(&self, tensors: &[&Tensor]) -> Result<Pending>;
    /// Whether `all_reduce_sum` only queues the collective on the device (NCCL) rather than
    /// finishing it before it returns (TCP).
    fn asynchronous(&self) -> bool;
    /// Rank 0's values of each tensor on every rank, in place (finished on return, in the
    /// device's order).
    fn broadcast(&self, tensors: &[&Tensor]) -> Result<()>;
    /// Sums small host values over the ranks (losses, flags): the same bits on every rank.
    fn sum_host(&self, values: &mut [f64]) -> Result<()>;
    /// Waits until every rank is here.
    fn barrier(&self) -> Result<()> {
        self.sum_host(&mut [])
    }
    /// Tells the other ranks that this one failed, and why (before it exits).
    fn fail(&self, why: &str);
    /// Runs `on_abort` (on another thread) with a message naming the rank when another
    /// rank fails, exits early or is killed.
    fn watch(&self, on_abort: OnAbort) -> Result<()>;
    /// One line: the rank, the world and the transport.
    fn describe(&self) -> String;
}

/// Where this process sits in a run of several, from the launcher's environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// `RANK`: this process's rank among all.
    pub rank: usize,
    /// `WORLD_SIZE`: the number of processes.
    pub world: usize,
    /// `LOCAL_RANK`: its rank on this machine (which GPU it takes, see `gpus`).
    pub local_rank: usize,
    /// The processes of the run on this machine: `LOCAL_WORLD_SIZE` (torchrun sets it),
    /// else as many as `gpus` names, else `world` (the `train --gpus` launcher starts every
    /// rank here). They share its host memory.
    pub local_world: usize,
    /// `MASTER_ADDR`: where rank 0 listens.
    pub addr: String,
    /// `MASTER_PORT`.
    pub port: u16,
    /// `FLAME_GPUS`: the GPUs of this machine's ranks, by local rank (empty: GPU
    /// `LOCAL_RANK`). The `train --gpus` launcher sets it.
    pub gpus: Vec<usize>,
    /// `FLAME_DIST_TIMEOUT` (seconds, default 600): how long ranks wait for each other to
    /// join.
    pub timeout: Duration,
    /// `FLAME_STALL_TIMEOUT` (seconds, default [`DEFAULT_STALL_S`]; 0: never): how long a
    /// rank may make no progress while the others wait for it, or send no heartbeat, before
    /// every rank stops with a message naming it.
    pub stall: Option<Duration>,
}

/// The default stall limit: 15 minutes, longer than any single piece of work FLAME does
/// without a sign of progress (a checkpoint write, a first kernel compile, one step of the
/// largest model streamed from host memory).
pub const DEFAULT_STALL_S: u64 = 900;

/// torchrun's default port.
pub const DEFAULT_PORT: u16 = 29500;

fn env_err(var: &str, value: &str, why: &str) -> Error {
    Error::Config {
        path: None,
        msg: format!("environment variable {var} = {value:?}: {why}"),
    }
}

impl Launch {
    /// Reads the environment: `None` when `WORLD_SIZE` is unset or 1 (a single process);
    /// an error naming the variable when one is malformed or missing.
    pub fn from_env() -> Result<Option<Launch>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`Launch::from_env`] over any variable lookup (tests).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        let num = |k: &str| -> Result<Option<usize>> {
            match get(k) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse::<usize>()
                    .map(Some)
                    .map_err(|_| env_err(k, &v, "not a whole number")),
            }
        };
        let Some(world) = num("WORLD_SIZE")? else {
            return Ok(None);
        };
        if world <= 1 {
            return Ok(None);
        }
        let rank = num("RANK")?.ok_or_else(|| env_err("RANK", "", "unset while WORLD_SIZE is"))?;
        if rank >= world {
            return Err(env_err("RANK", &rank.to_string(), "not below WORLD_SIZE"));
        }
        let local_rank = num("LOCAL_RANK")?.unwrap_or(rank);
        let port = match get("MASTER_PORT") {
            None => DEFAULT_PORT,
            Some(v) => v
                .trim()
                .parse::<u16>()
                .map_err(|_| env_err("MASTER_PORT", &v, "not a port number"))?,
        };
        let gpus = match get("FLAME_GPUS") {
            None => vec![],
            Some(v) => v
                .split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|s| s.trim().parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|_| env_err("FLAME_GPUS", &v, "not a list of GPU numbers"))?,
        };
        let local_world = match num("LOCAL_WORLD_SIZE")? {
            Some(n) if n > 0 => n,
            _ if !gpus.is_empty() => gpus.len(),
            _ => world,
        };
        let timeout = Duration::from_secs(num("FLAME_DIST_TIMEOUT")?.unwrap_or(600) as u64);
        let stall = match num("FLAME_STALL_TIMEOUT")?.unwrap_or(DEFAULT_STALL_S as usize) {
            0 => None,
            s => Some(Duration::from_secs(s as u64)),
        };
        Ok(Some(Launch {
            rank,
            world,
            local_rank,
            local_world,
            addr: get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            port,
            gpus,
            timeout,
            stall,
        }))
    }

    /// The GPU this rank trains on.
    pub fn gpu(&self) -> Result<usize> {
        if self.gpus.is_empty() {
            return Ok(self.local_rank);
        }
        self.gpus.get(self.local_rank).copied().ok_or_else(|| {
            env_err(
                "LOCAL_RANK",
                &self.local_rank.to_string(),
                &format!("FLAME_GPUS lists only {:?}", self.gpus),
            )
        })
    }

    /// Joins the group: TCP for the CPU, NCCL (over the TCP rendezvous) for a GPU.
    pub fn join(&self, device: &Device) -> Result<Arc<dyn ProcessGroup>> {
        let tcp = TcpGroup::connect(&self.addr, self.port, self.rank, self.world, self.timeout)?
            .stall_after(self.stall);
        #[cfg(feature = "cuda")]
        #[allow(irrefutable_let_patterns)]
        if let Device::Cuda(d) = device {
            return Ok(Arc::new(NcclGroup::new(tcp, d)?));
        }
        let _ = device;
        Ok(Arc::new(tcp))
    }
}

/// The group of GPU ranks: NCCL for tensors, [`TcpGroup`] for the rest.
#[cfg(feature = "cuda")]
pub struct NcclGroup {
    ctl: TcpGroup,
    comm: NcclComm,
    dev: crate::backend::cuda::CudaDevice,
}

#[cfg(feature = "cuda")]
impl NcclGroup {
    /// Builds the communicator over `ctl` (rank 0 makes the NCCL id and sends it); every
    /// rank first says whether it can load NCCL, so a missing library fails everywhere, by
    /// rank, instead of hanging the others.
    pub fn new(ctl: TcpGroup, dev: &crate::backend::cuda::CudaDevice) -> Result<NcclGroup> {
        let mut missing = vec![0.0; ctl.world()];
        if !nccl_available() {
            missing[ctl.rank()] = 1.0;
        }
        ctl.sum_host(&mut missing)?;
        let without: Vec<usize> = (0..missing.len()).filter(|&r| missing[r] > 0.0).collect();
        if !without.is_empty() {
            return Err(Error::Dist(format!(
                "ranks {without:?} cannot load libnccl.so: install NCCL there and put its \
                 folder on LD_LIBRARY_PATH"
            )));
        }
        let mut id = vec![0.0; 128];
        if ctl.rank() == 0 {
            for (v, b) in id.iter_mut().zip(nccl_unique_id()?) {
                *v = b as f64;
            }
        }
        ctl.sum_host(&mut id)?;
        let mut raw = [0u8; 128];
        for (b, v) in raw.iter_mut().zip(&id) {
            *b = *v as u8;
        }
        let comm = NcclComm::new(dev, raw, ctl.rank(), ctl.world())?;
        Ok(NcclGroup {
            ctl,
            comm,
            dev: dev.clone(),
        })
    }
}

#[cfg(feature = "cuda")]
impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.ctl.rank()
    }
    fn world(&self) -> usize {
        self.ctl.world()
    }
    fn all_reduce_sum(&self, tensors: &[&Tensor]) -> Result<Pending> {
        crate::progress::entered_collective();
        let e = self.comm.all_reduce_sum(tensors)?;
        Ok(Pending(PendingInner::Cuda(self.dev.clone(), e)))
    }
    fn asynchronous(&self) -> bool {
        true
    }
    fn broadcast(&self, tensors: &[&Tensor]) -> Result<()> {
        crate::progress::entered_collective();
        let e = self.comm.broadcast(tensors)?;
        self.comm.wait(&e)
    }
    fn sum_host(&self, values: &mut [f64]) -> Result<()> {
        self.ctl.sum_host(values)
    }
    fn fail(&self, why: &str) {
        self.ctl.fail(why)
    }
    fn watch(&self, on_abort: OnAbort) -> Result<()> {
        self.ctl.start_watchdog(on_abort)
    }
    fn describe(&self) -> String {
        format!(
            "rank {} of {} (NCCL on {:?})",
            self.ctl.rank(),
            self.ctl.world(),
            self.dev
        )
    }
}

/// The rows of a global batch of `n` that rank `rank` of `world` takes: contiguous parts,
/// the first `n % world` ranks one row more.
pub fn shard(n: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
    let world = world.max(1);
    let (q, r) = (n / world, n % world);
    let start = rank * q + rank.min(r);
    let len = q + usize::from(rank < r);
    start..(start + len).min(n)
}
