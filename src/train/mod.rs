//! The training side of stepppo, in three rooms by role, each using only the rooms below it:
//! the [`run`] (the `Trainer` loop and everything it writes: run directory, checkpoints, metrics,
//! credit log, plots, validation, progress) drives the [`warm_start`] (the policy a fresh run
//! starts from, copy pretraining, behaviour cloning), and both use the [`learner`] (one update of
//! actor and critic: batching and masks, scoring, the PPO update, the critic, the optimizer step,
//! the memory plan). This file holds what every room shares: [`TrainError`], which wraps the
//! leaves' errors, and [`Scalars`], a step's named metric values.

#[cfg(test)]
mod close;
pub mod learner;
pub mod run;
pub mod warm_start;

pub use learner::device_batch::BatchLayout;
pub use run::trainer::{TrainState, Trainer};

/// One step's scalars, by metric name (e.g. `actor/pg_loss`).
pub type Scalars = std::collections::BTreeMap<String, f64>;

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
    Checkpoint(#[from] run::checkpoint::CheckpointError),
    #[error(transparent)]
    Metrics(#[from] run::metrics::MetricsError),
    #[error(transparent)]
    Plot(#[from] run::plot::PlotError),
    #[error("data parallel: {0}")]
    Dist(#[from] crate::dist::DistError),
    #[error(transparent)]
    Batch(#[from] learner::batch::BatchError),
    #[error("env: {0}")]
    Env(String),
    /// The memory plan of the run exceeds what the machine has ([`learner::memory_plan`]).
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
