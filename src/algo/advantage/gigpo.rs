//! GiGPO (arXiv 2505.10978): A = w_E·A^E(τ) + w_S·A^S(s_t), where A^E normalises trajectory
//! scores within the trajectory group (one entry per trajectory, the paper's form) and A^S
//! normalises discounted step returns (γ = `step_reward_gamma`) within anchor-state groups:
//! steps of one trajectory group whose `state_hash` is equal or, with `similarity_threshold`,
//! whose observation texts are similar (Ratcliff/Obershelp ratio as difflib's, without its
//! autojunk heuristic; greedy assignment to the first matching group). Singleton groups get 0.

use std::collections::BTreeMap;

use super::layout::Layout;
use super::step_reinforce::step_returns;
use super::RawAdvantages;
use crate::algo::config::{AdvantageConfig, GigpoMode, NormMethod};
use crate::algo::normalize::normalize_by_key;

pub(super) fn gigpo(layout: &Layout, cfg: &AdvantageConfig) -> RawAdvantages {
    let method = match cfg.gigpo.mode {
        GigpoMode::MeanNorm => NormMethod::Mean,
        GigpoMode::MeanStdNorm => NormMethod::MeanStd,
    };
    let mut episode: Vec<f64> = layout
        .trajectories
        .iter()
        .map(|t| layout.score(t))
        .collect();
    let traj_keys: Vec<u64> = layout.trajectories.iter().map(|t| t.group_id).collect();
    normalize_by_key(&mut episode, &traj_keys, method);

    let returns = step_returns(layout, cfg.step_reward_gamma as f64);
    let step_keys = anchor_groups(layout, cfg.gigpo.similarity_threshold);
    let mut step = returns.clone();
    let sizes = normalize_by_key(&mut step, &step_keys, method);

    let (we, ws) = (
        cfg.gigpo.episode_weight as f64,
        cfg.gigpo.step_weight as f64,
    );
    let mut adv = vec![0.0; returns.len()];
    for (traj, &a_e) in layout.trajectories.iter().zip(&episode) {
        for &i in &traj.rows {
            let a = we * a_e + ws * step[i];
            adv[i] = cfg
                .reward_clip
                .map_or(a, |c| a.clamp(-(c as f64), c as f64));
        }
    }
    let n = adv.len();
    let mut raw = RawAdvantages::step_level(adv, returns, vec![0.0; n]);
    raw.metrics = step_group_metrics(&sizes);
    raw
}

fn step_group_metrics(sizes: &[usize]) -> BTreeMap<String, f64> {
    let groups = sizes.len().max(1) as f64;
    let singletons = sizes.iter().filter(|&&s| s == 1).count() as f64;
    BTreeMap::from([
        ("gigpo/num_step_groups".to_string(), sizes.len() as f64),
        (
            "gigpo/step_group_size_mean".to_string(),
            sizes.iter().sum::<usize>() as f64 / groups,
        ),
        ("gigpo/singleton_fraction".to_string(), singletons / groups),
    ])
}

/// Anchor-state group key (group_id, cluster) of every record.
fn anchor_groups(layout: &Layout, threshold: Option<f32>) -> Vec<(u64, u64)> {
    let records = layout.records;
    let Some(threshold) = threshold else {
        return records.iter().map(|r| (r.group_id, r.state_hash)).collect();
    };
    let mut keys = vec![(0, 0); records.len()];
    // Representatives per trajectory group: (state_hash, observation chars).
    let mut reps: BTreeMap<u64, Vec<(u64, Vec<char>)>> = BTreeMap::new();
    for traj in &layout.trajectories {
        let group_reps = reps.entry(traj.group_id).or_default();
        for &i in &traj.rows {
            let r = &records[i];
            let text: Vec<char> = r.info.observation_text.chars().collect();
            let found = group_reps
                .iter()
                .position(|(h, t)| *h == r.state_hash || similarity(t, &text) >= threshold as f64);
            let cluster = found.unwrap_or_else(|| {
                group_reps.push((r.state_hash, text));
                group_reps.len() - 1
            });
            keys[i] = (traj.group_id, cluster as u64);
        }
    }
    keys
}

/// difflib `SequenceMatcher(None, a, b).ratio()` = 2·M/(|a| + |b|), M = characters in the
/// recursively found longest matching blocks (1.0 for two empty sequences).
pub(crate) fn similarity(a: &[char], b: &[char]) -> f64 {
    let total = a.len() + b.len();
    if total == 0 {
        return 1.0;
    }
    2.0 * matching_chars(a, b) as f64 / total as f64
}

fn matching_chars(a: &[char], b: &[char]) -> usize {
    let (i, j, k) = longest_match(a, b);
    if k == 0 {
        return 0;
    }
    k + matching_chars(&a[..i], &b[..j]) + matching_chars(&a[i + k..], &b[j + k..])
}

/// Longest common substring (a start, b start, length); earliest in `a`, then in `b`.
fn longest_match(a: &[char], b: &[char]) -> (usize, usize, usize) {
    let mut best = (0, 0, 0);
    let mut prev = vec![0usize; b.len() + 1];
    let mut cur = vec![0usize; b.len() + 1];
    for (i, ca) in a.iter().enumerate() {
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = if ca == cb { prev[j] + 1 } else { 0 };
            let k = cur[j + 1];
            if k > best.2 {
                best = (i + 1 - k, j + 1 - k, k);
            }
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::similarity;

    fn ratio(a: &str, b: &str) -> f64 {
        similarity(
            &a.chars().collect::<Vec<_>>(),
            &b.chars().collect::<Vec<_>>(),
        )
    }

    #[test]
    fn similarity_matches_difflib_examples() {
        // difflib: SequenceMatcher(None, "abcd", "bcde").ratio() == 0.75 ("bcd": 2·3/8)
        assert_eq!(ratio("abcd", "bcde"), 0.75);
        // "abxcd" vs "abcd": blocks "ab", "cd" → 2·4/9
        assert!((ratio("abxcd", "abcd") - 8.0 / 9.0).abs() < 1e-12);
        assert_eq!(ratio("", ""), 1.0);
        assert_eq!(ratio("abc", "xyz"), 0.0);
    }
}
