//! Trajectory-score estimators (critic-free): REINFORCE/GRPO as StarPO and ROLL define them
//! (S(τ) = Σ_t r_t, counted once per trajectory, normalised by `reward_normalization`),
//! Dr.GRPO (S − group mean), RLOO (leave-one-out mean), REINFORCE++ (per-token discounted
//! return) and REINFORCE++-baseline (S − group mean). Each step row gets its trajectory's
//! advantage; its `ret` is the discounted reward-to-go with `gamma`.

use super::gae::token_rewards;
use super::layout::{Layout, Trajectory};
use super::{AdvantageInputs, RawAdvantages};
use crate::algo::config::{AdvantageConfig, NormMethod};
use crate::algo::normalize::{discounted_returns, normalize_by_key};
use std::collections::{BTreeMap, HashMap};

/// One advantage per trajectory → one per step row, plus the reward-to-go returns.
fn broadcast(layout: &Layout, traj_adv: &[f64], cfg: &AdvantageConfig) -> RawAdvantages {
    let n = layout.records.len();
    let (mut adv, mut ret) = (vec![0.0; n], vec![0.0; n]);
    for (traj, &a) in layout.trajectories.iter().zip(traj_adv) {
        let returns = discounted_returns(&layout.rewards_of(traj), cfg.gamma as f64);
        for (&i, g) in traj.rows.iter().zip(returns) {
            adv[i] = a;
            ret[i] = g;
        }
    }
    RawAdvantages::step_level(adv, ret, vec![0.0; n])
}

fn scores(layout: &Layout) -> Vec<f64> {
    layout
        .trajectories
        .iter()
        .map(|t| layout.score(t))
        .collect()
}

/// Trajectory scores normalised within `reward_normalization.grouping` by `method`, then
/// `reward_clip`. Returns the group count as a metric.
fn normalized_scores(
    layout: &Layout,
    cfg: &AdvantageConfig,
    method: NormMethod,
) -> (Vec<f64>, BTreeMap<String, f64>) {
    let tags = layout.tag_ids();
    let grouping = cfg.reward_normalization.grouping();
    let keys: Vec<(u64, u64)> = layout
        .trajectories
        .iter()
        .map(|t| layout.traj_key(t, grouping, &tags))
        .collect();
    let mut s = scores(layout);
    let sizes = normalize_by_key(&mut s, &keys, method);
    if let Some(c) = cfg.reward_clip {
        s.iter_mut()
            .for_each(|x| *x = x.clamp(-(c as f64), c as f64));
    }
    let singletons = sizes.iter().filter(|&&n| n == 1).count();
    let metrics = BTreeMap::from([
        ("norm/num_groups".to_string(), sizes.len() as f64),
        ("norm/singleton_groups".to_string(), singletons as f64),
    ]);
    (s, metrics)
}

/// `reinforce` / `grpo`: scores normalised by `reward_normalization` (grouping and method).
pub(super) fn reinforce(layout: &Layout, cfg: &AdvantageConfig) -> RawAdvantages {
    let (s, metrics) = normalized_scores(layout, cfg, cfg.reward_normalization.method());
    let mut raw = broadcast(layout, &s, cfg);
    raw.metrics = metrics;
    raw
}

/// Dr.GRPO: S − mean of its group (no std division).
pub(super) fn dr_grpo(layout: &Layout, cfg: &AdvantageConfig) -> RawAdvantages {
    let (s, metrics) = normalized_scores(layout, cfg, NormMethod::Mean);
    let mut raw = broadcast(layout, &s, cfg);
    raw.metrics = metrics;
    raw
}

/// RLOO: S_i − mean of the other members of its group = n/(n−1)·(S_i − mean); 0 for n = 1.
pub(super) fn rloo(layout: &Layout, cfg: &AdvantageConfig) -> RawAdvantages {
    let tags = layout.tag_ids();
    let grouping = cfg.reward_normalization.grouping();
    let s = scores(layout);
    let mut sums: HashMap<(u64, u64), (f64, usize)> = HashMap::new();
    let keys: Vec<(u64, u64)> = layout
        .trajectories
        .iter()
        .map(|t| layout.traj_key(t, grouping, &tags))
        .collect();
    for (k, &x) in keys.iter().zip(&s) {
        let e = sums.entry(*k).or_default();
        e.0 += x;
        e.1 += 1;
    }
    let adv: Vec<f64> = keys
        .iter()
        .zip(&s)
        .map(|(k, &x)| {
            let (sum, n) = sums[k];
            if n <= 1 {
                0.0
            } else {
                x - (sum - x) / (n - 1) as f64
            }
        })
        .collect();
    broadcast(layout, &adv, cfg)
}

/// REINFORCE++-baseline: S − group mean, broadcast (token-weighted batch whitening follows).
pub(super) fn reinforce_plus_plus_baseline(
    layout: &Layout,
    cfg: &AdvantageConfig,
) -> RawAdvantages {
    dr_grpo(layout, cfg)
}

/// REINFORCE++: per-token reward-to-go Σ_{k≥j} γ^{k−j} r_k over the trajectory's response
/// tokens (reward on each step's last token, per-token penalty subtracted); the advantage of
/// a token is its return (token-weighted batch whitening follows).
pub(super) fn reinforce_plus_plus(
    layout: &Layout,
    inputs: &AdvantageInputs,
    cfg: &AdvantageConfig,
) -> RawAdvantages {
    let rewards = token_rewards(layout, inputs, cfg);
    let mut returns: Vec<Vec<f64>> = rewards.iter().map(|r| vec![0.0; r.len()]).collect();
    for traj in &layout.trajectories {
        token_reward_to_go(traj, &rewards, &mut returns, cfg.gamma as f64);
    }
    let first = |rows: &[Vec<f64>]| {
        rows.iter()
            .map(|t| t.first().copied().unwrap_or(0.0))
            .collect::<Vec<_>>()
    };
    let n = layout.records.len();
    let mut raw = RawAdvantages::step_level(first(&returns), first(&returns), vec![0.0; n]);
    raw.tokens = Some((returns.clone(), returns));
    raw
}

fn token_reward_to_go(traj: &Trajectory, rewards: &[Vec<f64>], out: &mut [Vec<f64>], gamma: f64) {
    let mut acc = 0.0;
    for &i in traj.rows.iter().rev() {
        for j in (0..rewards[i].len()).rev() {
            acc = rewards[i][j] + gamma * acc;
            out[i][j] = acc;
        }
    }
}
