//! Supervised warm start (behaviour cloning): teacher-forced cross-entropy on the response tokens
//! of stored or freshly played transcripts.
//!
//! [`agent_transcripts`] plays model-free agents (random or oracle) through the same
//! [`AgentSession`](crate::env::AgentSession) protocol and the same token-space chat template as
//! the rollout engine (system + user turn, response ids, `<|im_end|>` + after-response + next user
//! turn) and returns concat-layout [`StepRecord`]s. [`behaviour_clone`] trains the policy on any
//! such records (e.g. `stepppo collect` datasets), each mini-batch forwarded in the run's
//! [`BatchLayout`] (with `tree_forward`, packed without padding, the transcripts of one group
//! sharing their prompt). Warm-starting on the *random* agent teaches the answer format, not the
//! task: the policy's success starts near the random agent's. An env that fails while a
//! transcript is played (a remote server) ends the warm start with its error under `on_error:
//! fail`; under `skip` that episode is left out and counted.

use crate::algo::step_returns;
use crate::algo::{AdamW, OptimizerConfig};
use crate::config::{Config, SftConfig};
use crate::env::{build_session, check_config, Agent, AgentKind, OnError};
use crate::model::{Critic, Model};
use crate::seed;
use crate::store::{agent_episode, EpisodeIds, StepRecord, StoreError};
use crate::tokenizer::Tokenizer;
use crate::train::learner::batch::{pack, trajectories, PackedBatch};
use crate::train::learner::device_batch::{BatchLayout, DeviceBatch};
use crate::train::learner::nll;
use crate::train::warm_start::copy_pretrain::CopyReport;
use crate::train::warm_start::first_and_final;
use crate::train::warm_start::setup::{device_of, fresh_policy};
use crate::train::TrainError;
use candle_core::Tensor;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, HashSet};

/// What a warm start did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SftReport {
    /// AdamW updates run (skipped ones included).
    pub steps: usize,
    /// Sequences cloned: whole trajectories, or single steps of window-layout records.
    pub trajectories: usize,
    /// Mean token cross-entropy of the first and the last few steps.
    pub first_loss: f64,
    /// Mean token cross-entropy of the last few steps.
    pub final_loss: f64,
    /// First and final value loss of a critic warm-up.
    pub value_loss: Option<(f64, f64)>,
    /// Optimizer steps skipped for a non-finite loss or gradient (a separate critic's included).
    pub skipped: usize,
    /// Wall-clock seconds of the warm start.
    pub seconds: f64,
    /// The env errors that left a transcript out (`on_error: skip`).
    pub env_errors: Vec<String>,
    /// The copy pre-training that ran first, if any.
    pub copy: Option<CopyReport>,
}

/// Episodes played by a model-free agent.
pub struct Transcripts {
    /// Their steps as concat-layout records.
    pub records: Vec<StepRecord>,
    /// The env errors that left an episode out (`on_error: skip`), each naming its tag.
    pub env_errors: Vec<String>,
}

/// Plays `episodes` episodes of `kind` over `sft.tags` in turn, or when it is empty over the
/// train env manager's tags (round robin over its groups), and returns their steps as concat-layout records (no log-probs needed: filled with 0).
/// An env error ends it, or under `on_error: skip` leaves its episode out; when every episode
/// failed, the first error is returned.
pub fn agent_transcripts(
    cfg: &Config,
    tok: &Tokenizer,
    kind: AgentKind,
    episodes: usize,
    base_seed: u64,
) -> Result<Transcripts, TrainError> {
    let tags: Vec<&str> = if cfg.sft.tags.is_empty() {
        cfg.train_env_manager.group_tags()
    } else {
        cfg.sft.tags.iter().map(String::as_str).collect()
    };
    let mut on_error = BTreeMap::new();
    for &tag in &tags {
        let spec = &cfg.custom_envs[tag];
        let check = check_config(&spec.env_type, &spec.env_config)
            .map_err(|e| TrainError::Env(format!("custom_envs.{tag}: {e}")))?;
        on_error.insert(tag, check.on_error);
    }
    let mut out = Transcripts {
        records: Vec::new(),
        env_errors: Vec::new(),
    };
    for ep in 0..episodes as u64 {
        let tag = tags[ep as usize % tags.len()];
        let ids = EpisodeIds {
            traj_id: ep,
            group_id: ep,
            env_seed: seed::derive(base_seed, &[ep, 0]),
            env_tag: tag.to_string(),
        };
        let agent = Agent::new(kind, seed::derive(base_seed, &[ep, 1]));
        match transcript(cfg, tok, agent, &ids) {
            Ok(records) => out.records.extend(records),
            Err(TrainError::Env(e)) if on_error[tag] == OnError::Skip => out.env_errors.push(e),
            Err(e) => return Err(e),
        }
    }
    match out.env_errors.first() {
        Some(first) if out.records.is_empty() => Err(TrainError::Env(first.clone())),
        _ => Ok(out),
    }
}

/// One episode of `agent` on the env of `ids.env_tag`; env failures are [`TrainError::Env`].
fn transcript(
    cfg: &Config,
    tok: &Tokenizer,
    mut agent: Agent,
    ids: &EpisodeIds,
) -> Result<Vec<StepRecord>, TrainError> {
    let tag = &ids.env_tag;
    let spec = &cfg.custom_envs[tag];
    let env_error = |e: &dyn std::fmt::Display| TrainError::Env(format!("custom_envs.{tag}: {e}"));
    let mut session = build_session(&spec.env_type, &spec.env_config).map_err(|e| env_error(&e))?;
    agent_episode(&mut session, &mut agent, ids, tok).map_err(|e| match e {
        StoreError::Env(e) => env_error(&e),
        other => other.into(),
    })
}

/// The records of the trajectories whose last step reached the goal (`info.success`), in their
/// original order.
pub fn successful_trajectories(records: Vec<StepRecord>) -> Vec<StepRecord> {
    let succeeded: HashSet<u64> = records
        .iter()
        .filter(|r| r.is_last() && r.info.success)
        .map(|r| r.traj_id)
        .collect();
    records
        .into_iter()
        .filter(|r| succeeded.contains(&r.traj_id))
        .collect()
}

/// How long and how fast a warm start trains.
#[derive(Clone, Copy, Debug)]
pub struct CloneSettings {
    /// AdamW updates.
    pub steps: usize,
    /// Sequences per update.
    pub batch_size: usize,
    /// AdamW learning rate (no weight decay).
    pub lr: f64,
    /// Weight of the cross-entropy on observation tokens next to the response tokens' (0 = off).
    pub observation_loss_coef: f64,
    /// Seeds the shuffling of the sequences.
    pub seed: u64,
    /// How each mini-batch is forwarded.
    pub layout: BatchLayout,
}

impl CloneSettings {
    /// The cloning settings of `cfg`'s `sft` section, forwarded as `tree_forward` says (padding
    /// with `pad_id`); `seed` orders the mini-batches.
    pub fn from_config(cfg: &Config, pad_id: u32, seed: u64) -> Self {
        let sft: &SftConfig = &cfg.sft;
        CloneSettings {
            steps: sft.steps,
            batch_size: sft.batch_size,
            lr: sft.learning_rate,
            observation_loss_coef: sft.observation_loss_coef,
            seed,
            layout: BatchLayout {
                pad_id,
                tree: cfg.tree_forward,
            },
        }
    }
}

/// The critic side of a warm start (a critic warm-up, as verl's `critic_warmup`): next to cloning
/// the responses, the value at each step start is regressed on the transcript's discounted return,
/// so the critic has learnt to read the state before the first policy update. On random-agent
/// transcripts these are the random policy's values: nothing about the better action is taught.
#[derive(Clone, Copy)]
pub struct ValueWarmup<'a> {
    /// Discount of the returns (the run's `gamma`).
    pub gamma: f64,
    /// Weight of the value loss (mean squared error) next to the cross-entropy.
    pub coef: f64,
    /// A separate critic and its learning rate; `None` = the policy's shared value head.
    pub separate: Option<(&'a Critic, f64)>,
}

/// Teacher-forced cross-entropy on the response tokens of `records` (whole trajectories per
/// sequence; window-layout records each form their own sequence): `settings.steps` AdamW updates
/// over shuffled mini-batches, plus the value regression of `value` when given.
pub fn behaviour_clone(
    policy: &Model,
    records: &[StepRecord],
    settings: CloneSettings,
    value: Option<ValueWarmup>,
) -> Result<SftReport, TrainError> {
    let sequences = clone_sequences(records);
    if sequences.is_empty() {
        return Err(TrainError::Data("no trajectories to clone".into()));
    }
    let mut critic = value.map(|v| CriticWarmup::new(v, records)).transpose()?;
    let opt_cfg = OptimizerConfig {
        lr: settings.lr,
        weight_decay: 0.0,
        ..OptimizerConfig::default()
    };
    let start = std::time::Instant::now();
    let mut opt = AdamW::new(policy.named_vars(), &opt_cfg)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed::derive(settings.seed, &[0x5F7]));
    let mut order: Vec<usize> = Vec::new();
    let mut losses = Vec::new();
    let mut skipped = 0;
    for _ in 0..settings.steps {
        if order.len() < settings.batch_size {
            let mut epoch: Vec<usize> = (0..sequences.len()).collect();
            epoch.shuffle(&mut rng);
            order.extend(epoch);
        }
        let chosen: Vec<Vec<usize>> = order
            .drain(..settings.batch_size.min(order.len()))
            .map(|s| sequences[s].clone())
            .collect();
        let (loss, ce) = clone_loss(
            policy,
            (records, &chosen),
            &settings,
            critic.as_mut(),
            &mut skipped,
        )?;
        let value = loss.to_scalar::<f32>()? as f64;
        if !value.is_finite() {
            skipped += 1;
            continue;
        }
        let report = opt.step(&crate::model::backward(&loss)?, settings.lr, Some(1.0))?;
        skipped += usize::from(report.skipped);
        losses.push(ce.to_scalar::<f32>()? as f64);
    }
    let (first_loss, final_loss) = first_and_final(&losses);
    Ok(SftReport {
        steps: settings.steps,
        trajectories: sequences.len(),
        first_loss,
        final_loss,
        value_loss: critic.map(|c| first_and_final(&c.losses)),
        skipped,
        seconds: start.elapsed().as_secs_f64(),
        env_errors: Vec::new(),
        copy: None,
    })
}

/// The loss of one warm-start update on the sequences `chosen` of `records`, and its response
/// cross-entropy alone: the cross-entropy, the weighted observation term, and a shared value
/// head's weighted value loss (a separate critic of `critic` is stepped here instead).
fn clone_loss(
    policy: &Model,
    (records, chosen): (&[StepRecord], &[Vec<usize>]),
    settings: &CloneSettings,
    critic: Option<&mut CriticWarmup>,
    skipped: &mut usize,
) -> Result<(Tensor, Tensor), TrainError> {
    let packed = pack(records, chosen)?;
    let batch =
        DeviceBatch::laid_out(&packed, (records, chosen), settings.layout, policy.device())?;
    let hidden = policy.hidden(&batch.input)?;
    let ce = nll::cross_entropy(policy, &packed, &batch, &hidden)?;
    let mut loss = ce.clone();
    if settings.observation_loss_coef > 0.0 {
        let obs = observation_cross_entropy(policy, &packed, &batch, &hidden)?;
        loss = (loss + obs.affine(settings.observation_loss_coef, 0.0)?)?;
    }
    if let Some(critic) = critic {
        if let Some(shared) = critic.step(&packed, &batch, policy, &hidden, skipped)? {
            loss = (loss + shared)?;
        }
    }
    Ok((loss, ce))
}

/// The running state of a critic warm-up.
struct CriticWarmup<'a> {
    /// Discounted return of each record's step.
    returns: Vec<f64>,
    coef: f64,
    /// A separate critic with its optimizer and learning rate.
    separate: Option<(&'a Critic, AdamW, f64)>,
    /// Unweighted value loss of every update.
    losses: Vec<f64>,
}

impl<'a> CriticWarmup<'a> {
    fn new(v: ValueWarmup<'a>, records: &[StepRecord]) -> Result<Self, TrainError> {
        let separate = match v.separate {
            Some((critic, lr)) => {
                let cfg = OptimizerConfig {
                    lr,
                    weight_decay: 0.0,
                    ..OptimizerConfig::default()
                };
                Some((critic, AdamW::new(critic.named_vars(), &cfg)?, lr))
            }
            None => None,
        };
        Ok(CriticWarmup {
            returns: step_returns(records, v.gamma)?,
            coef: v.coef,
            separate,
            losses: Vec::new(),
        })
    }

    /// The weighted value loss of `batch`: returned for the policy's update when the value head is
    /// shared (`hidden` is the policy trunk's output); a separate critic is updated here instead.
    fn step(
        &mut self,
        packed: &PackedBatch,
        batch: &DeviceBatch,
        policy: &Model,
        hidden: &Tensor,
        skipped: &mut usize,
    ) -> Result<Option<Tensor>, TrainError> {
        let values = match &self.separate {
            None => policy.head_values(hidden)?,
            Some((critic, _, _)) => critic.values_of(&batch.input)?,
        };
        let vf = value_loss(packed, batch, &values, &self.returns)?;
        let value = vf.to_scalar::<f32>()? as f64;
        self.losses.push(value);
        let weighted = vf.affine(self.coef, 0.0)?;
        let Some((_, opt, lr)) = self.separate.as_mut() else {
            return Ok(Some(weighted));
        };
        if value.is_finite() {
            let grads = crate::model::backward(&weighted)?;
            *skipped += usize::from(opt.step(&grads, *lr, Some(1.0))?.skipped);
        } else {
            *skipped += 1;
        }
        Ok(None)
    }
}

/// The sequences a warm start trains on: whole trajectories, or single steps for records stored
/// in the window layout (every `context_len` 0).
fn clone_sequences(records: &[StepRecord]) -> Vec<Vec<usize>> {
    trajectories(records)
        .into_iter()
        .flat_map(|traj| {
            if traj.iter().all(|&i| records[i].context_len == 0) {
                traj.into_iter().map(|i| vec![i]).collect::<Vec<_>>()
            } else {
                vec![traj]
            }
        })
        .collect()
}

/// Mean negative log-likelihood of every observation token of `packed`, from the policy trunk's
/// output `hidden` over `batch`.
fn observation_cross_entropy(
    policy: &Model,
    packed: &PackedBatch,
    batch: &DeviceBatch,
    hidden: &Tensor,
) -> Result<Tensor, TrainError> {
    let (positions, targets) = observation_targets(packed);
    let device = policy.device();
    let positions = Tensor::new(batch.positions(&positions).as_slice(), device)?;
    let targets = Tensor::new(targets.as_slice(), device)?;
    let (picked, _) = policy.head_logprobs_entropy(hidden, &positions, &targets, 1.0, None)?;
    Ok(picked.mean_all()?.neg()?)
}

/// Flat `[B * T]` output positions and target ids of the observation tokens of `packed`: every
/// real target position that does not predict a response token.
fn observation_targets(packed: &PackedBatch) -> (Vec<u32>, Vec<u32>) {
    let responses: HashSet<u32> = packed
        .token_index
        .iter()
        .zip(&packed.token_mask)
        .filter(|(_, &m)| m > 0.0)
        .map(|(&i, _)| i)
        .collect();
    let mut out = (Vec::new(), Vec::new());
    for (b, seq) in packed.targets.iter().enumerate() {
        for (j, &target) in seq.iter().enumerate() {
            let flat = (b * packed.seq_len + j) as u32;
            if !responses.contains(&flat) {
                out.0.push(flat);
                out.1.push(target);
            }
        }
    }
    out
}

/// Mean squared error of `values` (`[B, T]`) at each step start against `returns` (by record).
fn value_loss(
    packed: &PackedBatch,
    batch: &DeviceBatch,
    values: &Tensor,
    returns: &[f64],
) -> Result<Tensor, TrainError> {
    let predicted = batch.at_step_starts(values, packed)?.flatten_all()?;
    let target: Vec<f32> = packed
        .record_of_row
        .iter()
        .map(|&r| returns[r] as f32)
        .collect();
    let target = Tensor::new(target.as_slice(), values.device())?;
    Ok((predicted - target)?.sqr()?.mean_all()?)
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
    let device = device_of(cfg.device)?;
    let (policy, tok) = fresh_policy(cfg, &device)?;
    let report = behaviour_clone(
        &policy,
        records,
        CloneSettings::from_config(cfg, tok.pad_id(), cfg.seed),
        None,
    )?;
    policy.save(out, Some(&tok))?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ModelConfig, TrainInput};
    use crate::test_support::{assert_same_step, gradients};
    use candle_core::Device;

    const PADDED: BatchLayout = BatchLayout {
        pad_id: 0,
        tree: false,
    };

    /// Single-step trajectories whose return is 1 after one observation token and 0 after
    /// another: the warm-up must learn to tell them apart.
    fn two_kinds_of_steps() -> Vec<StepRecord> {
        (0..8u64)
            .map(|traj_id| StepRecord {
                traj_id,
                group_id: traj_id,
                obs_ids: vec![3, 10 + (traj_id % 2) as u32],
                response_ids: vec![7, 8],
                response_logprobs: vec![0.0, 0.0],
                reward: (traj_id % 2) as f32,
                terminated: true,
                ..StepRecord::default()
            })
            .collect()
    }

    #[test]
    fn successful_trajectories_keep_every_step_of_the_solved_ones() {
        let step = |traj_id, step_index, last: bool, success| {
            let mut r = StepRecord {
                traj_id,
                step_index,
                terminated: last,
                ..StepRecord::default()
            };
            r.info.success = success;
            r
        };
        let records = vec![
            step(0, 0, false, false),
            step(1, 0, false, false),
            step(0, 1, true, true),
            step(1, 1, true, false),
            step(2, 0, false, false), // unfinished: no last step
        ];
        let kept = successful_trajectories(records);
        let ids: Vec<(u64, u32)> = kept.iter().map(|r| (r.traj_id, r.step_index)).collect();
        assert_eq!(ids, vec![(0, 0), (0, 1)]);
    }

    /// Warms up `policy` (and `separate`, when given) on [`two_kinds_of_steps`] and checks that
    /// the value loss fell to near zero.
    fn warm_up_values(policy: &Model, separate: Option<(&Critic, f64)>) -> SftReport {
        let settings = CloneSettings {
            steps: 60,
            batch_size: 8,
            lr: 1e-2,
            observation_loss_coef: 0.0,
            seed: 3,
            layout: PADDED,
        };
        let value = ValueWarmup {
            gamma: 1.0,
            coef: 1.0,
            separate,
        };
        let records = two_kinds_of_steps();
        let report = behaviour_clone(policy, &records, settings, Some(value)).unwrap();
        let (first, last) = report.value_loss.unwrap();
        assert!(
            last < 0.05 && last < first / 3.0,
            "value loss {first} → {last}"
        );
        report
    }

    #[test]
    fn transcripts_come_from_sft_tags_when_set() {
        let config = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            Config::from_yaml_str(crate::config::EMBEDDED_DEFAULT_YAML, "x.yaml", &sets).unwrap()
        };
        let tags = |cfg: &Config| {
            let tok = Tokenizer::builtin_with_words(&cfg.builtin_words().unwrap());
            agent_transcripts(cfg, &tok, AgentKind::Random, 6, 5)
                .unwrap()
                .records
                .into_iter()
                .map(|r| r.env_tag)
                .collect::<std::collections::BTreeSet<_>>()
        };
        let own = "custom_envs.Lake3={env_type: frozen_lake, env_config: {size: 3}}";
        assert_eq!(
            tags(&config(&[own])),
            ["SimpleFrozenLake".to_string()].into()
        );
        assert_eq!(
            tags(&config(&[own, "sft.tags=[Lake3]"])),
            ["Lake3".to_string()].into()
        );
    }

    #[test]
    fn critic_warmup_learns_values_on_the_shared_head() {
        let mut policy = Model::new(&ModelConfig::tiny(32), 1, &Device::Cpu).unwrap();
        policy.attach_value_head(2).unwrap();
        let report = warm_up_values(&policy, None);
        assert!(report.final_loss < report.first_loss);
    }

    #[test]
    fn critic_warmup_trains_a_separate_critic() {
        let cfg = ModelConfig::tiny(32);
        let policy = Model::new(&cfg, 1, &Device::Cpu).unwrap();
        let critic = Critic::new(&cfg, 4, &Device::Cpu).unwrap();
        warm_up_values(&policy, Some((&critic, 1e-2)));
    }

    /// Two-step trajectories (concat layout) whose second observation token follows from the
    /// first: `[3, 10+k]`, response `[7]`, then `[20+k]`, response `[8]`, for k in 0..4.
    fn predictable_observations() -> Vec<StepRecord> {
        (0..8u64)
            .flat_map(|traj_id| {
                let k = (traj_id % 4) as u32;
                let first = StepRecord {
                    traj_id,
                    group_id: traj_id,
                    obs_ids: vec![3, 10 + k],
                    response_ids: vec![7],
                    response_logprobs: vec![0.0],
                    ..StepRecord::default()
                };
                let second = StepRecord {
                    step_index: 1,
                    context_len: 3,
                    obs_ids: vec![20 + k],
                    response_ids: vec![8],
                    terminated: true,
                    ..first.clone()
                };
                [first, second]
            })
            .collect()
    }

    #[test]
    fn observation_targets_skip_response_tokens_and_padding() {
        let records = predictable_observations();
        // Trajectory 0 is [3, 10, 7, 20, 8]; trajectory 1 alone is one step, [3, 11, 7].
        let packed = pack(&records, &[vec![0, 1], vec![2]]).unwrap();
        assert_eq!(packed.seq_len, 4);
        let (positions, targets) = observation_targets(&packed);
        assert_eq!(positions, vec![0, 2, 4]);
        assert_eq!(targets, vec![10, 20, 11]);
    }

    #[test]
    fn observation_loss_teaches_the_env_text() {
        let records = predictable_observations();
        let sequences = clone_sequences(&records);
        let packed = pack(&records, &sequences).unwrap();
        let loss_after = |coef: f64| {
            let policy = Model::new(&ModelConfig::tiny(32), 1, &Device::Cpu).unwrap();
            let settings = CloneSettings {
                steps: 60,
                batch_size: 8,
                lr: 1e-2,
                observation_loss_coef: coef,
                seed: 3,
                layout: PADDED,
            };
            behaviour_clone(&policy, &records, settings, None).unwrap();
            let batch = DeviceBatch::new(&packed, 0, policy.device()).unwrap();
            let hidden = policy.hidden(&batch.input).unwrap();
            let ce = observation_cross_entropy(&policy, &packed, &batch, &hidden).unwrap();
            ce.to_scalar::<f32>().unwrap()
        };
        let (without, with) = (loss_after(0.0), loss_after(1.0));
        // Half the observation tokens ([10+k]) are a uniform pick of four: ln 4 / 2 ≈ 0.69 is the floor.
        assert!(
            with < 1.0 && with < without / 2.0,
            "observation CE {without} → {with}"
        );
    }

    /// Two groups of three two-step trajectories (concat layout), each group's sharing its
    /// 12-token prompt, and a trajectory alone in its group.
    fn grouped_transcripts() -> Vec<StepRecord> {
        (0..7u64)
            .flat_map(|traj_id| {
                let (group, k) = (traj_id / 3, traj_id as u32);
                let first = StepRecord {
                    traj_id,
                    group_id: group,
                    obs_ids: (0..12)
                        .map(|i| 2 + (group as u32 * 7 + i * 5) % 28)
                        .collect(),
                    response_ids: vec![3 + k % 4, 9 + k],
                    response_logprobs: vec![0.0; 2],
                    ..StepRecord::default()
                };
                let second = StepRecord {
                    step_index: 1,
                    context_len: 14,
                    obs_ids: vec![20 + k % 3, 5],
                    response_ids: vec![8, 2 + k, 4],
                    response_logprobs: vec![0.0; 3],
                    reward: (k % 2) as f32,
                    terminated: true,
                    ..first.clone()
                };
                [first, second]
            })
            .collect()
    }

    fn layout(tree: bool) -> BatchLayout {
        BatchLayout { pad_id: 0, tree }
    }

    #[test]
    fn the_tree_layout_gives_the_padded_warm_start_loss_and_gradients() {
        let records = grouped_transcripts();
        let chosen = clone_sequences(&records);
        let mut policy = Model::new(&ModelConfig::tiny(32), 1, &Device::Cpu).unwrap();
        policy.attach_value_head(2).unwrap();
        // Responses, observations and the shared head's values all in one loss.
        let run = |tree| {
            let settings = CloneSettings {
                steps: 1,
                batch_size: chosen.len(),
                lr: 1e-2,
                observation_loss_coef: 0.5,
                seed: 3,
                layout: layout(tree),
            };
            let value = ValueWarmup {
                gamma: 0.9,
                coef: 1.0,
                separate: None,
            };
            let mut critic = CriticWarmup::new(value, &records).unwrap();
            let sequences = (records.as_slice(), chosen.as_slice());
            let (loss, _) =
                clone_loss(&policy, sequences, &settings, Some(&mut critic), &mut 0).unwrap();
            let value = loss.to_scalar::<f32>().unwrap();
            (value, gradients(&loss, policy.named_vars()))
        };
        let ((tree_loss, tree), (padded_loss, padded)) = (run(true), run(false));
        assert_same_step((tree_loss, &tree), (padded_loss, &padded));

        // A separate critic's value loss.
        let critic = Critic::new(&ModelConfig::tiny(32), 4, &Device::Cpu).unwrap();
        let returns = step_returns(&records, 0.9).unwrap();
        let run = |tree| {
            let packed = pack(&records, &chosen).unwrap();
            let batch =
                DeviceBatch::laid_out(&packed, (&records, &chosen), layout(tree), &Device::Cpu)
                    .unwrap();
            assert_eq!(matches!(batch.input, TrainInput::Tree(_)), tree);
            let values = critic.values_of(&batch.input).unwrap();
            let loss = value_loss(&packed, &batch, &values, &returns).unwrap();
            let value = loss.to_scalar::<f32>().unwrap();
            (value, gradients(&loss, critic.named_vars()))
        };
        let ((tree_loss, tree), (padded_loss, padded)) = (run(true), run(false));
        assert_same_step((tree_loss, &tree), (padded_loss, &padded));
    }
}
