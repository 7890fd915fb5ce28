//! The training side of stepppo: the loop ([`trainer`]), generation ahead of it in a thread of
//! its own ([`async_rollout`]), the PPO update ([`update`]) and the optimizer step it shares with
//! the critic's fit (`optimizer_step`), the critic beside the policy and its fit ([`critic`]),
//! forward passes without a gradient over a batch ([`scoring`]: reference log-probs, rollout-time
//! values), packing of step records into training sequences ([`batch`]), their device tensors
//! (`device_batch`), padded or as a prefix tree ([`prefix_tree`]), constrained-decoding masks on
//! the update side ([`masks`]), construction of the device, engine and fresh policy (`setup`),
//! the supervised warm start ([`sft`], after [`copy_pretrain`]), self-imitation replay
//! ([`self_imitation`]), validation ([`eval`]), checkpoints, the run directory's consistency
//! across crashes ([`run_dir`]), metric sinks (JSONL and TensorBoard), the per-step credit log
//! ([`credit_log`]), learning-curve plots, collapse warnings and the progress bar.
//!
//! Dependencies point down: `trainer` uses the others and nothing uses it; below it
//! `async_rollout` → `eval`; `update` → `critic` → `scoring` and `optimizer_step`; `update` →
//! `self_imitation` → `sft` → `copy_pretrain` and `setup`; these share `device_batch` → `masks`,
//! `prefix_tree` → `batch`; `eval` uses `setup`, `run_dir` uses `checkpoint`, `credit_log` →
//! `metrics` and `plot`, and every module may use [`TrainError`], which wraps only the leaves' errors.

pub mod async_rollout;
pub mod batch;
pub mod checkpoint;
#[cfg(test)]
mod close;
pub mod collapse;
pub mod copy_pretrain;
pub mod credit_log;
pub mod critic;
mod device_batch;
pub mod eval;
pub mod gateway;
pub mod masks;
pub mod memory_plan;
pub mod metrics;
mod optimizer_step;
pub mod plot;
pub mod prefix_tree;
pub mod progress;
mod ranks;
pub mod run_dir;
pub mod scoring;
pub mod self_imitation;
mod setup;
pub mod sft;
pub mod trainer;
pub mod update;

pub use device_batch::BatchLayout;
pub use trainer::{TrainState, Trainer};

/// Errors of the training side; each names the file, key, record or step involved.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Algo(#[from] crate::algo::AlgoError),
    #[error(transparent)]
    Rollout(#[from] crate::rollout::agent_loop::RolloutError),
    #[error(transparent)]
    Engine(#[from] crate::rollout::engine::EngineError),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error(transparent)]
    Metrics(#[from] metrics::MetricsError),
    #[error(transparent)]
    Plot(#[from] plot::PlotError),
    #[error("data parallel: {0}")]
    Dist(#[from] crate::dist::DistError),
    #[error(transparent)]
    Batch(#[from] batch::BatchError),
    #[error("env: {0}")]
    Env(String),
    /// The memory plan of the run exceeds what the machine has ([`memory_plan`]).
    #[error("out of memory: {0}")]
    Memory(String),
    #[error("{0}")]
    Data(String),
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}
