//! Per-step export rows of `stepppo replay --advantages`: the estimator's result on a stored
//! dataset, one JSON-serialisable row per step record. The CLI reads the dataset and values;
//! this only shapes the rows.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{compute_advantages, AdvantageInputs};
use crate::algo::config::AdvantageConfig;
use crate::algo::AlgoError;
use crate::store::StepRecord;

/// One exported step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayRow {
    /// Trajectory the step belongs to.
    pub traj_id: u64,
    /// GRPO group of the trajectory (same config, same seed).
    pub group_id: u64,
    /// Position of the step in its trajectory.
    pub step_index: u32,
    /// The step's reward (after any KL-in-reward penalty).
    pub reward: f32,
    /// Critic value used for the step (0 when none or zero values were substituted).
    pub value: f32,
    /// Before whitening and `advantage_clip`.
    pub advantage_raw: f32,
    /// What the loss uses.
    pub advantage: f32,
    /// Return target R_t, serialised as `return`.
    #[serde(rename = "return")]
    pub ret: f32,
}

/// All rows plus how the values were obtained.
#[derive(Clone, Debug)]
pub struct ReplayExport {
    /// Rows in input order.
    pub rows: Vec<ReplayRow>,
    /// True when the estimator needed a critic and zero values were used instead.
    pub zero_values: bool,
    /// The estimator's diagnostics (see [`super::AdvantageOutput::metrics`]).
    pub metrics: BTreeMap<String, f64>,
}

/// Computes `cfg.adv_estimator` on `records`. When the estimator needs critic values and
/// `inputs` has none, zero values are used and `zero_values` says so.
pub fn replay_rows(
    records: &[StepRecord],
    inputs: &AdvantageInputs,
    cfg: &AdvantageConfig,
) -> Result<ReplayExport, AlgoError> {
    let zero_step: Vec<f32>;
    let zero_tokens: Vec<Vec<f32>>;
    let mut inputs = *inputs;
    let mut zero_values = false;
    if cfg.adv_estimator.needs_critic() && inputs.values.is_none() && inputs.token_values.is_none()
    {
        zero_step = vec![0.0; records.len()];
        zero_tokens = records
            .iter()
            .map(|r| vec![0.0; r.response_ids.len()])
            .collect();
        inputs.values = Some(&zero_step);
        inputs.token_values = Some(&zero_tokens);
        zero_values = true;
    }
    let out = compute_advantages(records, &inputs, cfg)?;
    let rows = records
        .iter()
        .zip(&out.per_step)
        .map(|(r, s)| ReplayRow {
            traj_id: r.traj_id,
            group_id: r.group_id,
            step_index: r.step_index,
            reward: s.reward,
            value: s.value,
            advantage_raw: s.advantage_raw,
            advantage: s.advantage,
            ret: s.ret,
        })
        .collect();
    Ok(ReplayExport {
        rows,
        zero_values,
        metrics: out.metrics,
    })
}
