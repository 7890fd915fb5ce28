//! Advantage estimators on a batch of step records: dispatch on `adv_estimator`, the shared
//! post-processing (whitening, `advantage_clip`) and the output type. One file per estimator
//! family: [`gae`] (step and token GAE), [`score`] (REINFORCE/GRPO, Dr.GRPO, RLOO,
//! REINFORCE++), [`gigpo`], [`step_reinforce`]; [`replay`] turns an output into export rows.
//!
//! The batch may come in any order; records are grouped by `traj_id` and ordered by
//! `step_index`; `group_id` is the trajectory group. Outputs are aligned with the input order.

mod gae;
mod gigpo;
mod layout;
mod replay;
mod score;
mod step_reinforce;

use std::collections::BTreeMap;

pub use replay::{replay_rows, ReplayExport, ReplayRow};

use super::config::{AdvantageConfig, Estimator};
use super::normalize::{clip_abs, token_whitening_map, whiten_rows, whiten_tokens};
use super::AlgoError;
use crate::store::StepRecord;
use layout::Layout;

/// What the estimators read besides the records. Every slice is aligned with the records.
#[derive(Clone, Copy, Debug, Default)]
pub struct AdvantageInputs<'a> {
    /// V(s_t): critic at the last token before each step's response (`step_gae`).
    pub values: Option<&'a [f32]>,
    /// Critic values at each response token of each step (`token_gae`).
    pub token_values: Option<&'a [Vec<f32>]>,
    /// Per-token amounts subtracted from the rewards (KL in reward, see
    /// [`crate::algo::loss::kl_reward_penalty`]); step-level methods subtract the step's sum.
    pub token_reward_penalty: Option<&'a [Vec<f32>]>,
}

/// The result for one step record.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepAdvantage {
    /// r_t: the step's reward (after any KL-in-reward penalty).
    pub reward: f32,
    /// V(s_t) used (0 for critic-free estimators).
    pub value: f32,
    /// The estimator's advantage before whitening and `advantage_clip`.
    pub advantage_raw: f32,
    /// The advantage the loss uses.
    pub advantage: f32,
    /// Return target R_t (GAE: Â_t + V_t; critic-free: the discounted reward-to-go).
    pub ret: f32,
}

/// Per-token advantages and returns of the token-level estimators, one vector per record
/// (as long as its `response_ids`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenAdvantages {
    /// Advantage of each response token, per record.
    pub advantages: Vec<Vec<f32>>,
    /// Return target of each response token, per record.
    pub returns: Vec<Vec<f32>>,
}

/// Advantages for a batch, aligned with the input records.
#[derive(Clone, Debug, Default)]
pub struct AdvantageOutput {
    /// One result per input record, in input order.
    pub per_step: Vec<StepAdvantage>,
    /// Present for `token_gae` and `reinforce_plus_plus`.
    pub per_token: Option<TokenAdvantages>,
    /// Diagnostics (`advantage/zero_fraction`, `advantage/raw_var`, `advantage/clip_frac`,
    /// `{reward,advantage,return,value}/{mean,min,max}`, `gigpo/*`, ...).
    pub metrics: BTreeMap<String, f64>,
}

impl AdvantageOutput {
    /// The advantage of every response token: the per-token result of token-level methods, else
    /// each step's advantage broadcast to its tokens.
    pub fn token_advantages(&self, records: &[StepRecord]) -> Vec<Vec<f32>> {
        match &self.per_token {
            Some(t) => t.advantages.clone(),
            None => self.broadcast(records, |s| s.advantage),
        }
    }

    /// The return target of every response token (broadcast for step-level methods).
    pub fn token_returns(&self, records: &[StepRecord]) -> Vec<Vec<f32>> {
        match &self.per_token {
            Some(t) => t.returns.clone(),
            None => self.broadcast(records, |s| s.ret),
        }
    }

    fn broadcast(
        &self,
        records: &[StepRecord],
        field: impl Fn(&StepAdvantage) -> f32,
    ) -> Vec<Vec<f32>> {
        records
            .iter()
            .zip(&self.per_step)
            .map(|(r, s)| vec![field(s); r.response_ids.len()])
            .collect()
    }
}

/// Unit over which an estimator's advantages are whitened.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Whitening {
    /// StepPO: one value per step row, unweighted.
    Rows,
    /// ROLL `masked_whiten`: every response token counts.
    Tokens,
}

/// One f64 vector per record, one entry per response token.
type TokenRows = Vec<Vec<f64>>;

/// What an estimator hands to the shared post-processing (f64, input order).
struct RawAdvantages {
    advantages: Vec<f64>,
    returns: Vec<f64>,
    values: Vec<f64>,
    /// (advantages, returns) per token for token-level estimators.
    tokens: Option<(TokenRows, TokenRows)>,
    metrics: BTreeMap<String, f64>,
}

impl RawAdvantages {
    fn step_level(advantages: Vec<f64>, returns: Vec<f64>, values: Vec<f64>) -> Self {
        Self {
            advantages,
            returns,
            values,
            tokens: None,
            metrics: BTreeMap::new(),
        }
    }
}

/// The discounted return G_t = Σ_{k≥t} γ^{k−t} r_k from each record's step to the end of its
/// trajectory, aligned with `records` (which may come in any order).
pub fn step_returns(records: &[StepRecord], gamma: f64) -> Result<Vec<f64>, AlgoError> {
    let layout = Layout::new(records, &AdvantageInputs::default())?;
    Ok(step_reinforce::step_returns(&layout, gamma))
}

/// Computes advantages and returns for `records` with the estimator of `cfg`.
pub fn compute_advantages(
    records: &[StepRecord],
    inputs: &AdvantageInputs,
    cfg: &AdvantageConfig,
) -> Result<AdvantageOutput, AlgoError> {
    cfg.validate()?;
    let layout = Layout::new(records, inputs)?;
    let raw = match cfg.adv_estimator {
        Estimator::StepGae => gae::step_gae(&layout, inputs, cfg)?,
        Estimator::TokenGae => gae::token_gae(&layout, inputs, cfg)?,
        Estimator::Reinforce => score::reinforce(&layout, cfg),
        Estimator::DrGrpo => score::dr_grpo(&layout, cfg),
        Estimator::Rloo => score::rloo(&layout, cfg),
        Estimator::ReinforcePlusPlus => score::reinforce_plus_plus(&layout, inputs, cfg),
        Estimator::ReinforcePlusPlusBaseline => score::reinforce_plus_plus_baseline(&layout, cfg),
        Estimator::Gigpo => gigpo::gigpo(&layout, cfg),
        Estimator::StepReinforce => step_reinforce::step_reinforce(&layout, cfg),
    };
    Ok(finish(&layout, raw, cfg))
}

fn default_whitening(estimator: Estimator) -> Option<Whitening> {
    match estimator {
        Estimator::StepGae => Some(Whitening::Rows),
        Estimator::TokenGae
        | Estimator::ReinforcePlusPlus
        | Estimator::ReinforcePlusPlusBaseline => Some(Whitening::Tokens),
        _ => None,
    }
}

/// Whitening (if on), `advantage_clip`, conversion to f32 and the common metrics.
fn finish(layout: &Layout, raw: RawAdvantages, cfg: &AdvantageConfig) -> AdvantageOutput {
    let records = layout.records;
    let unit = default_whitening(cfg.adv_estimator);
    let whiten = cfg.whiten_advantages.unwrap_or(unit.is_some());
    let unit = unit.unwrap_or(Whitening::Rows);
    let mut adv = raw.advantages.clone();
    let mut token_adv = raw.tokens.as_ref().map(|(a, _)| a.clone());
    if whiten {
        match (&mut token_adv, unit) {
            (Some(tokens), _) => whiten_tokens(tokens),
            (None, Whitening::Rows) => whiten_rows(&mut adv),
            (None, Whitening::Tokens) => adv = whiten_broadcast(records, &adv),
        }
    }
    if let Some(tokens) = &token_adv {
        adv = first_token_or_zero(tokens);
    }
    let mut metrics = raw.metrics;
    if let Some(c) = cfg.advantage_clip {
        let c = c as f64;
        let (clipped, total) = match &mut token_adv {
            Some(tokens) => {
                let total = tokens.iter().map(Vec::len).sum::<usize>();
                let clipped = clip_abs(tokens.iter_mut().flatten(), c);
                adv = first_token_or_zero(tokens);
                (clipped, total)
            }
            None => (clip_abs(adv.iter_mut(), c), adv.len()),
        };
        metrics.insert(
            "advantage/clip_frac".into(),
            clipped as f64 / total.max(1) as f64,
        );
    }
    if cfg.clamp_invalid_advantages {
        let clamped = clamp_invalid(records, &mut adv, token_adv.as_mut());
        metrics.insert(
            "advantage/invalid_clamped_frac".into(),
            clamped as f64 / records.len().max(1) as f64,
        );
    }
    let per_step: Vec<StepAdvantage> = (0..records.len())
        .map(|i| StepAdvantage {
            reward: layout.step_rewards[i] as f32,
            value: raw.values[i] as f32,
            advantage_raw: raw.advantages[i] as f32,
            advantage: adv[i] as f32,
            ret: raw.returns[i] as f32,
        })
        .collect();
    let per_token = token_adv
        .zip(raw.tokens)
        .map(|(a, (_, r))| TokenAdvantages {
            advantages: to_f32_rows(&a),
            returns: to_f32_rows(&r),
        });
    summarize(&per_step, &mut metrics);
    AdvantageOutput {
        per_step,
        per_token,
        metrics,
    }
}

/// Caps at 0 the advantages of the steps whose response did not parse (and their tokens'); returns
/// how many steps had a positive advantage.
fn clamp_invalid(
    records: &[StepRecord],
    adv: &mut [f64],
    mut tokens: Option<&mut Vec<Vec<f64>>>,
) -> usize {
    let mut clamped = 0;
    for (i, r) in records.iter().enumerate() {
        if r.info.action_is_valid {
            continue;
        }
        clamped += usize::from(adv[i] > 0.0);
        adv[i] = adv[i].min(0.0);
        if let Some(tokens) = tokens.as_deref_mut() {
            tokens[i].iter_mut().for_each(|a| *a = a.min(0.0));
        }
    }
    clamped
}

/// Token-weighted whitening of per-step values broadcast to their tokens; steps without
/// tokens get the same affine map.
fn whiten_broadcast(records: &[StepRecord], adv: &[f64]) -> Vec<f64> {
    let flat: Vec<f64> = records
        .iter()
        .zip(adv)
        .flat_map(|(r, &a)| std::iter::repeat_n(a, r.response_ids.len()))
        .collect();
    match token_whitening_map(&flat) {
        Some((mean, scale)) => adv.iter().map(|a| (a - mean) * scale).collect(),
        None => adv.to_vec(),
    }
}

fn first_token_or_zero(tokens: &[Vec<f64>]) -> Vec<f64> {
    tokens
        .iter()
        .map(|t| t.first().copied().unwrap_or(0.0))
        .collect()
}

fn to_f32_rows(rows: &[Vec<f64>]) -> Vec<Vec<f32>> {
    rows.iter()
        .map(|r| r.iter().map(|&x| x as f32).collect())
        .collect()
}

fn summarize(per_step: &[StepAdvantage], metrics: &mut BTreeMap<String, f64>) {
    type Field = fn(&StepAdvantage) -> f32;
    let fields: [(&str, Field); 4] = [
        ("reward", |s| s.reward),
        ("advantage", |s| s.advantage),
        ("return", |s| s.ret),
        ("value", |s| s.value),
    ];
    for (name, get) in fields {
        let xs: Vec<f64> = per_step.iter().map(|s| get(s) as f64).collect();
        if xs.is_empty() {
            continue;
        }
        metrics.insert(
            format!("{name}/mean"),
            xs.iter().sum::<f64>() / xs.len() as f64,
        );
        metrics.insert(
            format!("{name}/min"),
            xs.iter().copied().fold(f64::INFINITY, f64::min),
        );
        metrics.insert(
            format!("{name}/max"),
            xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        );
    }
    let zeros = per_step.iter().filter(|s| s.advantage == 0.0).count();
    metrics.insert(
        "advantage/zero_fraction".into(),
        zeros as f64 / per_step.len().max(1) as f64,
    );
    // The estimator's own spread, before whitening makes every batch's variance 1: what the
    // credit comparison reads as the advantages' variance at equal steps.
    if per_step.len() > 1 {
        let raw: Vec<f64> = per_step.iter().map(|s| s.advantage_raw as f64).collect();
        let mean = raw.iter().sum::<f64>() / raw.len() as f64;
        let var = raw.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (raw.len() - 1) as f64;
        metrics.insert("advantage/raw_var".into(), var);
    }
}
