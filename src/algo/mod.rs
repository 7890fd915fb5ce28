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
pub use optim::{
    clip_grad_norm, sum_of_squares, sum_of_squares_after, AdamW, LrSchedule, StepReport,
};

/// Errors of the algorithm module; each names the record, key or file involved.
#[derive(Debug, thiserror::Error)]
pub enum AlgoError {
    /// A config value is out of range or inconsistent with another.
    #[error("invalid algorithm config `{key}`: {reason}")]
    InvalidConfig {
        /// The offending config key.
        key: String,
        /// Why the value was rejected.
        reason: String,
    },
    /// An input slice does not have one entry per record (or per row).
    #[error("{what}: expected {expected} entries (one per step record), got {got}")]
    LengthMismatch {
        /// Name of the input that has the wrong length.
        what: &'static str,
        /// Entries required.
        expected: usize,
        /// Entries given.
        got: usize,
    },
    /// A per-token input row does not match its record's response length.
    #[error("record {index} (traj {traj_id} step {step_index}): {what} has {got} entries, the response has {expected} tokens")]
    TokenLengthMismatch {
        /// Name of the per-token input.
        what: &'static str,
        /// Position of the record in the batch.
        index: usize,
        /// Trajectory of the record.
        traj_id: u64,
        /// Step of the record within its trajectory.
        step_index: u32,
        /// Response tokens of the record.
        expected: usize,
        /// Entries in the input row.
        got: usize,
    },
    /// The chosen estimator needs an input (e.g. critic values) that was not given.
    #[error("estimator `{estimator}` needs {what}")]
    MissingInput {
        /// Name of the advantage estimator.
        estimator: String,
        /// Description of the missing input.
        what: &'static str,
    },
    /// Two records share the same trajectory and step index.
    #[error("trajectory {traj_id} has step {step_index} twice")]
    DuplicateStep {
        /// Trajectory with the repeated step.
        traj_id: u64,
        /// The repeated step index.
        step_index: u32,
    },
    /// Records of one trajectory carry different group ids.
    #[error("trajectory {traj_id} spans groups {first} and {second}")]
    MixedGroups {
        /// The trajectory.
        traj_id: u64,
        /// Group id of its first record seen.
        first: u64,
        /// The conflicting group id.
        second: u64,
    },
    /// An input value is NaN or infinite.
    #[error("record {index} (traj {traj_id} step {step_index}): {what} is not finite")]
    NonFinite {
        /// Name of the input holding the value.
        what: &'static str,
        /// Position of the record in the batch.
        index: usize,
        /// Trajectory of the record.
        traj_id: u64,
        /// Step of the record within its trajectory.
        step_index: u32,
    },
    /// A tensor has an unexpected shape.
    #[error("tensor `{what}` has shape {got:?}, expected {expected:?}")]
    Shape {
        /// Name of the tensor.
        what: &'static str,
        /// Required dimensions.
        expected: Vec<usize>,
        /// Actual dimensions.
        got: Vec<usize>,
    },
    /// A KL coefficient is set but the reference policy's log-probs are absent.
    #[error("KL coefficient is set but no reference log-probs were given")]
    MissingReference,
    /// Optimizer state could not be saved or loaded.
    #[error("optimizer state {path}: {reason}")]
    Checkpoint {
        /// The checkpoint file.
        path: String,
        /// What went wrong (I/O error, missing key, shape mismatch).
        reason: String,
    },
    /// An error from a candle tensor operation.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}
