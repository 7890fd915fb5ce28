//! Data parallelism: which rank of how many this process is, and the collectives the trainer
//! needs across ranks — summing host numbers, gathering bytes, broadcasting, a barrier, and
//! summing the flat gradient of a model. One process is [`Single`] (every collective is the
//! identity); a job launched by `mpirun` or Slurm's `srun` is an MPI world (feature `mpi`), whose
//! gradients are summed by MPI on the host or, for a model on a CUDA device, by NCCL (feature
//! `nccl`, its unique id broadcast over MPI). Sharded training adds reduce-scatter and
//! all-gather of equal parts, and [`shard`] says which part of a flat vector is a rank's. It does
//! not decide what is reduced: that is the trainer's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;

#[cfg(feature = "mpi")]
mod mpi_world;
#[cfg(feature = "nccl")]
mod nccl;
pub mod shard;

/// Errors of a collective or of joining the world; each names the operation.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// Joining the world failed (MPI init, or a multi-rank launch without the `mpi` feature).
    #[error("{0}")]
    Launch(String),
    /// A collective failed on the MPI or NCCL backend.
    #[error("{op}: {reason}")]
    Collective {
        /// Name of the failed operation (an MPI or NCCL call).
        op: &'static str,
        /// What went wrong, as the backend reported it.
        reason: String,
    },
    /// Moving a tensor to or from the host failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// The collectives of a data-parallel world. Every rank must call each collective in the same
/// order with buffers of the same length; the results are the same on every rank.
pub trait Collective: Send + Sync {
    /// This process's rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// What carries the collectives, for the log (`single`, `mpi`, `mpi+nccl`).
    fn backend(&self) -> &'static str;
    /// Whether this is a process on its own ([`Single`]), where the trainer skips every
    /// collective; a launched world of one rank still runs them (which tests the backend).
    fn is_single_process(&self) -> bool {
        false
    }
    /// Element-wise sum over ranks, in place.
    fn all_reduce_f64(&self, values: &mut [f64]) -> Result<(), DistError>;
    /// Element-wise sum over ranks, in place.
    fn all_reduce_f32(&self, values: &mut [f32]) -> Result<(), DistError>;
    /// This rank's block of the element-wise sum over ranks of `values`, whose length is
    /// `size()` blocks of equal length (MPI's reduce-scatter-block).
    fn reduce_scatter_f32(&self, values: &[f32]) -> Result<Vec<f32>, DistError>;
    /// Every rank's `mine`, each of the same length, concatenated in rank order.
    fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>, DistError>;
    /// Every rank's bytes, in rank order.
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, DistError>;
    /// Rank 0's bytes on every rank (`bytes` is replaced on the others).
    fn broadcast_bytes(&self, bytes: &mut Vec<u8>) -> Result<(), DistError>;
    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<(), DistError>;
    /// The sum over ranks of a flat `f32` gradient (a 1-D tensor on the model's device). The
    /// default goes through the host; a device backend (NCCL) keeps it on the device.
    fn all_reduce_tensor(&self, flat: &Tensor) -> Result<Tensor, DistError> {
        let mut host = flat.to_vec1::<f32>()?;
        self.all_reduce_f32(&mut host)?;
        Ok(Tensor::from_vec(host, flat.dims(), flat.device())?)
    }
    /// [`Collective::reduce_scatter_f32`] of a flat `f32` tensor on the model's device; the
    /// default goes through the host.
    fn reduce_scatter_tensor(&self, flat: &Tensor) -> Result<Tensor, DistError> {
        let block = self.reduce_scatter_f32(&flat.to_vec1::<f32>()?)?;
        let n = block.len();
        Ok(Tensor::from_vec(block, n, flat.device())?)
    }
    /// [`Collective::all_gather_f32`] of a flat `f32` tensor on the model's device; the default
    /// goes through the host.
    fn all_gather_tensor(&self, mine: &Tensor) -> Result<Tensor, DistError> {
        let all = self.all_gather_f32(&mine.to_vec1::<f32>()?)?;
        let n = all.len();
        Ok(Tensor::from_vec(all, n, mine.device())?)
    }
}

/// The error of a reduce-scatter whose buffer does not split into `ranks` equal blocks.
#[cfg(feature = "mpi")]
pub(crate) fn uneven_blocks(len: usize, ranks: usize) -> DistError {
    DistError::Collective {
        op: "reduce_scatter",
        reason: format!("{len} values do not split into {ranks} equal blocks"),
    }
}

/// One process: every collective is the identity.
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn backend(&self) -> &'static str {
        "single"
    }
    fn is_single_process(&self) -> bool {
        true
    }
    fn all_reduce_f64(&self, _: &mut [f64]) -> Result<(), DistError> {
        Ok(())
    }
    fn all_reduce_f32(&self, _: &mut [f32]) -> Result<(), DistError> {
        Ok(())
    }
    fn reduce_scatter_f32(&self, values: &[f32]) -> Result<Vec<f32>, DistError> {
        Ok(values.to_vec())
    }
    fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>, DistError> {
        Ok(mine.to_vec())
    }
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        Ok(vec![mine.to_vec()])
    }
    fn all_reduce_tensor(&self, flat: &Tensor) -> Result<Tensor, DistError> {
        Ok(flat.clone())
    }
    fn reduce_scatter_tensor(&self, flat: &Tensor) -> Result<Tensor, DistError> {
        Ok(flat.clone())
    }
    fn all_gather_tensor(&self, mine: &Tensor) -> Result<Tensor, DistError> {
        Ok(mine.clone())
    }
    fn broadcast_bytes(&self, _: &mut Vec<u8>) -> Result<(), DistError> {
        Ok(())
    }
    fn barrier(&self) -> Result<(), DistError> {
        Ok(())
    }
}

/// A collective that counts what passes through it: the bytes this rank contributed, the bytes a
/// ring algorithm would send from this rank for the same calls, and the seconds it spent in
/// collectives (waiting for the slowest rank included).
pub struct Metered {
    inner: Arc<dyn Collective>,
    bytes: AtomicU64,
    ring_bytes: AtomicU64,
    nanos: AtomicU64,
}

/// What a [`Metered`] collective has carried so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Traffic {
    /// Bytes this rank contributed to collectives.
    pub bytes: u64,
    /// Bytes a ring algorithm sends from this rank for the same collectives (of `n` bytes over
    /// `N` ranks: all-reduce 2(N−1)/N·n, reduce-scatter (N−1)/N·n, all-gather of a rank's n
    /// bytes (N−1)·n, broadcast n): the volume ZeRO's accounting uses.
    pub ring_bytes: u64,
    /// Wall-clock seconds spent inside collectives, waiting for other ranks included.
    pub seconds: f64,
}

impl Metered {
    /// Wraps `inner`, with both counters at zero.
    pub fn new(inner: Arc<dyn Collective>) -> Self {
        Self {
            inner,
            bytes: AtomicU64::new(0),
            ring_bytes: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
        }
    }

    /// Bytes and seconds since this collective was made.
    pub fn traffic(&self) -> Traffic {
        Traffic {
            bytes: self.bytes.load(Ordering::Relaxed),
            ring_bytes: self.ring_bytes.load(Ordering::Relaxed),
            seconds: self.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }

    fn count<T>(&self, bytes: usize, ring: Ring, op: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = op();
        let nanos = start.elapsed().as_nanos() as u64;
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        let n = self.inner.size() as f64;
        let ring_bytes = bytes as f64
            * match ring {
                Ring::AllReduce => 2.0 * (n - 1.0) / n,
                Ring::ReduceScatter => (n - 1.0) / n,
                Ring::AllGather => n - 1.0,
                Ring::Broadcast => 1.0,
                Ring::Barrier => 0.0,
            };
        self.ring_bytes
            .fetch_add(ring_bytes.round() as u64, Ordering::Relaxed);
        out
    }
}

/// The shape of a collective, for its ring volume.
#[derive(Clone, Copy)]
enum Ring {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Barrier,
}

impl Collective for Metered {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn is_single_process(&self) -> bool {
        self.inner.is_single_process()
    }
    fn all_reduce_f64(&self, values: &mut [f64]) -> Result<(), DistError> {
        self.count(values.len() * 8, Ring::AllReduce, || {
            self.inner.all_reduce_f64(values)
        })
    }
    fn all_reduce_f32(&self, values: &mut [f32]) -> Result<(), DistError> {
        self.count(values.len() * 4, Ring::AllReduce, || {
            self.inner.all_reduce_f32(values)
        })
    }
    fn reduce_scatter_f32(&self, values: &[f32]) -> Result<Vec<f32>, DistError> {
        self.count(values.len() * 4, Ring::ReduceScatter, || {
            self.inner.reduce_scatter_f32(values)
        })
    }
    fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>, DistError> {
        self.count(mine.len() * 4, Ring::AllGather, || {
            self.inner.all_gather_f32(mine)
        })
    }
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        self.count(mine.len(), Ring::AllGather, || {
            self.inner.all_gather_bytes(mine)
        })
    }
    fn broadcast_bytes(&self, bytes: &mut Vec<u8>) -> Result<(), DistError> {
        let n = bytes.len();
        self.count(n, Ring::Broadcast, || self.inner.broadcast_bytes(bytes))
    }
    fn barrier(&self) -> Result<(), DistError> {
        self.count(0, Ring::Barrier, || self.inner.barrier())
    }
    fn all_reduce_tensor(&self, flat: &Tensor) -> Result<Tensor, DistError> {
        let n = flat.elem_count() * flat.dtype().size_in_bytes();
        self.count(n, Ring::AllReduce, || self.inner.all_reduce_tensor(flat))
    }
    fn reduce_scatter_tensor(&self, flat: &Tensor) -> Result<Tensor, DistError> {
        let n = flat.elem_count() * flat.dtype().size_in_bytes();
        self.count(n, Ring::ReduceScatter, || {
            self.inner.reduce_scatter_tensor(flat)
        })
    }
    fn all_gather_tensor(&self, mine: &Tensor) -> Result<Tensor, DistError> {
        let n = mine.elem_count() * mine.dtype().size_in_bytes();
        self.count(n, Ring::AllGather, || self.inner.all_gather_tensor(mine))
    }
}

/// The world size a launcher announced through its environment (Open MPI's
/// `OMPI_COMM_WORLD_SIZE`, MPICH/Hydra's `PMI_SIZE`, Slurm's `SLURM_NTASKS` under `srun`), if
/// any.
pub fn launcher_world_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"]
        .iter()
        .find_map(|k| std::env::var(k).ok())
        .or_else(|| {
            // `SLURM_NTASKS` is set for the whole allocation; a task started by `srun` also
            // has `SLURM_PROCID`.
            std::env::var("SLURM_PROCID")
                .ok()
                .and(std::env::var("SLURM_NTASKS").ok())
        })
        .and_then(|v| v.trim().parse().ok())
}

/// This process's rank among the ranks on its node, as the launcher announced it (Open MPI's
/// `OMPI_COMM_WORLD_LOCAL_RANK`, Slurm's `SLURM_LOCALID`, MPICH's `MPI_LOCALRANKID`); 0 when
/// none did. A rank on a CUDA device uses the device of this ordinal.
pub fn local_rank() -> usize {
    [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_LOCALID",
        "MPI_LOCALRANKID",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
    .unwrap_or(0)
}

/// The world this process belongs to: an MPI world when a launcher started it (`mpirun`,
/// `srun`), else [`Single`]. `use_nccl` asks for gradients summed by NCCL on the CUDA device
/// `cuda_ordinal` (feature `nccl`). A launch this build cannot join is an error that says which
/// feature to build with.
pub fn join_world(cuda_ordinal: Option<usize>) -> Result<Arc<dyn Collective>, DistError> {
    let announced = launcher_world_size();
    #[cfg(feature = "mpi")]
    {
        if announced.is_some() {
            let world = mpi_world::MpiWorld::init()?;
            #[cfg(feature = "nccl")]
            if let Some(ordinal) = cuda_ordinal {
                return Ok(Arc::new(nccl::NcclWorld::init(world, ordinal)?));
            }
            let _ = cuda_ordinal;
            return Ok(Arc::new(world));
        }
    }
    let _ = cuda_ordinal;
    match announced {
        Some(n) if n > 1 => Err(DistError::Launch(format!(
            "a launcher started {n} ranks, but this stepppo was built without the `mpi` feature: \
             rebuild with `cargo build --release --features mpi` (docs/guides/data-parallel.md)"
        ))),
        _ => Ok(Arc::new(Single)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metered_collective_counts_the_bytes_it_carries() {
        let m = Metered::new(Arc::new(Single));
        let mut v = [1.0f64; 3];
        m.all_reduce_f64(&mut v).unwrap();
        m.all_gather_bytes(b"abcde").unwrap();
        let t = Tensor::zeros(4, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        m.all_reduce_tensor(&t).unwrap();
        assert_eq!(m.traffic().bytes, 24 + 5 + 16);
        assert!(m.is_single_process());
    }

    #[test]
    fn a_single_process_is_rank_zero_of_one_and_its_collectives_are_the_identity() {
        let s = Single;
        assert_eq!((s.rank(), s.size()), (0, 1));
        let mut v = [1.5, -2.0];
        s.all_reduce_f64(&mut v).unwrap();
        assert_eq!(v, [1.5, -2.0]);
        assert_eq!(s.all_gather_bytes(b"ab").unwrap(), vec![b"ab".to_vec()]);
        let t = Tensor::new(&[1f32, 2.0], &candle_core::Device::Cpu).unwrap();
        let r = s.all_reduce_tensor(&t).unwrap();
        assert_eq!(r.to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
    }
}
