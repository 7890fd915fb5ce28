//! The learning algorithm: credit assignment on step records ([`advantage`]), reward
//! normalisation and whitening ([`normalize`]), StarPO-S filtering and the zero-signal detector
//! ([`filter`]), PPO/GSPO actor and critic losses on candle tensors ([`loss`]), and AdamW with
//! checkpointable state, gradient clipping and the learning-rate schedule ([`optim`]), how well
//! a critic's values explain a batch's returns ([`value_fit`]), and decoupled PPO's correction of
//! an update on responses of an older policy version ([`decoupled`]).
//! It does not run models or read datasets: the trainer gathers log-probs and values and
//! passes records in.
//!
//! Conventions where sources differ: standard deviations are unbiased (as torch computes them);
//! GRPO/group-normalisation ε is 1e-6; whitening ε is 1e-8; a group with ≤ 1 member or
//! std ≤ 1e-6 gets zero advantages under `mean_std` (ROLL; verl would give a singleton group
//! mean 0 / std 1). `adv_estimator: gae` means token-level GAE (ROLL's name; StepPO's `gae` is
//! `step_gae`); `grpo` is an alias of `reinforce` (GRPO is its `reward_normalization`).
//! Score statistics count each trajectory once. GAE takes the value after a trajectory's last
//! step as 0, terminated or cut (StepPO's reference code does the same).
//! Sequence loss modes average over rows with at least one mask token. The StarPO-S filter
//! ranks groups by the std of reward − format penalty and keeps at least one group.

pub mod advantage;
pub mod config;
pub mod decoupled;
pub mod filter;
pub mod loss;
pub mod normalize;
pub mod optim;
mod optim_kernels;
pub mod value_fit;

pub use advantage::{
    compute_advantages, replay_rows, step_returns, AdvantageInputs, AdvantageOutput, ReplayExport,
    ReplayRow, StepAdvantage, TokenAdvantages,
};
pub use config::{
    AdvantageConfig, CriticTarget, Estimator, FilterConfig, LossConfig, OptimizerConfig,
};
pub use decoupled::ProximalCorrection;
pub use filter::{uncertainty_filter, zero_signal, FilterOutcome, ZeroSignal};
pub use loss::{kl_reward_penalty, policy_loss, value_loss, PolicyMetrics, ValueMetrics};
pub use optim::{clip_grad_norm, AdamW, LrSchedule, StepReport};

/// Errors of the algorithm module; each names the record, key or file involved.
#[derive(Debug, thiserror::Error)]
pub enum AlgoError {
    #[error("invalid algorithm config `{key}`: {reason}")]
    InvalidConfig { key: String, reason: String },
    #[error("{what}: expected {expected} entries (one per step record), got {got}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("record {index} (traj {traj_id} step {step_index}): {what} has {got} entries, the response has {expected} tokens")]
    TokenLengthMismatch {
        what: &'static str,
        index: usize,
        traj_id: u64,
        step_index: u32,
        expected: usize,
        got: usize,
    },
    #[error("estimator `{estimator}` needs {what}")]
    MissingInput {
        estimator: String,
        what: &'static str,
    },
    #[error("trajectory {traj_id} has step {step_index} twice")]
    DuplicateStep { traj_id: u64, step_index: u32 },
    #[error("trajectory {traj_id} spans groups {first} and {second}")]
    MixedGroups {
        traj_id: u64,
        first: u64,
        second: u64,
    },
    #[error("record {index} (traj {traj_id} step {step_index}): {what} is not finite")]
    NonFinite {
        what: &'static str,
        index: usize,
        traj_id: u64,
        step_index: u32,
    },
    #[error("tensor `{what}` has shape {got:?}, expected {expected:?}")]
    Shape {
        what: &'static str,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("KL coefficient is set but no reference log-probs were given")]
    MissingReference,
    #[error("optimizer state {path}: {reason}")]
    Checkpoint { path: String, reason: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}
