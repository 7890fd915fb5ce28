//! KV cache of the rollout engine (issues 4 and 5): the slot pool that holds every layer's keys and
//! values by token slot, and the CPU attention kernel that reads them by slot index
//! ([`pool`]). The radix-tree prefix cache over these slots lives beside it ([`radix`]).

pub mod pool;
pub mod radix;

pub use pool::{KvPool, SeqSlots};

/// Errors of the KV cache.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("KV pool on {device}: only CPU storage is built")]
    UnsupportedDevice { device: String },
    #[error("slot {slot} is outside the pool of {capacity} slots")]
    SlotOutOfRange { slot: u32, capacity: usize },
    #[error("KV pool holds {pool}, the call needs {wanted}")]
    ShapeMismatch { pool: String, wanted: String },
    #[error("sequence {seq}: {message}")]
    BadSequence { seq: usize, message: String },
}
