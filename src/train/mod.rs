//! The training side of stepppo: the loop ([`trainer`]), the PPO update ([`update`]), packing of
//! step records into training sequences ([`batch`]), the supervised warm start ([`sft`]), self-imitation replay ([`self_imitation`]),
//! validation ([`eval`]), checkpoints, metric sinks (JSONL and TensorBoard), learning-curve plots,
//! collapse warnings and the progress bar.

pub mod batch;
pub mod checkpoint;
pub mod collapse;
pub mod eval;
pub mod metrics;
pub mod plot;
pub mod progress;
pub mod self_imitation;
pub mod sft;
pub mod trainer;
pub mod update;

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
    #[error(transparent)]
    Batch(#[from] batch::BatchError),
    #[error("env: {0}")]
    Env(String),
    #[error("{0}")]
    Data(String),
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}
