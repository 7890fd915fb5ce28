//! The MPI world of a job started by `mpirun` or `srun` (feature `mpi`, through the `mpi` crate,
//! rsmpi): every collective of [`Collective`] on the host, over `MPI_COMM_WORLD`. MPI is
//! initialised once per process with `MPI_THREAD_SERIALIZED` and finalised when the world is
//! dropped. Collectives are meant to be called from one thread (the trainer's); a lock makes
//! calls from several threads take turns rather than overlap, which that level allows.

use std::sync::Mutex;

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator, CommunicatorCollectives, Equivalence, Root};
use mpi::Threading;

use super::{Collective, DistError};

/// This process's place in the MPI world; MPI stays initialised while it lives.
pub struct MpiWorld {
    /// Finalises MPI on drop.
    _universe: Universe,
    rank: usize,
    size: usize,
    /// Serialises the collectives of several threads (MPI was asked for `SERIALIZED`).
    turn: Mutex<()>,
}

impl MpiWorld {
    /// Initialises MPI and joins `MPI_COMM_WORLD`. An error if MPI was already initialised in
    /// this process or does not offer calls from more than the main thread.
    pub fn init() -> Result<Self, DistError> {
        let launch = |reason: &str| DistError::Launch(format!("MPI_Init_thread: {reason}"));
        if mpi::environment::is_initialized() {
            return Err(launch("MPI was already initialised in this process"));
        }
        let (universe, provided) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| launch("initialisation failed"))?;
        if matches!(provided, Threading::Single | Threading::Funneled) {
            return Err(launch(&format!(
                "this MPI library offers only {provided:?} threading, stepppo needs Serialized"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(Self {
            _universe: universe,
            rank,
            size,
            turn: Mutex::new(()),
        })
    }

    /// Runs `f` on the world communicator, one thread at a time.
    fn with_world<T>(&self, f: impl FnOnce(&SimpleCommunicator) -> T) -> T {
        let _turn = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        f(&SimpleCommunicator::world())
    }

    /// Element-wise sum over ranks of `values`, in place.
    fn sum_in_place<T: Equivalence + Copy>(
        &self,
        op: &'static str,
        values: &mut [T],
    ) -> Result<(), DistError> {
        count(op, values.len())?;
        if values.is_empty() {
            // Empty slices share one dangling address, which MPI rejects as aliased buffers.
            return Ok(());
        }
        let mine = values.to_vec();
        self.with_world(|w| w.all_reduce_into(&mine[..], values, SystemOperation::sum()));
        Ok(())
    }
}

/// The length a rank announces when its buffer is longer than an MPI count, so that every rank
/// fails the collective together instead of the others waiting for it.
const TOO_LONG: mpi::Count = -1;

/// The error of a collective whose `what` does not fit an MPI count (a C `int`).
fn too_long(op: &'static str, what: &str) -> DistError {
    DistError::Collective {
        op,
        reason: format!(
            "{what} exceed MPI's count limit of {} elements",
            mpi::Count::MAX
        ),
    }
}

/// An MPI element count for `len`, or an error naming `op` when it does not fit.
fn count(op: &'static str, len: usize) -> Result<mpi::Count, DistError> {
    mpi::Count::try_from(len).map_err(|_| too_long(op, &format!("{len} elements")))
}

/// Where each rank's part starts in the gathered buffer, and the gathered length; an error on
/// every rank when some rank's part or the whole does not fit an MPI count.
fn displacements(counts: &[mpi::Count]) -> Result<(Vec<mpi::Count>, usize), DistError> {
    const OP: &str = "all_gather_bytes";
    if let Some(r) = counts.iter().position(|&c| c == TOO_LONG) {
        return Err(too_long(OP, &format!("rank {r}'s bytes")));
    }
    let mut displs = Vec::with_capacity(counts.len());
    let mut total = 0usize;
    for &c in counts {
        displs.push(count(OP, total)?);
        total += c as usize;
    }
    count(OP, total)?;
    Ok((displs, total))
}

impl Collective for MpiWorld {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce_f64(&self, values: &mut [f64]) -> Result<(), DistError> {
        self.sum_in_place("all_reduce_f64", values)
    }

    fn all_reduce_f32(&self, values: &mut [f32]) -> Result<(), DistError> {
        self.sum_in_place("all_reduce_f32", values)
    }

    fn reduce_scatter_f32(&self, values: &[f32]) -> Result<Vec<f32>, DistError> {
        if !values.len().is_multiple_of(self.size) {
            return Err(super::uneven_blocks(values.len(), self.size));
        }
        let block = values.len() / self.size;
        count("reduce_scatter_f32", block)?;
        let mut out = vec![0f32; block];
        if block > 0 {
            self.with_world(|w| {
                w.reduce_scatter_block_into(values, &mut out[..], SystemOperation::sum())
            });
        }
        Ok(out)
    }

    fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>, DistError> {
        count("all_gather_f32", mine.len())?;
        let mut all = vec![0f32; mine.len() * self.size];
        if !mine.is_empty() {
            self.with_world(|w| w.all_gather_into(mine, &mut all[..]));
        }
        Ok(all)
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let len = mpi::Count::try_from(mine.len()).unwrap_or(TOO_LONG);
        let mut counts = vec![0 as mpi::Count; self.size];
        self.with_world(|w| w.all_gather_into(&len, &mut counts[..]));
        let (displs, total) = displacements(&counts)?;
        if total == 0 {
            // As in `sum_in_place`: nothing to move, and empty buffers would alias.
            return Ok(vec![Vec::new(); self.size]);
        }
        let mut all = vec![0u8; total];
        {
            let mut parts = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
            self.with_world(|w| w.all_gather_varcount_into(mine, &mut parts));
        }
        Ok(displs
            .iter()
            .zip(&counts)
            .map(|(&d, &c)| all[d as usize..(d + c) as usize].to_vec())
            .collect())
    }

    fn broadcast_bytes(&self, bytes: &mut Vec<u8>) -> Result<(), DistError> {
        let mut len = match self.rank {
            0 => mpi::Count::try_from(bytes.len()).unwrap_or(TOO_LONG),
            _ => 0,
        };
        self.with_world(|w| w.process_at_rank(0).broadcast_into(&mut len));
        if len == TOO_LONG {
            return Err(too_long("broadcast_bytes", "rank 0's bytes"));
        }
        bytes.resize(len as usize, 0);
        self.with_world(|w| w.process_at_rank(0).broadcast_into(&mut bytes[..]));
        Ok(())
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.with_world(|w| w.barrier());
        Ok(())
    }
}
