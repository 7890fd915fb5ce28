//! `step_reinforce` (ROLL): each step row's reward is its discounted step return
//! G_t = Σ_{k≥t} γ^{k−t} r_k (γ = `step_reward_gamma`), normalised over step rows by
//! `reward_normalization` (grouping per row; `state` = same `state_hash` within a trajectory
//! group), then `reward_clip`.

use std::collections::BTreeMap;

use super::layout::Layout;
use super::RawAdvantages;
use crate::algo::config::AdvantageConfig;
use crate::algo::normalize::{discounted_returns, normalize_by_key};

/// Discounted step returns per record (input order) with `gamma`.
pub(super) fn step_returns(layout: &Layout, gamma: f64) -> Vec<f64> {
    let mut out = vec![0.0; layout.records.len()];
    for traj in &layout.trajectories {
        for (&i, g) in traj
            .rows
            .iter()
            .zip(discounted_returns(&layout.rewards_of(traj), gamma))
        {
            out[i] = g;
        }
    }
    out
}

pub(super) fn step_reinforce(layout: &Layout, cfg: &AdvantageConfig) -> RawAdvantages {
    let returns = step_returns(layout, cfg.step_reward_gamma as f64);
    let tags = layout.tag_ids();
    let grouping = cfg.reward_normalization.grouping();
    let keys: Vec<(u64, u64)> = (0..returns.len())
        .map(|i| layout.row_key(i, grouping, &tags))
        .collect();
    let mut adv = returns.clone();
    let sizes = normalize_by_key(&mut adv, &keys, cfg.reward_normalization.method());
    if let Some(c) = cfg.reward_clip {
        adv.iter_mut()
            .for_each(|x| *x = x.clamp(-(c as f64), c as f64));
    }
    let n = adv.len();
    let mut raw = RawAdvantages::step_level(adv, returns, vec![0.0; n]);
    raw.metrics = BTreeMap::from([("norm/num_groups".to_string(), sizes.len() as f64)]);
    raw
}
