//! Supervised warm start (behaviour cloning): teacher-forced cross-entropy on the response tokens
//! of stored or freshly played transcripts.
//!
//! [`agent_transcripts`] plays model-free agents (random or oracle) through the same
//! [`AgentSession`](crate::env::AgentSession) protocol and the same token-space chat template as
//! the rollout engine (system + user turn, response ids, `<|im_end|>` + after-response + next user
//! turn) and returns concat-layout [`StepRecord`]s. [`behaviour_clone`] trains the policy on any
//! such records (e.g. `stepppo collect` datasets). Warm-starting on the *random* agent teaches the
//! answer format, not the task: the policy's success starts near the random agent's.

use super::batch::{pack, pad};
use super::TrainError;
use crate::algo::{AdamW, OptimizerConfig};
use crate::config::Config;
use crate::env::{build_session, Agent, AgentKind};
use crate::model::Model;
use crate::seed;
use crate::store::{agent_episode, EpisodeIds, StepRecord};
use crate::tokenizer::Tokenizer;
use candle_core::Tensor;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;

/// What a warm start did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SftReport {
    pub steps: usize,
    pub trajectories: usize,
    /// Mean token cross-entropy of the first and the last few steps.
    pub first_loss: f64,
    pub final_loss: f64,
    pub skipped: usize,
    /// Wall-clock seconds of the warm start.
    pub seconds: f64,
}

/// Plays `episodes` episodes of `kind` over the train env manager's tags (round robin over its
/// groups) and returns their steps as concat-layout records (no log-probs needed: filled with 0).
pub fn agent_transcripts(
    cfg: &Config,
    tok: &Tokenizer,
    kind: AgentKind,
    episodes: usize,
    base_seed: u64,
) -> Result<Vec<StepRecord>, TrainError> {
    let tags = cfg.train_env_manager.group_tags();
    let mut records = Vec::new();
    for ep in 0..episodes as u64 {
        let tag = tags[ep as usize % tags.len()];
        let spec = &cfg.custom_envs[tag];
        let mut session = build_session(&spec.env_type, &spec.env_config)
            .map_err(|e| TrainError::Env(format!("custom_envs.{tag}: {e}")))?;
        let mut agent = Agent::new(kind, seed::derive(base_seed, &[ep, 1]));
        let ids = EpisodeIds {
            traj_id: ep,
            group_id: ep,
            env_seed: seed::derive(base_seed, &[ep, 0]),
            env_tag: tag.to_string(),
        };
        records.extend(agent_episode(&mut session, &mut agent, &ids, tok));
    }
    Ok(records)
}

/// Groups records into concat-layout sequences: each trajectory's steps in order.
pub fn trajectories(records: &[StepRecord]) -> Vec<Vec<usize>> {
    let mut by_traj: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        by_traj.entry(r.traj_id).or_default().push(i);
    }
    by_traj
        .into_values()
        .map(|mut v| {
            v.sort_by_key(|&i| records[i].step_index);
            v
        })
        .collect()
}

/// Teacher-forced cross-entropy on the response tokens of `records` (whole trajectories per
/// sequence; window-layout records each form their own sequence): `steps` AdamW updates over
/// shuffled mini-batches of `batch_size` sequences.
pub fn behaviour_clone(
    policy: &Model,
    pad_id: u32,
    records: &[StepRecord],
    steps: usize,
    batch_size: usize,
    lr: f64,
    base_seed: u64,
) -> Result<SftReport, TrainError> {
    let sequences: Vec<Vec<usize>> = trajectories(records)
        .into_iter()
        .flat_map(|traj| {
            if traj.iter().all(|&i| records[i].context_len == 0) {
                traj.into_iter().map(|i| vec![i]).collect::<Vec<_>>()
            } else {
                vec![traj]
            }
        })
        .collect();
    if sequences.is_empty() {
        return Err(TrainError::Data("no trajectories to clone".into()));
    }
    let opt_cfg = OptimizerConfig {
        lr,
        weight_decay: 0.0,
        ..OptimizerConfig::default()
    };
    let start = std::time::Instant::now();
    let mut opt = AdamW::new(policy.named_vars(), &opt_cfg)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed::derive(base_seed, &[0x5F7]));
    let mut order: Vec<usize> = Vec::new();
    let mut losses = Vec::with_capacity(steps);
    let mut skipped = 0;
    for _ in 0..steps {
        if order.len() < batch_size {
            let mut epoch: Vec<usize> = (0..sequences.len()).collect();
            epoch.shuffle(&mut rng);
            order.extend(epoch);
        }
        let chosen: Vec<Vec<usize>> = order
            .drain(..batch_size.min(order.len()))
            .map(|s| sequences[s].clone())
            .collect();
        let loss = cross_entropy(policy, pad_id, records, &chosen)?;
        let value = loss.to_scalar::<f32>()? as f64;
        if !value.is_finite() {
            skipped += 1;
            continue;
        }
        let report = opt.step(&loss.backward()?, lr, Some(1.0))?;
        skipped += usize::from(report.skipped);
        losses.push(value);
    }
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    let k = (losses.len() / 2).clamp(1, 10).min(losses.len());
    Ok(SftReport {
        steps,
        trajectories: sequences.len(),
        first_loss: mean(&losses[..k]),
        final_loss: mean(&losses[losses.len() - k..]),
        skipped,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// `stepppo sft`: behaviour-clones `records` into the config's initial policy (`pretrain`,
/// `builtin_size`, `seed`) with the `sft` section's settings and writes it to `out` (HF layout).
pub fn clone_into(
    cfg: &Config,
    records: &[StepRecord],
    out: &std::path::Path,
) -> Result<SftReport, TrainError> {
    if cfg.sft.steps == 0 {
        return Err(TrainError::Data(
            "sft.steps is 0: set it (e.g. --set sft.steps=300)".into(),
        ));
    }
    let device = super::trainer::device_of(cfg.device)?;
    let (policy, tok) = super::trainer::fresh_policy(cfg, &device)?;
    let report = behaviour_clone(
        &policy,
        tok.pad_id(),
        records,
        cfg.sft.steps,
        cfg.sft.batch_size,
        cfg.sft.learning_rate,
        cfg.seed,
    )?;
    policy.save(out, Some(&tok))?;
    Ok(report)
}

/// Mean negative log-likelihood of the response tokens of `sequences` (a scalar with gradient).
fn cross_entropy(
    policy: &Model,
    pad_id: u32,
    records: &[StepRecord],
    sequences: &[Vec<usize>],
) -> Result<Tensor, TrainError> {
    let packed = pack(records, sequences)?;
    let device = policy.device();
    let (b, t) = (sequences.len(), packed.seq_len);
    let (ids, mask) = pad(&packed.inputs, t, pad_id);
    let (targets, _) = pad(&packed.targets, t, pad_id);
    let ids = Tensor::from_vec(ids, (b, t), device)?;
    let mask = Tensor::from_vec(mask, (b, t), device)?;
    let token_targets: Vec<u32> = packed
        .token_index
        .iter()
        .map(|&i| targets[i as usize])
        .collect();
    let index = Tensor::new(packed.token_index.as_slice(), device)?;
    let token_targets = Tensor::new(token_targets.as_slice(), device)?;
    let (picked, _) = policy.logprobs_entropy_at(&ids, &mask, &index, &token_targets, 1.0)?;
    let weights = Tensor::new(packed.token_mask.as_slice(), device)?;
    let n = packed.num_tokens().max(1) as f64;
    Ok((picked * weights)?.sum_all()?.affine(-1.0 / n, 0.0)?)
}
