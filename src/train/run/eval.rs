//! Episode statistics and validation.
//!
//! [`env_metrics`] turns a batch of step records into the per-tag env metrics (`<prefix>/<tag>/
//! success`, `reward`, `action_is_valid`, ...) logged for training rollouts (`env/`) and
//! validation (`val/`); the env's own metrics (QA's `em`, `searches`) come from the rollout
//! ([`ManagerRollout::env_scores`], merged over ranks for training by [`training_env_scores`],
//! and filed under each tag's [`TagSummary`] by validation). [`validate`] runs the validation env manager on held-out seeds: G = 1
//! per group, group ids fixed so every validation sees the same episodes, seeds derived from
//! `seed + VAL_SEED_OFFSET` (a stream disjoint from the training seeds), decoding with
//! `val_generating_args` (greedy unless `do_sample`). The groups an env error dropped
//! (`on_error: skip`) are counted in `val/env_errors`; their episodes are not in the figures.

use crate::config::{Config, CustomEnv, EnvManagerConfig, GeneratingArgs};
use crate::dist::Collective;
use crate::model::Model;
use crate::rollout::agent_loop::{run_rollout, ContextLayout, RolloutConfig, RolloutError};
use crate::rollout::engine::{CacheCounters, Engine};
use crate::rollout::sampling::SamplingParams;
use crate::store::StepRecord;
use crate::tokenizer::{ChatTemplate, Tokenizer};
use crate::train::warm_start::setup::{device_of, engine_for};
use crate::train::Scalars;
use crate::train::TrainError;
use serde::Serialize;
use std::collections::BTreeMap;

/// Validation seeds come from `seed + VAL_SEED_OFFSET`, training seeds from `seed`.
pub const VAL_SEED_OFFSET: u64 = 1_000_000;
/// Turn cap of a rollout when the env config names no `max_turns` (sessions end themselves).
const DEFAULT_TURN_CAP: usize = 64;

/// Aggregate figures of one env tag's episodes.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TagSummary {
    /// The env tag (its `custom_envs` key).
    pub tag: String,
    /// Episodes run under the tag.
    pub episodes: usize,
    /// Fraction of episodes whose last step succeeded.
    pub success: f64,
    /// Mean episode return.
    pub reward: f64,
    /// Mean turns per episode.
    pub steps: f64,
    /// Fraction of steps whose actions were all valid.
    pub action_is_valid: f64,
    /// Fraction of steps with at least one effective action.
    pub action_is_effective: f64,
    /// Mean format penalty per step.
    pub format_penalty: f64,
    /// Mean env actions per episode.
    pub num_actions: f64,
    /// The env's own metrics (QA's `em`, `f1`, `searches`, `em_<group>`, …), means per episode:
    /// filled by [`validate`], empty from [`summarize`].
    pub env_scores: BTreeMap<String, f64>,
}

/// Summarises the records of one tag (complete trajectories).
pub fn summarize(tag: &str, records: &[StepRecord]) -> TagSummary {
    let episodes = records.iter().filter(|r| r.is_last()).count();
    let steps = records.len().max(1) as f64;
    let per_episode = |x: f64| x / episodes.max(1) as f64;
    let per_step = |f: &dyn Fn(&StepRecord) -> f64| records.iter().map(f).sum::<f64>() / steps;
    TagSummary {
        tag: tag.to_string(),
        episodes,
        success: per_episode(
            records
                .iter()
                .filter(|r| r.is_last() && r.info.success)
                .count() as f64,
        ),
        reward: per_episode(records.iter().map(|r| r.reward as f64).sum()),
        steps: per_episode(records.len() as f64),
        action_is_valid: per_step(&|r| f64::from(u8::from(r.info.action_is_valid))),
        action_is_effective: per_step(&|r| f64::from(u8::from(r.info.action_is_effective))),
        format_penalty: per_step(&|r| r.info.format_penalty as f64),
        num_actions: per_episode(records.iter().map(|r| r.info.num_actions as f64).sum()),
        env_scores: BTreeMap::new(),
    }
}

impl TagSummary {
    /// The env metrics other than the per-group pairs that [`TagSummary::group_scores`] reads.
    pub fn plain_env_scores(&self) -> impl Iterator<Item = (&str, f64)> {
        self.env_scores
            .iter()
            .filter(|(k, _)| self.group_of(k).is_none())
            .map(|(k, v)| (k.as_str(), *v))
    }

    /// `(group, EM within the group, share of the episodes)` for each group of questions an env
    /// counts with an `em_<group>` / `question_<group>` pair (QA's types and templates). An
    /// episode is counted in a group once the env has seen one of its actions, so episodes with
    /// no valid action are in no group (they score 0 in the overall `em`).
    pub fn group_scores(&self) -> Vec<(&str, f64, f64)> {
        self.env_scores
            .iter()
            .filter_map(|(key, &share)| {
                let group = key.strip_prefix("question_")?;
                let em = *self.env_scores.get(&format!("em_{group}"))?;
                Some((group, if share > 0.0 { em / share } else { 0.0 }, share))
            })
            .collect()
    }

    /// The group an `em_<group>` or `question_<group>` key belongs to, when both keys are present.
    fn group_of<'k>(&self, key: &'k str) -> Option<&'k str> {
        let group = key
            .strip_prefix("question_")
            .or_else(|| key.strip_prefix("em_"))?;
        let paired = self.env_scores.contains_key(&format!("em_{group}"))
            && self.env_scores.contains_key(&format!("question_{group}"));
        paired.then_some(group)
    }
}

/// Adds `<prefix>/<tag>/<name>` for every figure of every tag present in `records`.
pub fn env_metrics(prefix: &str, records: &[StepRecord], out: &mut Scalars) -> Vec<TagSummary> {
    let mut by_tag: BTreeMap<&str, Vec<StepRecord>> = BTreeMap::new();
    for r in records {
        by_tag
            .entry(r.env_tag.as_str())
            .or_default()
            .push(r.clone());
    }
    let summaries: Vec<TagSummary> = by_tag.iter().map(|(t, rs)| summarize(t, rs)).collect();
    for s in &summaries {
        let mut put = |name: &str, v: f64| {
            out.insert(format!("{prefix}/{}/{name}", s.tag), v);
        };
        put("success", s.success);
        put("reward", s.reward);
        put("steps", s.steps);
        put("action_is_valid", s.action_is_valid);
        put("action_is_effective", s.action_is_effective);
        put("format_penalty", s.format_penalty);
        put("num_actions", s.num_actions);
    }
    summaries
}

/// `env/<tag>/<metric>`: each env metric (QA's `em`, `searches`, `retrieval_bonus`, …) as a mean
/// per episode of the step's training rollout, over every rank's episodes.
pub fn training_env_scores(
    rollout: &ManagerRollout,
    dist: &dyn Collective,
) -> Result<Scalars, TrainError> {
    let mut episodes: BTreeMap<&str, f64> = BTreeMap::new();
    for r in rollout.records.iter().filter(|r| r.is_last()) {
        *episodes.entry(r.env_tag.as_str()).or_default() += 1.0;
    }
    let (mut sums, mut counts) = (Scalars::new(), BTreeMap::new());
    for (key, mean) in &rollout.env_scores {
        let tag = key.split('/').next().unwrap_or_default();
        let n = episodes.get(tag).copied().unwrap_or_default();
        sums.insert(format!("env/{key}"), mean * n);
        counts.insert(format!("env/{key}"), n);
    }
    let (sums, counts) = crate::train::learner::ranks::merge_means(sums, counts, dist)?;
    Ok(sums
        .into_iter()
        .filter_map(|(key, sum)| {
            let n = counts.get(&key).copied().unwrap_or_default();
            (n > 0.0).then(|| (key, sum / n))
        })
        .collect())
}

/// Sampling parameters of a `generating_args` section.
pub fn sampling_params(g: &GeneratingArgs) -> SamplingParams {
    SamplingParams {
        temperature: g.temperature,
        top_p: g.top_p,
        top_k: g.top_k,
        greedy: !g.do_sample,
    }
}

/// The rollout settings of `groups` groups of the env `spec`.
#[allow(clippy::too_many_arguments)]
pub fn rollout_config(
    cfg: &Config,
    spec: &CustomEnv,
    groups: usize,
    group_size: usize,
    base_seed: u64,
    first_group_id: u64,
    gen: &GeneratingArgs,
    max_context_tokens: usize,
) -> RolloutConfig {
    let turn_cap = spec
        .env_config
        .get("max_turns")
        .and_then(|v| v.as_u64())
        .map_or(DEFAULT_TURN_CAP, |n| n as usize);
    RolloutConfig {
        env_name: spec.env_type.clone(),
        env_config: spec.env_config.clone(),
        num_groups: groups,
        group_size,
        base_seed,
        first_group_id,
        num_levels: None,
        sampling: sampling_params(gen),
        max_new_tokens: gen.max_new_tokens,
        max_turns: turn_cap,
        max_context_tokens,
        layout: match cfg.context {
            crate::config::ContextLayout::Concat => ContextLayout::Concat,
            crate::config::ContextLayout::Window => ContextLayout::Window {
                k: cfg.history_length,
            },
        },
        constrained_decoding: cfg.constrained_decoding,
        critic_state: cfg.critic.mode == crate::config::CriticMode::State,
    }
}

/// What an env manager's rollouts (one per tag) produced.
#[derive(Default)]
pub struct ManagerRollout {
    /// The records, `env_tag` set to the config tag.
    pub records: Vec<StepRecord>,
    /// The cache counters summed over the tags.
    pub counters: CacheCounters,
    /// Seconds spent on the envs and on building contexts (`RolloutStats::env_s`), summed.
    pub env_s: f64,
    /// The env errors that dropped a group (`on_error: skip`), each naming its tag.
    pub env_errors: Vec<String>,
    /// `<tag>/<metric>`: each env metric's mean per episode ([`crate::rollout::agent_loop::RolloutStats::env_metric_sums`]).
    pub env_scores: Scalars,
}

/// Runs this rank's share ([`crate::train::learner::ranks::group_share`], `rank` of `ranks`) of the groups of
/// `manager` (tags in partition order). An env error names the tag (`custom_envs.<tag>`).
#[allow(clippy::too_many_arguments)]
pub fn run_manager(
    engine: &mut Engine,
    policy: &Model,
    tok: &Tokenizer,
    cfg: &Config,
    manager: &EnvManagerConfig,
    base_seed: u64,
    first_group_id: u64,
    gen: &GeneratingArgs,
    (rank, ranks): (usize, usize),
) -> Result<ManagerRollout, TrainError> {
    let template = ChatTemplate;
    let mut out = ManagerRollout::default();
    let mut next_group = first_group_id;
    for (tag, &groups) in manager.tags.iter().zip(&manager.num_groups_partition) {
        let (offset, share) = crate::train::learner::ranks::group_share(groups, rank, ranks);
        let first = next_group + offset as u64;
        next_group += groups as u64;
        if share == 0 {
            continue;
        }
        let spec = &cfg.custom_envs[tag];
        let rc = RolloutConfig {
            num_levels: manager.num_levels,
            ..rollout_config(
                cfg,
                spec,
                share,
                manager.group_size,
                base_seed,
                first,
                gen,
                policy.config().max_position_embeddings,
            )
        };
        let mut rollout = run_rollout(engine, policy, tok, &template, &rc, &mut |_| Ok(()))
            .map_err(|e| name_tag(e, tag))?;
        for r in &mut rollout.records {
            r.env_tag = tag.clone();
        }
        let episodes = rollout.stats.trajectories.max(1) as f64;
        for (name, sum) in &rollout.stats.env_metric_sums {
            out.env_scores
                .insert(format!("{tag}/{name}"), sum / episodes);
        }
        out.counters.add(&rollout.stats.cache);
        out.env_s += rollout.stats.env_s;
        let errors = rollout.stats.env_errors.into_iter();
        out.env_errors
            .extend(errors.map(|e| format!("custom_envs.{tag}: {e}")));
        out.records.extend(rollout.records);
    }
    Ok(out)
}

/// An env error of a rollout, naming the config tag next to the env type.
fn name_tag(err: RolloutError, tag: &str) -> RolloutError {
    match err {
        RolloutError::Env { env, source } => RolloutError::Env {
            env: format!("{env} (custom_envs.{tag})"),
            source,
        },
        other => other,
    }
}

/// What a validation measured.
pub struct Validation {
    /// `val/<tag>/*` and `val/env_errors`.
    pub scalars: Scalars,
    /// One summary per env tag.
    pub summaries: Vec<TagSummary>,
    /// The env errors that dropped an episode (`on_error: skip`).
    pub env_errors: Vec<String>,
}

/// Runs validation (`val_env_manager` on the held-out seeds).
pub fn validate(
    engine: &mut Engine,
    policy: &Model,
    tok: &Tokenizer,
    cfg: &Config,
) -> Result<Validation, TrainError> {
    let rollout = run_manager(
        engine,
        policy,
        tok,
        cfg,
        &cfg.val_env_manager,
        cfg.seed.wrapping_add(VAL_SEED_OFFSET),
        0,
        &cfg.val_generating_args,
        (0, 1),
    )?;
    let mut scalars = Scalars::new();
    let mut summaries = env_metrics("val", &rollout.records, &mut scalars);
    for (name, mean) in &rollout.env_scores {
        scalars.insert(format!("val/{name}"), *mean);
    }
    attach_env_scores(&mut summaries, &rollout.env_scores);
    scalars.insert("val/env_errors".into(), rollout.env_errors.len() as f64);
    Ok(Validation {
        scalars,
        summaries,
        env_errors: rollout.env_errors,
    })
}

/// Files each `<tag>/<metric>` env score under its tag's summary.
fn attach_env_scores(summaries: &mut [TagSummary], env_scores: &Scalars) {
    for (name, mean) in env_scores {
        let Some((tag, metric)) = name.split_once('/') else {
            continue;
        };
        if let Some(s) = summaries.iter_mut().find(|s| s.tag == tag) {
            s.env_scores.insert(metric.to_string(), *mean);
        }
    }
}

/// Loads the policy in `policy_dir` (a checkpoint's `policy/`, a model directory or a PEFT
/// adapter directory), with the PEFT LoRA `adapter` attached when given, and validates it under
/// `cfg` (`stepppo eval`).
pub fn evaluate_policy(
    policy_dir: &std::path::Path,
    adapter: Option<&std::path::Path>,
    cfg: &Config,
) -> Result<Vec<TagSummary>, TrainError> {
    let device = device_of(cfg.device)?;
    let (mut policy, tok) = crate::model::checkpoint::load_policy_with_adapter(
        &policy_dir.display().to_string(),
        adapter,
        &device,
    )?;
    if let Some(rollout) = cfg.rollout_dtype {
        policy.set_rollout_precision(rollout)?;
    }
    let mut engine = engine_for(cfg, &policy)?;
    Ok(validate(&mut engine, &policy, &tok, cfg)?.summaries)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::StepInfo;

    fn step(
        tag: &str,
        traj: u64,
        reward: f32,
        last: bool,
        success: bool,
        valid: bool,
    ) -> StepRecord {
        StepRecord {
            traj_id: traj,
            env_tag: tag.into(),
            reward,
            terminated: last,
            info: StepInfo {
                success,
                action_is_valid: valid,
                num_actions: 1,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn per_tag_figures() {
        let records = vec![
            step("A", 0, 0.0, false, false, true),
            step("A", 0, 1.0, true, true, true),
            step("A", 1, -0.1, true, false, false),
            step("B", 2, 0.5, true, true, true),
        ];
        let mut m = Scalars::new();
        let s = env_metrics("val", &records, &mut m);
        assert_eq!(s.len(), 2);
        assert_eq!(m["val/A/success"], 0.5);
        assert!((m["val/A/reward"] - 0.45).abs() < 1e-6);
        assert_eq!(m["val/A/steps"], 1.5);
        assert!((m["val/A/action_is_valid"] - 2.0 / 3.0).abs() < 1e-9);
        assert_eq!(m["val/B/success"], 1.0);
        assert_eq!(m["val/A/num_actions"], 1.5);
    }

    #[test]
    fn training_env_scores_are_the_rollout_means_under_env() {
        let rollout = ManagerRollout {
            records: vec![
                step("A", 0, 0.0, false, false, true),
                step("A", 0, 1.0, true, true, true),
                step("A", 1, 0.0, true, false, true),
            ],
            env_scores: Scalars::from([("A/em".to_string(), 0.5), ("A/searches".to_string(), 1.5)]),
            ..ManagerRollout::default()
        };
        let scores = training_env_scores(&rollout, &crate::dist::Single).unwrap();
        assert_eq!(
            scores,
            Scalars::from([
                ("env/A/em".to_string(), 0.5),
                ("env/A/searches".to_string(), 1.5)
            ])
        );
    }

    #[test]
    fn group_scores_divide_each_groups_em_by_its_share_of_episodes() {
        let mut summaries = vec![
            summarize("A", &[step("A", 0, 1.0, true, true, true)]),
            summarize("B", &[step("B", 1, 1.0, true, true, true)]),
        ];
        let scores = |tag: &str, pairs: &[(&str, f64)]| {
            pairs
                .iter()
                .map(|(k, v)| (format!("{tag}/{k}"), *v))
                .collect::<Vec<_>>()
        };
        let a = [
            ("em", 0.5),
            ("searches", 2.0),
            ("em_bridge", 0.25),
            ("question_bridge", 0.5),
            ("em_born_first", 0.0),
            ("question_born_first", 0.25),
            ("em_unpaired", 0.1),
            ("question_lone", 1.0),
        ];
        let env_scores: Scalars = [scores("A", &a), scores("B", &[("em", 1.0)])]
            .concat()
            .into_iter()
            .collect();
        attach_env_scores(&mut summaries, &env_scores);
        assert_eq!(
            summaries[1].env_scores,
            BTreeMap::from([("em".into(), 1.0)])
        );
        let s = &summaries[0];
        assert_eq!(
            s.group_scores(),
            vec![("born_first", 0.0, 0.25), ("bridge", 0.5, 0.5)]
        );
        let plain: Vec<(&str, f64)> = s.plain_env_scores().collect();
        assert_eq!(
            plain,
            vec![
                ("em", 0.5),
                ("em_unpaired", 0.1),
                ("question_lone", 1.0),
                ("searches", 2.0)
            ]
        );
    }
}
