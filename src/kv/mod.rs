//! The KV cache: the slot pool that holds every layer's keys and values by token slot, and the
//! CPU attention kernel that reads them by slot index ([`pool`]; the device side is `cuda`,
//! built with the `cuda` feature, and `flash`, candle-flash-attn's prefill, built with
//! `flash-attn`), cascade attention over the context slots a call's sequences share
//! ([`cascade`]), and the radix-tree prefix cache over these slots ([`radix`]); the timing of its
//! attention kernels on random K/V ([`kernel_bench`]). It does not schedule sequences: the rollout
//! engine and plain generation own the slot lists.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub mod cascade;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(any(feature = "cuda", test))]
pub mod device_cascade;
#[cfg(feature = "flash-attn")]
pub mod flash;
pub mod kernel_bench;
pub mod pool;
pub mod radix;

pub use pool::{AttentionPlan, KvPool};

/// The kernel that runs a CUDA pool's prefill attention (calls where some sequence brings more
/// than one new token); decode always runs our split-context kernel, and a CPU pool its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PrefillAttention {
    /// Our kernel, which reads K/V through each sequence's slot list (bf16 or f32 pools).
    #[default]
    Paged,
    /// candle-flash-attn's variable-length flash-attention v2 over the context's K/V rows,
    /// gathered from the pool first: bf16 pools only, in a build with the `flash-attn` feature.
    Flash,
}

impl PrefillAttention {
    /// The name configs and flags use.
    pub fn name(self) -> &'static str {
        match self {
            PrefillAttention::Paged => "paged",
            PrefillAttention::Flash => "flash",
        }
    }

    /// Whether this build can run the kernel at all.
    pub fn compiled(self) -> bool {
        match self {
            PrefillAttention::Paged => true,
            PrefillAttention::Flash => cfg!(feature = "flash-attn"),
        }
    }
}

impl std::str::FromStr for PrefillAttention {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "paged" => Ok(PrefillAttention::Paged),
            "flash" => Ok(PrefillAttention::Flash),
            other => Err(format!(
                "`{other}`: the prefill attention is `paged` or `flash`"
            )),
        }
    }
}

/// Errors of the KV cache.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// The pool cannot hold or run what was asked on this device (dtype, kernel or build).
    #[error("KV pool on {device}: {reason}")]
    UnsupportedDevice {
        /// The pool's device.
        device: String,
        /// Why it is refused.
        reason: String,
    },
    /// A call for the other storage kind (CPU rows or plan on a CUDA pool, or the reverse).
    #[error("KV pool: {op} does not match this pool's storage")]
    WrongStorage {
        /// The refused operation.
        op: &'static str,
    },
    /// A tensor operation failed.
    #[error("KV pool tensor op: {0}")]
    Tensor(#[from] candle_core::Error),
    /// A slot index at or past the pool's capacity.
    #[error("slot {slot} is outside the pool of {capacity} slots")]
    SlotOutOfRange {
        /// The offending slot.
        slot: u32,
        /// Slots in the pool.
        capacity: usize,
    },
    /// The pool's layers, K/V row shape or free slots do not match what the call needs.
    #[error("KV pool holds {pool}, the call needs {wanted}")]
    ShapeMismatch {
        /// What the pool holds.
        pool: String,
        /// What the call needs.
        wanted: String,
    },
    /// A sequence of the call is malformed (more new tokens than slots).
    #[error("sequence {seq}: {message}")]
    BadSequence {
        /// Index of the sequence in the call.
        seq: usize,
        /// What is wrong with it.
        message: String,
    },
}

/// The K/V shape a pool is built for: layers, K/V heads per layer and the head dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Layers, each with its own K and V.
    pub num_layers: usize,
    /// K/V heads per layer.
    pub kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
}

/// One sequence of an attention call: the slot of every position so far, the last `num_new` of
/// which hold the tokens whose queries are being computed.
#[derive(Debug, Clone, Copy)]
pub struct SeqSlots<'a> {
    /// Slot of every position of the sequence, in order.
    pub slots: &'a [u32],
    /// How many trailing positions are the new tokens.
    pub num_new: usize,
}

impl<'a> SeqSlots<'a> {
    /// Tokens before the new ones.
    pub fn context_len(&self) -> usize {
        self.slots.len() - self.num_new
    }

    /// The slots each new token of `seqs` sees (its sequence's up to itself), in token order.
    pub fn visible(seqs: &[SeqSlots<'a>]) -> Vec<&'a [u32]> {
        seqs.iter()
            .flat_map(|seq| (0..seq.num_new).map(|i| &seq.slots[..seq.context_len() + i + 1]))
            .collect()
    }
}

/// `a · b` over eight running sums, so that the compiler vectorises it.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut sums = [0.0f32; LANES];
    let (a_blocks, b_blocks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a_blocks
        .remainder()
        .iter()
        .zip(b_blocks.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a_blocks.zip(b_blocks) {
        for lane in 0..LANES {
            sums[lane] += x[lane] * y[lane];
        }
    }
    sums.iter().sum::<f32>() + tail
}
