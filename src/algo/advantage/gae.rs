//! Generalised advantage estimation over interaction steps (`step_gae`, StepPO) and over the
//! generated tokens of a trajectory (`token_gae`, the PPO baseline). The value after a
//! trajectory's last step is 0 whether it terminated or was cut (the StepPO reference
//! behaviour): a step record holds no state after its trajectory's last step to value.

use super::layout::{check_per_step, check_token_lengths, Layout};
use super::{AdvantageInputs, RawAdvantages};
use crate::algo::config::AdvantageConfig;
use crate::algo::AlgoError;

fn clip_reward(r: f64, cfg: &AdvantageConfig) -> f64 {
    cfg.reward_clip
        .map_or(r, |c| r.clamp(-(c as f64), c as f64))
}

/// StepPO step GAE: δ_t = r_t + γV_{t+1} − V_t, Â_t = δ_t + γλÂ_{t+1}, R_t = Â_t + V_t.
pub(super) fn step_gae(
    layout: &Layout,
    inputs: &AdvantageInputs,
    cfg: &AdvantageConfig,
) -> Result<RawAdvantages, AlgoError> {
    let values = inputs.values.ok_or(AlgoError::MissingInput {
        estimator: "step_gae".into(),
        what: "per-step critic values",
    })?;
    check_per_step(layout.records, values, "values")?;
    let (gamma, lambd) = (cfg.gamma as f64, cfg.lambd as f64);
    let n = layout.records.len();
    let (mut adv, mut ret) = (vec![0.0; n], vec![0.0; n]);
    for traj in &layout.trajectories {
        let mut next_value = 0.0;
        let mut next_adv = 0.0;
        for &i in traj.rows.iter().rev() {
            let v = values[i] as f64;
            let delta = clip_reward(layout.step_rewards[i], cfg) + gamma * next_value - v;
            next_adv = delta + gamma * lambd * next_adv;
            adv[i] = next_adv;
            ret[i] = next_adv + v;
            next_value = v;
        }
    }
    let values = values.iter().map(|&v| v as f64).collect();
    Ok(RawAdvantages::step_level(adv, ret, values))
}

/// Token GAE across a trajectory's response tokens (StepPO `token_gae` skip rule: observation
/// tokens do not advance the recursion). The step reward sits on the step's last response
/// token (a step without tokens hands its reward to the previous step's last token); the
/// per-token reward penalty, when given, is subtracted token by token.
pub(super) fn token_gae(
    layout: &Layout,
    inputs: &AdvantageInputs,
    cfg: &AdvantageConfig,
) -> Result<RawAdvantages, AlgoError> {
    let token_values = inputs.token_values.ok_or(AlgoError::MissingInput {
        estimator: "token_gae".into(),
        what: "per-token critic values",
    })?;
    check_token_lengths(layout.records, token_values, "token_values")?;
    let (gamma, lambd) = (cfg.gamma as f64, cfg.lambd as f64);
    let rewards = token_rewards(layout, inputs, cfg);
    let mut adv: Vec<Vec<f64>> = token_values.iter().map(|t| vec![0.0; t.len()]).collect();
    let mut ret = adv.clone();
    for traj in &layout.trajectories {
        let mut next_value = 0.0;
        let mut next_adv = 0.0;
        for &i in traj.rows.iter().rev() {
            for j in (0..token_values[i].len()).rev() {
                let v = token_values[i][j] as f64;
                let delta = rewards[i][j] + gamma * next_value - v;
                next_adv = delta + gamma * lambd * next_adv;
                adv[i][j] = next_adv;
                ret[i][j] = next_adv + v;
                next_value = v;
            }
        }
    }
    let step_adv = adv
        .iter()
        .map(|t| t.first().copied().unwrap_or(0.0))
        .collect();
    let step_ret = ret
        .iter()
        .map(|t| t.first().copied().unwrap_or(0.0))
        .collect();
    let step_val = token_values
        .iter()
        .map(|t| t.first().map_or(0.0, |&v| v as f64))
        .collect();
    let mut raw = RawAdvantages::step_level(step_adv, step_ret, step_val);
    raw.tokens = Some((adv, ret));
    Ok(raw)
}

/// Per-token rewards: the (clipped) step reward on the last response token, minus the
/// per-token penalty. Rewards of token-less steps move to the previous step's last token.
pub(super) fn token_rewards(
    layout: &Layout,
    inputs: &AdvantageInputs,
    cfg: &AdvantageConfig,
) -> Vec<Vec<f64>> {
    let records = layout.records;
    let mut out: Vec<Vec<f64>> = records
        .iter()
        .map(|r| vec![0.0; r.response_ids.len()])
        .collect();
    for traj in &layout.trajectories {
        let mut carried = 0.0;
        for &i in traj.rows.iter().rev() {
            let record_reward = clip_reward(records[i].reward as f64, cfg) + carried;
            let Some(last) = out[i].last_mut() else {
                carried = record_reward;
                continue;
            };
            *last = record_reward;
            carried = 0.0;
            if let Some(p) = inputs.token_reward_penalty {
                out[i]
                    .iter_mut()
                    .zip(&p[i])
                    .for_each(|(r, &k)| *r -= k as f64);
            }
        }
    }
    out
}
