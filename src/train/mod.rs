//! The training side of stepppo: the loop ([`trainer`]), checkpoints, metric sinks (JSONL and
//! TensorBoard), learning-curve plots, collapse warnings and the progress bar.

pub mod batch;
pub mod checkpoint;
pub mod collapse;
pub mod metrics;
pub mod plot;
pub mod progress;
