//! Fused CPU ops of the training forward, each one candle op over contiguous f32 buffers with a
//! hand-written backward, where candle's composed ops materialise and re-read a tensor per
//! elementwise step (and keep each for the backward):
//! - [`linear`]: `x Wᵀ + b`, whose backward is three products instead of a graph of reshapes,
//!   transposes and broadcasts each with its own zeroed gradient buffer;
//! - [`logprobs_entropy`]: the targets' log-probs and the entropies of a `[N, vocab]` logit
//!   matrix (temperature and logit bias folded in), without materialising the log-softmax;
//! - [`rms_norm`]: RMSNorm over the last dimension;
//! - [`swiglu`]: `silu(gate) · up`;
//! - [`rope_heads`]: rotate-half RoPE of a projection's output, written head-major
//!   (`[B, T, n·D]` → `[B, n, T, D]`), the copy the attention needs anyway.
//!
//! Each has a composed-op reference elsewhere in [`super`] (the path on other devices and
//! dtypes), and [`applies`] says when the fused op runs. Work is split over rows with rayon in
//! fixed-size chunks and reductions run in chunk order, so results do not depend on the thread
//! count. Their row loops are `#[multiversion]` functions: compiled also for AVX-512 and AVX2
//! and picked at run time, since the default build targets baseline x86-64 (4-lane SSE); the
//! arithmetic and its order are the same in every version, so results are bit for bit equal.
//! Not here: attention ([`super::attention`]).

mod exp;
mod linear;
mod logprobs;
mod norm;
mod rope;
mod swiglu;

use candle_core::{CpuStorage, DType, Layout, Storage, Tensor};

pub(crate) use exp::{exp, exp_in_place, max_of, sum_of};
pub(crate) use linear::linear;
pub(crate) use logprobs::logprobs_entropy;
pub(crate) use norm::rms_norm;
pub(crate) use rope::rope_heads;
pub(crate) use swiglu::swiglu;

/// Which ops the training forward uses for its norms, MLP gate, RoPE and log-softmax.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainingOps {
    /// The fused ops of this module where they apply (f32 on the CPU), candle's elsewhere.
    Fused,
    /// candle's composed ops everywhere (the reference).
    Composed,
}

impl TrainingOps {
    /// Fused on the CPU, composed elsewhere.
    pub fn for_device(device: &candle_core::Device) -> Self {
        if device.is_cpu() {
            Self::Fused
        } else {
            Self::Composed
        }
    }
}

/// Whether the fused ops run on `x`: an f32 tensor on the CPU.
pub(crate) fn applies(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// Rows per rayon task: small enough to spread a `[1024, 128]` activation over the threads, large
/// enough that a task is not all overhead. Fixed, so chunked reductions are reproducible.
const ROWS_PER_TASK: usize = 16;

fn f32_data<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(data), Some((start, end))) => Ok(&data[start..end]),
        _ => candle_core::bail!("{op} takes contiguous f32 CPU tensors"),
    }
}

fn u32_data<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [u32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::U32(data), Some((start, end))) => Ok(&data[start..end]),
        _ => candle_core::bail!("{op} takes contiguous u32 CPU indices"),
    }
}

/// The values of an f32 CPU tensor (made contiguous first), read in place by `f`.
fn with_host<T>(
    t: &Tensor,
    op: &str,
    f: impl FnOnce(&[f32]) -> candle_core::Result<T>,
) -> candle_core::Result<T> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => f(f32_data(cpu, layout, op)?),
        _ => candle_core::bail!("{op} takes CPU tensors"),
    }
}

/// A new f32 CPU tensor of `shape` from `data`.
fn from_host(data: Vec<f32>, shape: &candle_core::Shape) -> candle_core::Result<Tensor> {
    Tensor::from_vec(data, shape, &candle_core::Device::Cpu)
}

#[cfg(test)]
mod tests;
