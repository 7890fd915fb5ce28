//! How a batch of step records is laid out for the estimators: records grouped into
//! trajectories (by `traj_id`, ordered by `step_index`), each step's scalar reward, and the
//! per-row grouping keys of reward normalisation. Input order is never changed; estimators
//! write their results at the records' original indices.

use std::collections::HashMap;

use super::AdvantageInputs;
use crate::algo::config::Grouping;
use crate::algo::AlgoError;
use crate::store::StepRecord;

/// One trajectory of the batch.
pub(crate) struct Trajectory {
    pub traj_id: u64,
    pub group_id: u64,
    /// Indices into the record slice, in `step_index` order.
    pub rows: Vec<usize>,
}

/// Records grouped into trajectories plus the per-step rewards.
pub(crate) struct Layout<'a> {
    pub records: &'a [StepRecord],
    pub trajectories: Vec<Trajectory>,
    /// r_t = record reward − Σ of the step's token reward penalty (KL in reward), per record.
    pub step_rewards: Vec<f64>,
}

impl<'a> Layout<'a> {
    pub fn new(records: &'a [StepRecord], inputs: &AdvantageInputs) -> Result<Self, AlgoError> {
        let trajectories = group_trajectories(records)?;
        let step_rewards = step_rewards(records, inputs)?;
        Ok(Self {
            records,
            trajectories,
            step_rewards,
        })
    }

    /// The rewards of one trajectory in step order.
    pub fn rewards_of(&self, traj: &Trajectory) -> Vec<f64> {
        traj.rows.iter().map(|&i| self.step_rewards[i]).collect()
    }

    /// Trajectory score S = Σ_t r_t.
    pub fn score(&self, traj: &Trajectory) -> f64 {
        traj.rows.iter().map(|&i| self.step_rewards[i]).sum()
    }

    /// The normalisation key of a step row under `grouping`.
    pub fn row_key(&self, index: usize, grouping: Grouping, tags: &TagIds) -> (u64, u64) {
        let r = &self.records[index];
        match grouping {
            Grouping::TrajGroupId => (r.group_id, 0),
            Grouping::Tags => (tags.id(&r.env_tag), 0),
            Grouping::Batch => (0, 0),
            Grouping::State => (r.group_id, r.state_hash),
        }
    }

    /// The normalisation key of a trajectory (its first step's row key).
    pub fn traj_key(&self, traj: &Trajectory, grouping: Grouping, tags: &TagIds) -> (u64, u64) {
        self.row_key(traj.rows[0], grouping, tags)
    }

    pub fn tag_ids(&self) -> TagIds {
        let mut ids = HashMap::new();
        for r in self.records {
            let next = ids.len() as u64;
            ids.entry(r.env_tag.clone()).or_insert(next);
        }
        TagIds(ids)
    }
}

/// Dense ids of the environment tags of a batch.
pub(crate) struct TagIds(HashMap<String, u64>);

impl TagIds {
    fn id(&self, tag: &str) -> u64 {
        self.0.get(tag).copied().unwrap_or(u64::MAX)
    }
}

fn group_trajectories(records: &[StepRecord]) -> Result<Vec<Trajectory>, AlgoError> {
    let mut by_id: HashMap<u64, usize> = HashMap::new();
    let mut trajectories: Vec<Trajectory> = Vec::new();
    for (i, r) in records.iter().enumerate() {
        let slot = *by_id.entry(r.traj_id).or_insert_with(|| {
            trajectories.push(Trajectory {
                traj_id: r.traj_id,
                group_id: r.group_id,
                rows: Vec::new(),
            });
            trajectories.len() - 1
        });
        let traj = &mut trajectories[slot];
        if traj.group_id != r.group_id {
            return Err(AlgoError::MixedGroups {
                traj_id: r.traj_id,
                first: traj.group_id,
                second: r.group_id,
            });
        }
        traj.rows.push(i);
    }
    for traj in &mut trajectories {
        traj.rows.sort_by_key(|&i| records[i].step_index);
        if let Some(w) = traj
            .rows
            .windows(2)
            .find(|w| records[w[0]].step_index == records[w[1]].step_index)
        {
            return Err(AlgoError::DuplicateStep {
                traj_id: traj.traj_id,
                step_index: records[w[0]].step_index,
            });
        }
    }
    Ok(trajectories)
}

fn step_rewards(records: &[StepRecord], inputs: &AdvantageInputs) -> Result<Vec<f64>, AlgoError> {
    if let Some(p) = inputs.token_reward_penalty {
        check_token_lengths(records, p, "token_reward_penalty")?;
    }
    records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let penalty: f64 = inputs
                .token_reward_penalty
                .map_or(0.0, |p| p[i].iter().map(|&x| x as f64).sum());
            let reward = r.reward as f64 - penalty;
            finite(reward, "reward", i, r)
        })
        .collect()
}

/// Checks that `per_token[i]` has one entry per response token of record i.
pub(crate) fn check_token_lengths(
    records: &[StepRecord],
    per_token: &[Vec<f32>],
    what: &'static str,
) -> Result<(), AlgoError> {
    if per_token.len() != records.len() {
        return Err(AlgoError::LengthMismatch {
            what,
            expected: records.len(),
            got: per_token.len(),
        });
    }
    for (i, (r, t)) in records.iter().zip(per_token).enumerate() {
        if t.len() != r.response_ids.len() {
            return Err(AlgoError::TokenLengthMismatch {
                what,
                index: i,
                traj_id: r.traj_id,
                step_index: r.step_index,
                expected: r.response_ids.len(),
                got: t.len(),
            });
        }
        if t.iter().any(|x| !x.is_finite()) {
            return Err(non_finite(what, i, r));
        }
    }
    Ok(())
}

/// Checks a per-record slice's length and finiteness.
pub(crate) fn check_per_step(
    records: &[StepRecord],
    values: &[f32],
    what: &'static str,
) -> Result<(), AlgoError> {
    if values.len() != records.len() {
        return Err(AlgoError::LengthMismatch {
            what,
            expected: records.len(),
            got: values.len(),
        });
    }
    match values.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(non_finite(what, i, &records[i])),
        None => Ok(()),
    }
}

fn finite(x: f64, what: &'static str, index: usize, r: &StepRecord) -> Result<f64, AlgoError> {
    if x.is_finite() {
        Ok(x)
    } else {
        Err(non_finite(what, index, r))
    }
}

fn non_finite(what: &'static str, index: usize, r: &StepRecord) -> AlgoError {
    AlgoError::NonFinite {
        what,
        index,
        traj_id: r.traj_id,
        step_index: r.step_index,
    }
}
