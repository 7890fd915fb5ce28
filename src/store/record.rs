//! `StepRecord`: one interaction round of one trajectory, the unit every part of stepppo
//! exchanges (rollout writes it, the store persists it, estimators and the trainer read it).
//!
//! A record stores only the tokens that are new at its step (`obs_ids`, then `response_ids`):
//! the full context of step t is the concatenation of `obs_ids ++ response_ids` of steps
//! 0..t of the same trajectory followed by step t's `obs_ids`, so storage is linear in turns.
//! In the re-rendered (`window`) layout every step starts a new context: `context_len == 0`
//! and `obs_ids` holds the whole prompt.

use serde::{Deserialize, Serialize};

use crate::env::StepInfo;

/// One interaction round: the observation the agent saw, its whole response, the reward.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Unique id of the trajectory within a dataset.
    pub traj_id: u64,
    /// Id of the group of same-config, same-seed trajectories (the GRPO group).
    pub group_id: u64,
    /// 0-based index of this step in its trajectory.
    pub step_index: u32,
    /// Environment tag (e.g. `frozen_lake`), used for per-env metrics and grouping.
    pub env_tag: String,
    /// Seed the episode's environment was reset with.
    pub seed: u64,
    /// Version of the policy weights that generated `response_ids`.
    pub policy_version: u64,
    /// Number of context tokens before this step's `obs_ids` (0 in the window layout).
    pub context_len: u32,
    /// Tokens new at this step: chat-template fragment + observation + generation prompt.
    pub obs_ids: Vec<u32>,
    /// The tokens the policy sampled in this step.
    pub response_ids: Vec<u32>,
    /// Behaviour-policy log-probabilities of `response_ids`, one per token.
    pub response_logprobs: Vec<f32>,
    /// Reward of this round (sum over executed actions, format penalty included).
    pub reward: f32,
    /// The episode ended in a terminal state at this step.
    pub terminated: bool,
    /// The episode was cut (turn/step/length limit) at this step.
    pub truncated: bool,
    /// Hash of the raw environment observation at the start of the step (GiGPO anchor).
    pub state_hash: u64,
    /// Flags and texts for humans and metrics.
    pub info: StepInfo,
    /// The env's numeric facts about the whole state at the start of the step
    /// ([`crate::env::Env::critic_state`]), what a `state` critic reads; empty when the env has
    /// none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub critic_state: Vec<f32>,
    /// The actions the env offered as admissible at the start of the step, stored when the
    /// response was sampled under a grammar of them (constrained decoding over each state's
    /// actions), so the update scores it under the same grammar; empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub admissible_actions: Vec<String>,
}

impl StepRecord {
    /// Whether this is the last step of its trajectory.
    pub fn is_last(&self) -> bool {
        self.terminated || self.truncated
    }

    /// Position in the full trajectory context where this step's response starts.
    pub fn response_start(&self) -> usize {
        self.context_len as usize + self.obs_ids.len()
    }
}
