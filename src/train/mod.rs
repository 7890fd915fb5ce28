//! The training side of stepppo, in three rooms by role, each using only the rooms below it:
//! the [`run`] (the `Trainer` loop and everything it writes: run directory, checkpoints, metrics,
//! credit log, plots, validation, progress) drives the [`warm_start`] (the policy a fresh run
//! starts from, copy pretraining, behaviour cloning), and both use the [`learner`] (one update of
//! actor and critic: batching and masks, scoring, the PPO update, the critic, the optimizer step,
//! the memory plan). This file holds what every room shares: [`TrainError`], which wraps the
//! leaves' errors, and [`Scalars`], a step's named metric values.

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
    /// A config did not load or validate.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// A model did not load, save or run.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// A tokenizer or chat template failed.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// An advantage, loss or optimizer computation failed.
    #[error(transparent)]
    Algo(#[from] crate::algo::AlgoError),
    /// A rollout failed.
    #[error(transparent)]
    Rollout(#[from] crate::rollout::agent_loop::RolloutError),
    /// The generation engine failed.
    #[error(transparent)]
    Engine(#[from] crate::rollout::engine::EngineError),
    /// The step store failed to read or write a dataset.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// A training checkpoint did not save or load.
    #[error(transparent)]
    Checkpoint(#[from] run::checkpoint::CheckpointError),
    /// Writing or reading the metrics failed.
    #[error(transparent)]
    Metrics(#[from] run::metrics::MetricsError),
    /// Drawing a plot failed.
    #[error(transparent)]
    Plot(#[from] run::plot::PlotError),
    /// Data-parallel communication failed.
    #[error("data parallel: {0}")]
    Dist(#[from] crate::dist::DistError),
    /// Packing the update batch failed.
    #[error(transparent)]
    Batch(#[from] learner::batch::BatchError),
    /// An env failed outside a rollout (e.g. building warm-start data); the message names its
    /// `custom_envs` tag.
    #[error("env: {0}")]
    Env(String),
    /// The memory plan of the run exceeds what the machine has ([`learner::memory_plan`]).
    #[error("out of memory: {0}")]
    Memory(String),
    /// Records, or data exchanged between ranks, that cannot be used; the message says which.
    #[error("{0}")]
    Data(String),
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}
