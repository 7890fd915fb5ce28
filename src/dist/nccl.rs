//! The MPI world with gradients summed by NCCL on the CUDA device (feature `nccl`): the host
//! collectives go over MPI, and [`Collective::all_reduce_tensor`] sums a flat `f32` gradient
//! that lives on the device with `ncclAllReduce` (and reduce-scatters and all-gathers a sharded
//! optimizer's flat gradients and parameter shards with `ncclReduceScatter`/`ncclAllGather`), without a copy through the host. Rank 0 makes
//! NCCL's unique id and broadcasts its 128 bytes over MPI; every rank then joins the NCCL
//! communicator on the stream candle issues its work on for that device (the context's per-thread
//! default stream), so the sum is ordered after the backward pass that wrote the gradient when
//! both run on the trainer's thread; on another thread cudarc's event tracking orders them.

use std::sync::Mutex;

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, DeviceLocation, Storage, Tensor};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, Id, ReduceOp};

use super::mpi_world::MpiWorld;
use super::{Collective, DistError};

/// The length of NCCL's unique id (`ncclUniqueId`).
const ID_BYTES: usize = 128;

/// The MPI world plus an NCCL communicator over the same ranks, one CUDA device per rank.
pub struct NcclWorld {
    /// Declared before `mpi` so that it is destroyed before MPI is finalised.
    comm: Mutex<DeviceComm>,
    mpi: MpiWorld,
    ordinal: usize,
}

/// An NCCL communicator that may move between threads.
struct DeviceComm(Comm);

// SAFETY: NCCL allows a communicator to be used from any thread as long as no two threads use it
// at the same time; `NcclWorld` only reaches it through a `Mutex`.
unsafe impl Send for DeviceComm {}

fn failed(op: &'static str, reason: impl std::fmt::Display) -> DistError {
    DistError::Collective {
        op,
        reason: reason.to_string(),
    }
}

/// An NCCL call's error, by NCCL's result code (`NCCL_DEBUG=WARN` makes NCCL say why).
fn nccl_failed(op: &'static str, e: NcclError) -> DistError {
    failed(
        op,
        format!("{:?} (run with NCCL_DEBUG=WARN for NCCL's reason)", e.0),
    )
}

impl NcclWorld {
    /// Joins the NCCL communicator of `mpi`'s ranks on CUDA device `ordinal`.
    pub fn init(mpi: MpiWorld, ordinal: usize) -> Result<Self, DistError> {
        let device = Device::new_cuda(ordinal)?;
        let stream = device.as_cuda_device()?.cuda_stream();
        let id = Id::uninit(shared_id(&mpi)?);
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| failed("ncclCommInitRank: bind the CUDA context", e))?;
        let comm = Comm::from_rank(stream, mpi.rank(), mpi.size(), id)
            .map_err(|e| nccl_failed("ncclCommInitRank", e))?;
        Ok(Self {
            comm: Mutex::new(DeviceComm(comm)),
            mpi,
            ordinal,
        })
    }

    /// The device of `flat` when NCCL can sum it: an `f32` tensor on this rank's CUDA device.
    fn device_of(&self, flat: &Tensor) -> Result<Option<CudaDevice>, DistError> {
        const OP: &str = "a tensor collective over NCCL";
        let Device::Cuda(dev) = flat.device() else {
            return Ok(None);
        };
        if flat.dtype() != DType::F32 {
            return Err(failed(
                OP,
                format!("expected an f32 gradient, got {:?}", flat.dtype()),
            ));
        }
        match flat.device().location() {
            DeviceLocation::Cuda { gpu_id } if gpu_id == self.ordinal => Ok(Some(dev.clone())),
            other => Err(failed(
                OP,
                format!(
                    "the gradient is on {other:?}, the communicator on cuda:{}",
                    self.ordinal
                ),
            )),
        }
    }

    /// `op` of NCCL over the contiguous `flat` on `dev`, into a new buffer of `out_len` values.
    fn nccl_call(
        &self,
        flat: &Tensor,
        dev: CudaDevice,
        out_len: usize,
        op: NcclOp,
    ) -> Result<Tensor, DistError> {
        let n = flat.elem_count();
        let mut out = dev.alloc_zeros::<f32>(out_len)?;
        {
            let (storage, layout) = flat.storage_and_layout();
            let Storage::Cuda(cuda) = &*storage else {
                return Err(failed(op.name(), "the storage is not CUDA"));
            };
            let start = layout.start_offset();
            let src = cuda.as_cuda_slice::<f32>()?.slice(start..start + n);
            let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
            match op {
                NcclOp::AllReduce => comm.0.all_reduce(&src, &mut out, &ReduceOp::Sum),
                NcclOp::ReduceScatter => comm.0.reduce_scatter(&src, &mut out, &ReduceOp::Sum),
                NcclOp::AllGather => comm.0.all_gather(&src, &mut out),
            }
            .map_err(|e| nccl_failed(op.name(), e))?;
        }
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev));
        Ok(Tensor::from_storage(
            storage,
            out_len,
            BackpropOp::none(),
            false,
        ))
    }
}

/// The NCCL collectives a flat gradient or parameter shard goes through.
#[derive(Clone, Copy)]
enum NcclOp {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl NcclOp {
    fn name(self) -> &'static str {
        match self {
            NcclOp::AllReduce => "ncclAllReduce",
            NcclOp::ReduceScatter => "ncclReduceScatter",
            NcclOp::AllGather => "ncclAllGather",
        }
    }
}

/// NCCL's unique id, made by rank 0 and broadcast over MPI. Rank 0 broadcasts nothing when it
/// could not make one, so that every rank fails instead of waiting.
fn shared_id(mpi: &MpiWorld) -> Result<[std::ffi::c_char; ID_BYTES], DistError> {
    let made = match mpi.rank() {
        0 => Some(Id::new().map_err(|e| nccl_failed("ncclGetUniqueId", e))),
        _ => None,
    };
    let mut bytes = match &made {
        Some(Ok(id)) => id.internal().iter().map(|&c| c as u8).collect(),
        _ => Vec::new(),
    };
    mpi.broadcast_bytes(&mut bytes)?;
    if let Some(Err(e)) = made {
        return Err(e);
    }
    let mut id = [0 as std::ffi::c_char; ID_BYTES];
    if bytes.len() != ID_BYTES {
        return Err(failed(
            "ncclGetUniqueId",
            "rank 0 could not make NCCL's unique id",
        ));
    }
    for (d, s) in id.iter_mut().zip(bytes) {
        *d = s as std::ffi::c_char;
    }
    Ok(id)
}

impl Collective for NcclWorld {
    fn rank(&self) -> usize {
        self.mpi.rank()
    }

    fn size(&self) -> usize {
        self.mpi.size()
    }

    fn backend(&self) -> &'static str {
        "mpi+nccl"
    }

    fn all_reduce_f64(&self, values: &mut [f64]) -> Result<(), DistError> {
        self.mpi.all_reduce_f64(values)
    }

    fn all_reduce_f32(&self, values: &mut [f32]) -> Result<(), DistError> {
        self.mpi.all_reduce_f32(values)
    }

    fn reduce_scatter_f32(&self, values: &[f32]) -> Result<Vec<f32>, DistError> {
        self.mpi.reduce_scatter_f32(values)
    }

    fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>, DistError> {
        self.mpi.all_gather_f32(mine)
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        self.mpi.all_gather_bytes(mine)
    }

    fn broadcast_bytes(&self, bytes: &mut Vec<u8>) -> Result<(), DistError> {
        self.mpi.broadcast_bytes(bytes)
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.mpi.barrier()
    }

    /// On this rank's CUDA device, NCCL sums it there (also with one rank, so that the path is
    /// exercised); a host tensor goes through MPI.
    fn all_reduce_tensor(&self, flat: &Tensor) -> Result<Tensor, DistError> {
        match self.device_of(flat)? {
            Some(dev) => {
                let sum = self.nccl_call(
                    &flat.contiguous()?,
                    dev,
                    flat.elem_count(),
                    NcclOp::AllReduce,
                )?;
                Ok(sum.reshape(flat.dims())?)
            }
            None => self.mpi.all_reduce_tensor(flat),
        }
    }

    fn reduce_scatter_tensor(&self, flat: &Tensor) -> Result<Tensor, DistError> {
        let (n, size) = (flat.elem_count(), self.size());
        if !n.is_multiple_of(size) {
            return Err(super::uneven_blocks(n, size));
        }
        match self.device_of(flat)? {
            Some(dev) => self.nccl_call(&flat.contiguous()?, dev, n / size, NcclOp::ReduceScatter),
            None => self.mpi.reduce_scatter_tensor(flat),
        }
    }

    fn all_gather_tensor(&self, mine: &Tensor) -> Result<Tensor, DistError> {
        let n = mine.elem_count() * self.size();
        match self.device_of(mine)? {
            Some(dev) => self.nccl_call(&mine.contiguous()?, dev, n, NcclOp::AllGather),
            None => self.mpi.all_gather_tensor(mine),
        }
    }
}
