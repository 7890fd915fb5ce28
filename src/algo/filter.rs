//! StarPO-S uncertainty filtering (keep the `keep_ratio` of trajectory groups with the
//! largest — or, for `std_rev`, smallest — in-group std of raw trajectory rewards) and the
//! zero-signal detector (a batch whose advantages are all zero teaches nothing: ROLL #397).
//! Whether the critic loss also skips dropped groups is the trainer's choice.

use std::collections::{BTreeMap, BTreeSet};

use super::config::{FilterConfig, FilterType};
use super::normalize::mean_std;
use crate::store::StepRecord;

/// Which records survive the filter, and the std statistics before/after.
#[derive(Clone, Debug, PartialEq)]
pub struct FilterOutcome {
    /// One flag per input record.
    pub keep: Vec<bool>,
    /// Ids of the groups that survived the filter.
    pub kept_groups: BTreeSet<u64>,
    /// `filter/{groups,kept_groups}`, `filter/std_{mean,min,max}_{before,after}`.
    pub metrics: BTreeMap<String, f64>,
}

/// Raw trajectory total: Σ (reward − format penalty) over its steps (StarPO-S filters on the
/// environment reward without the format penalty).
fn raw_totals(records: &[StepRecord]) -> BTreeMap<u64, (u64, f64)> {
    let mut totals: BTreeMap<u64, (u64, f64)> = BTreeMap::new();
    for r in records {
        let e = totals.entry(r.traj_id).or_insert((r.group_id, 0.0));
        e.1 += r.reward as f64 - r.info.format_penalty as f64;
    }
    totals
}

/// In-group (unbiased) std of raw trajectory totals, by group id.
pub fn group_reward_std(records: &[StepRecord]) -> BTreeMap<u64, f64> {
    let mut members: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for (group, total) in raw_totals(records).into_values() {
        members.entry(group).or_default().push(total);
    }
    members
        .into_iter()
        .map(|(g, xs)| (g, mean_std(&xs).1))
        .collect()
}

/// Keeps the top `keep_ratio` of groups (at least one) by in-group reward std; ties are
/// broken by group id so the result is deterministic. `keep_ratio` 1.0 keeps everything.
pub fn uncertainty_filter(records: &[StepRecord], cfg: &FilterConfig) -> FilterOutcome {
    let stds = group_reward_std(records);
    let mut order: Vec<(u64, f64)> = stds.iter().map(|(&g, &s)| (g, s)).collect();
    match cfg.filter_type {
        FilterType::Std => order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))),
        FilterType::StdRev => order.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0))),
    }
    let keep_n = if cfg.keep_ratio >= 1.0 {
        order.len()
    } else {
        ((cfg.keep_ratio as f64 * order.len() as f64).floor() as usize)
            .max(1)
            .min(order.len())
    };
    let kept_groups: BTreeSet<u64> = order[..keep_n].iter().map(|(g, _)| *g).collect();
    let keep = records
        .iter()
        .map(|r| kept_groups.contains(&r.group_id))
        .collect();
    let mut metrics = BTreeMap::new();
    metrics.insert("filter/groups".to_string(), order.len() as f64);
    metrics.insert("filter/kept_groups".to_string(), keep_n as f64);
    let before: Vec<f64> = order.iter().map(|(_, s)| *s).collect();
    let after: Vec<f64> = order[..keep_n].iter().map(|(_, s)| *s).collect();
    for (suffix, xs) in [("before", before), ("after", after)] {
        if xs.is_empty() {
            continue;
        }
        metrics.insert(
            format!("filter/std_mean_{suffix}"),
            xs.iter().sum::<f64>() / xs.len() as f64,
        );
        metrics.insert(
            format!("filter/std_min_{suffix}"),
            xs.iter().copied().fold(f64::INFINITY, f64::min),
        );
        metrics.insert(
            format!("filter/std_max_{suffix}"),
            xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        );
    }
    FilterOutcome {
        keep,
        kept_groups,
        metrics,
    }
}

/// Warning raised when every advantage of a batch is zero.
#[derive(Clone, Debug, PartialEq)]
pub struct ZeroSignal {
    /// Number of advantages in the batch (all zero).
    pub rows: usize,
    /// The warning text, with the likely causes.
    pub message: String,
}

/// Returns a warning when the batch is non-empty and all `advantages` are exactly zero
/// (typical cause: group size 1 with group normalisation, or identical rewards in every group).
pub fn zero_signal(advantages: &[f32]) -> Option<ZeroSignal> {
    if advantages.is_empty() || advantages.iter().any(|&a| a != 0.0) {
        return None;
    }
    Some(ZeroSignal {
        rows: advantages.len(),
        message: format!(
            "all {} advantages are zero: the update carries no policy-gradient signal \
             (group size 1 with group normalisation, or every group's rewards are equal?)",
            advantages.len()
        ),
    })
}
