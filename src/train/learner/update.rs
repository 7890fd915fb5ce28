//! The PPO update of one rollout batch: `ppo_epochs` passes over shuffled mini-batches of
//! sequences (whole trajectories in the `concat` layout, single steps in `window`). Each
//! mini-batch runs one policy forward over its sequences, padded or, with `tree_forward`, as a
//! prefix tree in which each group's common prefix is forwarded once ([`crate::train::learner::prefix_tree`]),
//! gathers every step row's response-token log-probs and entropies, and applies the algo policy
//! loss (per step row aggregation); the separate critic runs one forward too (in the same layout)
//! and is trained at each step's start position (`step_gae`) or at every response token
//! (`token_gae`); a shared-trunk value head adds its loss to the actor's; a feature critic is
//! fitted after the actor's epochs, on the updated policy's features of the batch, and a state
//! critic on the records' critic states ([`crate::train::learner::critic::fit`]); with self-imitation on, each actor
//! mini-batch also adds the negative log-likelihood of a draw from the replay buffer
//! ([`crate::train::learner::self_imitation`]). Those passes, and
//! the rollout-time critic values and reference log-probs ([`crate::train::learner::scoring`]), run in the same
//! layout as the mini-batches ([`BatchLayout`]). A non-finite loss or gradient skips that update (counted and
//! reported); the run goes on.

use crate::algo::loss::{agg_normaliser, LOG_RATIO_BOUND};
use crate::algo::{policy_loss, value_loss, AdamW, CriticTarget, LossConfig};
use crate::dist::Collective;
use crate::model::Model;
use crate::seed;
use crate::store::StepRecord;
use crate::train::learner::batch::{pack, PackedBatch};
use crate::train::learner::critic::fit::{FitBatch, FitSettings};
use crate::train::learner::critic::{Critic, FitContext};
use crate::train::learner::device_batch::{BatchLayout, DeviceBatch};
use crate::train::learner::masks::ResponseMasks;
use crate::train::learner::memory_plan::MemoryBudget;
use crate::train::learner::optimizer_step::{backward, step_critic, step_over_ranks, Means};
use crate::train::learner::ranks;
use crate::train::learner::self_imitation::Replay;
use crate::train::Scalars;
use crate::train::TrainError;
use candle_core::{Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Everything the update reads, aligned with `records`.
pub struct UpdateInputs<'a> {
    /// The rollout's step records being trained on.
    pub records: &'a [StepRecord],
    /// Sequences (lists of record indices in step order).
    pub sequences: Vec<Vec<usize>>,
    /// Whether a record's response trains the actor (false: dropped by the rollout filter).
    pub actor_keep: Vec<bool>,
    /// Whether a record trains the critic.
    pub critic_keep: Vec<bool>,
    /// Per record, per response token.
    pub advantages: Vec<Vec<f32>>,
    /// Per record, per response token (step-level estimators broadcast one value).
    pub returns: Vec<Vec<f32>>,
    /// Critic values at rollout time, per record and response token (`token_gae`) or one per
    /// record (`step_gae`, broadcast); empty without a critic.
    pub old_values: Vec<Vec<f32>>,
    /// Where the critic is trained; `None` without a critic.
    pub critic_target: Option<CriticTarget>,
    /// Reference log-probs per record and response token, for the KL loss (`use_kl_loss`).
    pub ref_logprobs: Option<Vec<Vec<f32>>>,
    /// Self-imitation replay added to every actor mini-batch; `None` when it is off.
    pub replay: Option<Replay<'a>>,
    /// Decoupled PPO on responses of an older policy version: the ratio is taken against these
    /// proximal log-probs and `advantages` already carry the behaviour weights. `None`: the
    /// ratio is against the records' own (behaviour) log-probs.
    pub proximal_logprobs: Option<Vec<Vec<f32>>>,
}

impl UpdateInputs<'_> {
    /// What a value MLP critic is fitted on, with its values at `target`.
    fn fit_batch(&self, target: CriticTarget) -> FitBatch<'_> {
        FitBatch {
            records: self.records,
            sequences: &self.sequences,
            keep: &self.critic_keep,
            returns: &self.returns,
            old_values: &self.old_values,
            target,
        }
    }
}

/// Optimizer-side settings of the update.
pub struct UpdateSettings<'a> {
    /// Policy and value loss settings.
    pub loss: &'a LossConfig,
    /// Passes of the actor over the batch.
    pub epochs: usize,
    /// Passes of the critic over the batch (a shared head's beyond the actor's train it alone).
    pub critic_epochs: usize,
    /// Sequences per mini-batch (across all ranks); 0 is taken as 1.
    pub mini_batch: usize,
    /// Learning rate of this update's actor step (the schedule's value).
    pub actor_lr: f64,
    /// Learning rate of this update's critic steps.
    pub critic_lr: f64,
    /// Global gradient-norm clipping threshold.
    pub max_grad_norm: f64,
    /// Temperature the rollout log-probs were computed under.
    pub temperature: f32,
    /// Token id padding fills with.
    pub pad_id: u32,
    /// Seed of the mini-batch shuffles.
    pub shuffle_seed: u64,
    /// Constrained decoding: the grammars the rollout sampled under.
    pub masks: &'a ResponseMasks,
    /// Train the critic only (critic warm-up): the policy's parameters stay as they are.
    pub freeze_actor: bool,
    /// The data-parallel world: this rank's part of each mini-batch, and the gradient sum.
    pub dist: &'a dyn Collective,
    /// Forward each mini-batch as a prefix tree: the sequences of a group share their common
    /// prefix, forwarded once ([`crate::train::learner::prefix_tree`]); the same losses and gradients as padded
    /// sequences, to float rounding.
    pub tree_forward: bool,
    /// The run's memory plan: each mini-batch is checked against it before its forward.
    pub memory: Option<&'a MemoryBudget>,
}

impl UpdateSettings<'_> {
    /// The layout of the update's forward passes.
    pub fn layout(&self) -> BatchLayout {
        BatchLayout {
            pad_id: self.pad_id,
            tree: self.tree_forward,
        }
    }

    /// How a value MLP critic is fitted after the actor's epochs.
    fn fit_settings(&self) -> FitSettings<'_> {
        FitSettings {
            loss: self.loss,
            epochs: self.critic_epochs,
            mini_batch: self.mini_batch,
            lr: self.critic_lr,
            max_grad_norm: self.max_grad_norm,
            shuffle_seed: self.shuffle_seed,
        }
    }
}

/// The critic side of the update: the critic and the optimizer that steps it.
pub struct CriticLearner<'a> {
    /// The critic being trained (any kind: separate model, shared head, MLP fit).
    pub critic: &'a mut dyn Critic,
    /// AdamW over the critic's parameters.
    pub opt: &'a mut AdamW,
}

/// The models and optimizers the update steps.
pub struct Learners<'a> {
    /// The policy being trained.
    pub policy: &'a Model,
    /// Steps the policy's parameters (a shared value head's excepted).
    pub actor_opt: &'a mut AdamW,
    /// The critic and its optimizer; `None` without a trained critic.
    pub critic: Option<CriticLearner<'a>>,
}

/// What one update did: its metrics (means over mini-batches, the skipped and stepped counts)
/// and each record's importance ratios.
#[derive(Clone, Debug)]
pub struct UpdateReport {
    /// Metrics of the update, by name.
    pub scalars: Scalars,
    /// Each record's importance ratios on its first and last pass.
    pub ratios: StepRatios,
}

/// Each record's importance ratio on its first and last pass through the policy loss, with the
/// epoch of the pass: `exp(mean over its response tokens of log π/π_old)` (the log-ratio bounded
/// as the loss bounds it), the length-normalised ratio of the step.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepRatios {
    /// Per record: ((epoch, ratio) of the first pass, (epoch, ratio) of the last).
    passes: Vec<Option<[(u32, f32); 2]>>,
}

impl StepRatios {
    fn new(records: usize) -> Self {
        Self {
            passes: vec![None; records],
        }
    }

    fn observe(&mut self, record: usize, epoch: u32, ratio: f32) {
        let pass = (epoch, ratio);
        let slot = &mut self.passes[record];
        *slot = Some(match *slot {
            None => [pass, pass],
            Some([first, last]) => [
                if epoch < first.0 { pass } else { first },
                if epoch >= last.0 { pass } else { last },
            ],
        });
    }

    /// The ratio on the record's first pass; `None` when the policy loss never saw it.
    pub fn first(&self, record: usize) -> Option<f32> {
        self.passes.get(record)?.map(|[first, _]| first.1)
    }

    /// The ratio on the record's last pass.
    pub fn last(&self, record: usize) -> Option<f32> {
        self.passes.get(record)?.map(|[_, last]| last.1)
    }

    /// Every rank's observations together (each rank saw the rows dealt to it).
    fn merged(self, dist: &dyn Collective) -> Result<Self, TrainError> {
        if dist.is_single_process() {
            return Ok(self);
        }
        let mine = serde_json::to_vec(&self).map_err(|e| TrainError::Data(e.to_string()))?;
        let mut all = StepRatios::new(self.passes.len());
        for (rank, bytes) in dist.all_gather_bytes(&mine)?.iter().enumerate() {
            let theirs: StepRatios = serde_json::from_slice(bytes)
                .map_err(|e| TrainError::Data(format!("ratios reported by rank {rank}: {e}")))?;
            for (record, pass) in theirs.passes.iter().enumerate() {
                for &(epoch, ratio) in pass.iter().flatten() {
                    all.observe(record, epoch, ratio);
                }
            }
        }
        Ok(all)
    }
}

/// Runs the PPO epochs; returns the metrics (means over mini-batches), the skipped count and
/// each record's ratios.
pub fn ppo_update(
    inputs: &UpdateInputs,
    settings: &UpdateSettings,
    learners: &mut Learners,
) -> Result<UpdateReport, TrainError> {
    let mut means = Means::default();
    let mut ratios = StepRatios::new(inputs.records.len());
    let mut skipped = 0usize;
    let mut critic_skipped = 0usize;
    let mut actor_updates = 0usize;
    // Passes in which the critic trains on the actor's mini-batches (a feature critic is fitted
    // after them, on features of its own).
    let mini_batch_critic_epochs = match &learners.critic {
        Some(c) if c.critic.trains_on_mini_batches() => settings.critic_epochs,
        _ => 0,
    };
    let dist = settings.dist;
    for epoch in 0..settings.epochs.max(mini_batch_critic_epochs) {
        let train_actor = epoch < settings.epochs && !settings.freeze_actor;
        let train_critic = epoch < mini_batch_critic_epochs;
        if !(train_actor || train_critic) {
            continue;
        }
        for (k, chunk) in mini_batches(inputs, settings, epoch as u64)
            .into_iter()
            .enumerate()
        {
            let seqs: Vec<Vec<usize>> = ranks::deal(&chunk, dist)
                .into_iter()
                .map(|s| inputs.sequences[s].clone())
                .collect();
            let part = local_batch(inputs, settings, learners.policy, &seqs)?;
            // A single process skips an empty mini-batch; in a launched world every rank takes part
            // in each step's collectives, with or without rows of its own.
            if part.is_none() && dist.is_single_process() {
                continue;
            }
            let part = part.as_ref().map(|(p, b)| (p, b));
            if train_actor {
                let draw = [epoch as u64, k as u64];
                let (actor_skipped, stepped) = actor_step(
                    inputs,
                    settings,
                    learners,
                    part,
                    draw,
                    (&mut means, &mut ratios),
                )?;
                skipped += usize::from(actor_skipped);
                actor_updates += usize::from(stepped);
            }
            let Some(learner) = learners.critic.as_mut() else {
                continue;
            };
            // A head on the policy's trunk trains with the actor's backward when the actor steps.
            let in_actor_backward = learner.critic.trains_in_actor_backward() && train_actor;
            if !train_critic || in_actor_backward {
                continue;
            }
            let values = match part {
                Some((_, batch)) => Some(learner.critic.values(learners.policy, &batch.input)?),
                None => None,
            };
            let local = values.zip(part);
            critic_skipped += usize::from(critic_step(
                inputs,
                settings,
                local,
                learner.opt,
                &mut means,
            )?);
        }
    }
    if let (Some(target), Some(learner)) = (inputs.critic_target, learners.critic.as_mut()) {
        let ctx = FitContext {
            policy: learners.policy,
            layout: settings.layout(),
            masks: settings.masks,
            settings: settings.fit_settings(),
        };
        critic_skipped +=
            learner
                .critic
                .fit(&inputs.fit_batch(target), &ctx, learner.opt, &mut means)?;
    }
    let mut out = Scalars::new();
    means.merged(dist)?.into_scalars(&mut out);
    out.insert("actor/skipped_updates".into(), skipped as f64);
    out.insert("actor/updates".into(), actor_updates as f64);
    if learners.critic.is_some() {
        out.insert("critic/skipped_updates".into(), critic_skipped as f64);
    }
    Ok(UpdateReport {
        scalars: out,
        ratios: ratios.merged(dist)?,
    })
}

/// The epoch's mini-batches: a seeded shuffle cut into chunks of `mini_batch` sequences, so each
/// mini-batch is a uniform sample of the rollout. (Grouping sequences by length would save padding
/// but makes a mini-batch's states alike: in the window layout a prompt's length tells how many
/// directions lead to the goal, and signed advantages then fit each such subset's action marginal
/// instead of the map: `docs/experiments/frozenlake-learning.md`, the uniform mini-batch runs.)
fn mini_batches(inputs: &UpdateInputs, settings: &UpdateSettings, epoch: u64) -> Vec<Vec<usize>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed::derive(settings.shuffle_seed, &[epoch]));
    let mut order: Vec<usize> = (0..inputs.sequences.len()).collect();
    order.shuffle(&mut rng);
    order
        .chunks(settings.mini_batch.max(1))
        .map(<[usize]>::to_vec)
        .collect()
}

/// A `[rows, width]` host matrix from per-row vectors (each at most `width` long, zero-padded).
fn rows_tensor(
    rows: impl Iterator<Item = Vec<f32>>,
    n: usize,
    width: usize,
    device: &Device,
) -> Result<Tensor, TrainError> {
    let mut flat = vec![0f32; n * width];
    for (i, row) in rows.enumerate() {
        flat[i * width..i * width + row.len().min(width)]
            .copy_from_slice(&row[..row.len().min(width)]);
    }
    Ok(Tensor::from_vec(flat, (n, width), device)?)
}

/// Token mask `[rows, width]` with rows not in `keep` zeroed.
fn row_mask(
    p: &PackedBatch,
    keep: &[bool],
    device: &Device,
) -> Result<(Tensor, usize), TrainError> {
    let w = p.max_response_len;
    let mut m = p.token_mask.clone();
    let mut kept = 0;
    for (row, &r) in p.record_of_row.iter().enumerate() {
        if keep[r] {
            kept += 1;
        } else {
            m[row * w..(row + 1) * w].fill(0.0);
        }
    }
    Ok((Tensor::from_vec(m, (p.rows, w), device)?, kept))
}

/// This rank's sequences packed and on the device; `None` when they hold no row.
fn local_batch(
    inputs: &UpdateInputs,
    settings: &UpdateSettings,
    policy: &Model,
    seqs: &[Vec<usize>],
) -> Result<Option<(PackedBatch, DeviceBatch)>, TrainError> {
    if seqs.is_empty() {
        return Ok(None);
    }
    let mut packed = pack(inputs.records, seqs)?;
    packed.read_values_after_forced(inputs.records, |r| settings.masks.forced_prefix(r))?;
    if packed.rows == 0 {
        return Ok(None);
    }
    let batch = DeviceBatch::laid_out(
        &packed,
        (inputs.records, seqs),
        settings.layout(),
        policy.device(),
    )?
    .constrained(&packed, inputs.records, settings.masks)?;
    if let Some(memory) = settings.memory {
        let logit_rows = packed.rows * packed.max_response_len;
        memory
            .check_forward(batch.input.positions(), logit_rows, packed.seq_len)
            .map_err(TrainError::Memory)?;
    }
    Ok(Some((packed, batch)))
}

/// Mask tokens per row of `p`, rows not in `keep` counted as empty.
fn kept_counts(p: &PackedBatch, keep: &[bool]) -> Vec<f64> {
    let w = p.max_response_len;
    p.record_of_row
        .iter()
        .enumerate()
        .map(|(row, &r)| {
            if keep[r] {
                p.token_mask[row * w..(row + 1) * w]
                    .iter()
                    .map(|&m| f64::from(m))
                    .sum()
            } else {
                0.0
            }
        })
        .collect()
}

/// `(rows kept, loss normaliser)` of the rows of `p` in `keep` whose mask tokens are `counts`
/// (row widths `width`), under the run's loss aggregation.
fn normaliser(
    settings: &UpdateSettings,
    p: &PackedBatch,
    keep: &[bool],
    counts: &[f64],
    width: usize,
) -> (usize, f64) {
    let kept = p.record_of_row.iter().filter(|&&r| keep[r]).count();
    let l = settings.loss;
    (
        kept,
        agg_normaliser(counts, width, l.loss_agg_mode, l.loss_norm_len),
    )
}

/// [`normaliser`] of the critic loss on the rows of `p`: at every response token or one per row
/// (the step start).
fn critic_normaliser(
    inputs: &UpdateInputs,
    settings: &UpdateSettings,
    p: &PackedBatch,
) -> (usize, f64) {
    let keep = &inputs.critic_keep;
    match inputs.critic_target {
        Some(CriticTarget::AllResponseTokens) => {
            let counts = kept_counts(p, keep);
            normaliser(settings, p, keep, &counts, p.max_response_len)
        }
        _ => {
            let counts: Vec<f64> = p
                .record_of_row
                .iter()
                .map(|&r| f64::from(u8::from(keep[r])))
                .collect();
            normaliser(settings, p, keep, &counts, 1)
        }
    }
}

/// One actor update (plus the self-imitation replay of mini-batch `draw` = [epoch, index]) on
/// this rank's part of the mini-batch (`None`: no rows here), logging into `means` and the
/// rows' ratios; returns (skipped, stepped).
fn actor_step(
    inputs: &UpdateInputs,
    settings: &UpdateSettings,
    learners: &mut Learners,
    part: Option<(&PackedBatch, &DeviceBatch)>,
    draw: [u64; 2],
    (means, ratios): (&mut Means, &mut StepRatios),
) -> Result<(bool, bool), TrainError> {
    let dist = settings.dist;
    let shared_head = learners
        .critic
        .as_ref()
        .is_some_and(|c| c.critic.trains_in_actor_backward());
    let actor = part.map_or((0, 0.0), |(p, _)| {
        let counts = kept_counts(p, &inputs.actor_keep);
        normaliser(settings, p, &inputs.actor_keep, &counts, p.max_response_len)
    });
    let critic = match (part, shared_head) {
        (Some((p, _)), true) => critic_normaliser(inputs, settings, p),
        _ => (0, 0.0),
    };
    let replay = match &inputs.replay {
        Some(replay) => replay.draw(
            learners.policy,
            settings.layout(),
            settings.masks,
            &draw,
            dist,
        )?,
        None => None,
    };
    let replay_norm = replay.as_ref().map_or((0, 0.0), |r| (r.rows(), r.tokens()));
    let [actor_share, critic_share, replay_share] =
        ranks::shares([actor, critic, replay_norm], dist)?;
    if actor_share.global_rows == 0.0 {
        return Ok((false, false));
    }
    let mut loss: Option<Tensor> = None;
    if let Some((p, batch)) = part.filter(|_| actor.0 > 0) {
        let pass = (ratios, draw[0] as u32);
        let (policy_part, shared_values) = means.part(&actor_share, |m| {
            actor_loss(inputs, settings, learners, (p, batch), m, pass)
        })?;
        let mut l = ranks::scaled(policy_part, &actor_share, dist)?;
        if let Some(values) = shared_values {
            let (vf, _) = means.part(&critic_share, |m| {
                critic_loss(inputs, settings, &values, p, batch, m)
            })?;
            l = (l + ranks::scaled(vf, &critic_share, dist)?)?;
        }
        loss = Some(l);
    }
    if let Some(replayed) = &replay {
        if let Some((weighted, nll)) = replayed.loss(learners.policy)? {
            let weighted = ranks::scaled(weighted, &replay_share, dist)?;
            loss = Some(match loss {
                Some(l) => (l + weighted)?,
                None => weighted,
            });
            means.part(&replay_share, |m| m.add("self_imitation/nll", nll));
        }
    }
    let (finite, local_grads) = backward(loss.as_ref())?;
    // The graph's activations go before the optimizer step's buffers come.
    drop((loss, replay));
    let actor_rates = (settings.actor_lr, settings.max_grad_norm);
    let stepped = step_over_ranks(
        learners.actor_opt,
        local_grads.as_ref(),
        finite,
        actor_rates,
        dist,
    )?;
    let Some(report) = stepped else {
        return Ok((true, false));
    };
    means.add("actor/grad_norm", report.grad_norm);
    means.add("actor/lr", report.lr);
    if let Some(CriticLearner { opt: head_opt, .. }) = learners
        .critic
        .as_mut()
        .filter(|c| c.critic.trains_in_actor_backward())
    {
        // The head's parameters are the head optimizer's: summed over ranks on their own.
        let rates = (settings.critic_lr, settings.max_grad_norm);
        let head = step_over_ranks(head_opt, local_grads.as_ref(), finite, rates, dist)?
            .ok_or_else(|| TrainError::Data("a shared head lost its gradient".into()))?;
        means.add("critic/grad_norm", head.grad_norm);
        means.add("critic/lr", head.lr);
    }
    Ok((report.skipped, !report.skipped))
}

/// The policy loss of this rank's rows (aggregated over them) and, with a shared value head,
/// the head's values from the same trunk pass; logs the policy metrics, and the kept rows'
/// ratios as seen in epoch `pass.1`.
fn actor_loss(
    inputs: &UpdateInputs,
    settings: &UpdateSettings,
    learners: &Learners,
    (p, batch): (&PackedBatch, &DeviceBatch),
    means: &mut Means,
    pass: (&mut StepRatios, u32),
) -> Result<(Tensor, Option<Tensor>), TrainError> {
    let device = learners.policy.device().clone();
    let (mask, _) = row_mask(p, &inputs.actor_keep, &device)?;
    let shared_head = learners
        .critic
        .as_ref()
        .is_some_and(|c| c.critic.trains_in_actor_backward());
    let (logp, entropy, shared_values) = if shared_head {
        let (lp, ent, v) = shared_forward(learners.policy, batch, settings.temperature)?;
        (lp, ent, Some(v))
    } else {
        let (lp, ent) = learners.policy.head_logprobs_entropy(
            &learners.policy.hidden(&batch.input)?,
            &batch.token_index,
            &batch.token_targets,
            settings.temperature,
            batch.logit_bias.as_ref(),
        )?;
        (lp, ent, None)
    };
    let logp = logp.reshape((p.rows, p.max_response_len))?;
    let entropy = entropy.reshape((p.rows, p.max_response_len))?;
    let rec = |r: usize| &inputs.records[r];
    let old_of = |r: usize| match &inputs.proximal_logprobs {
        Some(proximal) => proximal[r].clone(),
        None => rec(r).response_logprobs.clone(),
    };
    let old = rows_tensor(
        p.record_of_row.iter().map(|&r| old_of(r)),
        p.rows,
        p.max_response_len,
        &device,
    )?;
    let adv = rows_tensor(
        p.record_of_row
            .iter()
            .map(|&r| inputs.advantages[r].clone()),
        p.rows,
        p.max_response_len,
        &device,
    )?;
    let reference = inputs
        .ref_logprobs
        .as_ref()
        .map(|r| {
            let rows = p.record_of_row.iter().map(|&row| r[row].clone());
            rows_tensor(rows, p.rows, p.max_response_len, &device)
        })
        .transpose()?;
    observe_ratios(p, &inputs.actor_keep, &logp, &old, pass)?;
    let (loss, m) = policy_loss(
        &logp,
        &old,
        &adv,
        &mask,
        reference.as_ref(),
        &entropy,
        settings.loss,
    )?;
    if reference.is_some() {
        means.add("actor/kl_loss", m.kl_loss);
    }
    if settings.loss.negative_unlikelihood_coef > 0.0 {
        means.add("actor/unlikelihood_loss", m.unlikelihood_loss);
    }
    means.add("actor/pg_loss", m.pg_loss);
    means.add("actor/entropy", m.entropy);
    means.add("actor/clipfrac", m.clipfrac);
    means.add("actor/clipfrac_high", m.clipfrac_high);
    means.add("actor/clipfrac_low", m.clipfrac_low);
    means.add("actor/clipfrac_lower", m.clipfrac_lower);
    means.add("actor/approx_kl", m.approx_kl);
    means.add("actor/ratio_mean", m.ratio_mean);
    means.add("actor/ratio_max", m.ratio_max);
    means.add("actor/ratio_min", m.ratio_min);
    Ok((loss, shared_values))
}

/// Records each kept row's length-normalised ratio (`exp` of its mean token log-ratio, bounded
/// as the loss bounds it) for epoch `epoch`.
fn observe_ratios(
    p: &PackedBatch,
    keep: &[bool],
    logp: &Tensor,
    old: &Tensor,
    (ratios, epoch): (&mut StepRatios, u32),
) -> Result<(), TrainError> {
    let bound = LOG_RATIO_BOUND as f32;
    let log_ratio = (logp.detach().to_dtype(candle_core::DType::F32)? - old)?.to_vec2::<f32>()?;
    let w = p.max_response_len;
    for (row, &record) in p.record_of_row.iter().enumerate() {
        if !keep[record] {
            continue;
        }
        let mask = &p.token_mask[row * w..(row + 1) * w];
        let (sum, count) = log_ratio[row]
            .iter()
            .zip(mask)
            .filter(|(_, &m)| m > 0.0)
            .fold((0f32, 0usize), |(s, c), (&lr, _)| {
                (s + lr.clamp(-bound, bound), c + 1)
            });
        let ratio = (sum / count.max(1) as f32).exp();
        // A non-finite pass (a skipped update's NaN) is left out: the log records none for it.
        if count > 0 && ratio.is_finite() {
            ratios.observe(record, epoch, ratio);
        }
    }
    Ok(())
}

/// One trunk pass for both heads of a policy with a shared value head: log-probs and entropies
/// at the response tokens (`[rows * width]`, the LM head on those positions only) and values at
/// every position (`[B, T]`). Half the cost of running the policy and its value head separately.
fn shared_forward(
    policy: &Model,
    batch: &DeviceBatch,
    temperature: f32,
) -> Result<(Tensor, Tensor, Tensor), TrainError> {
    let hidden = policy.hidden(&batch.input)?;
    let (logp, entropy) = policy.head_logprobs_entropy(
        &hidden,
        &batch.token_index,
        &batch.token_targets,
        temperature,
        batch.logit_bias.as_ref(),
    )?;
    Ok((logp, entropy, policy.head_values(&hidden)?))
}

/// The value loss of `values` (`[B, T]`) at the critic target positions.
fn critic_loss(
    inputs: &UpdateInputs,
    settings: &UpdateSettings,
    values: &Tensor,
    p: &PackedBatch,
    batch: &DeviceBatch,
    means: &mut Means,
) -> Result<(Tensor, bool), TrainError> {
    let device = values.device().clone();
    let rows = || p.record_of_row.iter().copied();
    let (v, ret, old, mask, kept) = match inputs.critic_target {
        Some(CriticTarget::AllResponseTokens) => {
            let (mask, kept) = row_mask(p, &inputs.critic_keep, &device)?;
            let w = p.max_response_len;
            (
                batch.at_tokens(values, p)?,
                rows_tensor(
                    rows().map(|r| inputs.returns[r].clone()),
                    p.rows,
                    w,
                    &device,
                )?,
                rows_tensor(
                    rows().map(|r| inputs.old_values[r].clone()),
                    p.rows,
                    w,
                    &device,
                )?,
                mask,
                kept,
            )
        }
        _ => {
            let first = |xs: &Vec<f32>| vec![xs.first().copied().unwrap_or(0.0)];
            let keep: Vec<f32> = rows()
                .map(|r| f32::from(u8::from(inputs.critic_keep[r])))
                .collect();
            let kept = keep.iter().filter(|&&k| k > 0.0).count();
            (
                batch.at_step_starts(values, p)?,
                rows_tensor(
                    rows().map(|r| first(&inputs.returns[r])),
                    p.rows,
                    1,
                    &device,
                )?,
                rows_tensor(
                    rows().map(|r| first(&inputs.old_values[r])),
                    p.rows,
                    1,
                    &device,
                )?,
                Tensor::from_vec(keep, (p.rows, 1), &device)?,
                kept,
            )
        }
    };
    let (loss, m) = value_loss(&v, &old, &ret, &mask, settings.loss)?;
    if kept > 0 {
        means.add("critic/vf_loss", m.vf_loss);
        means.add("critic/vf_clipfrac", m.vf_clipfrac);
        means.add("critic/vf_explained_var_minibatch", m.vf_explained_var);
        means.add("critic/value_mean", m.value_mean);
    }
    Ok((loss, kept > 0))
}

/// One critic update on `values` (of a separate critic, or of the shared head during the critic
/// warm-up) at this rank's rows (`None`: no rows here), stepping `opt`; returns whether it was
/// skipped for a non-finite loss/gradient.
fn critic_step(
    inputs: &UpdateInputs,
    settings: &UpdateSettings,
    local: Option<(Tensor, (&PackedBatch, &DeviceBatch))>,
    opt: &mut AdamW,
    means: &mut Means,
) -> Result<bool, TrainError> {
    let dist = settings.dist;
    let norm = local.as_ref().map_or((0, 0.0), |(_, (p, _))| {
        critic_normaliser(inputs, settings, p)
    });
    let [share] = ranks::shares([norm], dist)?;
    if share.global_rows == 0.0 {
        return Ok(false);
    }
    let loss = match local.filter(|_| norm.0 > 0) {
        Some((values, (p, batch))) => {
            let (loss, _) = means.part(&share, |m| {
                critic_loss(inputs, settings, &values, p, batch, m)
            })?;
            Some(ranks::scaled(loss, &share, dist)?)
        }
        None => None,
    };
    step_critic(
        opt,
        loss,
        (settings.critic_lr, settings.max_grad_norm),
        dist,
        means,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::OptimizerConfig;
    use crate::model::ModelConfig;
    use crate::model::TrainInput;
    use crate::model::{Critic as CriticTrunk, ValueMlp};
    use crate::test_support::{assert_close, assert_rows_close};
    use crate::train::learner::batch::{pad, trajectories};
    use crate::train::learner::critic::fit;
    use crate::train::learner::critic::{FeatureCritic, SeparateCritic, SharedHead};
    use crate::train::learner::scoring::{critic_values, response_logprobs};

    fn record(adv_len: usize) -> StepRecord {
        StepRecord {
            obs_ids: vec![5, 6, 7, 8],
            response_ids: (10..10 + adv_len as u32).collect(),
            response_logprobs: vec![-3.0; adv_len],
            terminated: true,
            ..Default::default()
        }
    }

    /// Per-token log-probs of `rec`'s response under `policy` (what the rollout would record).
    fn token_logprobs(policy: &Model, rec: &StepRecord) -> Vec<f32> {
        let p = pack(std::slice::from_ref(rec), &[vec![0]]).unwrap();
        let batch = DeviceBatch::new(&p, 0, &Device::Cpu).unwrap();
        let tensor = |x: Vec<u32>| Tensor::from_vec(x, (1, p.seq_len), &Device::Cpu).unwrap();
        let (ids, mask) = pad(&p.inputs, p.seq_len, 0);
        let (targets, _) = pad(&p.targets, p.seq_len, 0);
        // The full-vocabulary path at every position, independent of the update's gathered head.
        let (lp, _) = policy
            .token_logprobs_entropy(&tensor(ids), &tensor(mask), &tensor(targets), 1.0)
            .unwrap();
        batch
            .at_tokens(&lp, &p)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    /// Sum of the log-probs of `rec`'s response under `policy`.
    fn response_logprob(policy: &Model, rec: &StepRecord) -> f32 {
        token_logprobs(policy, rec).iter().sum()
    }

    fn run(advantage: f32) -> (Scalars, Vec<f32>, Vec<f32>) {
        run_on(advantage).0
    }

    #[allow(clippy::type_complexity)]
    fn run_on(advantage: f32) -> ((Scalars, Vec<f32>, Vec<f32>), f32, f32) {
        run_with(advantage, LossConfig::default(), None, &[])
    }

    /// One update of a tiny policy on one 3-token response; `reference_shift` sets the reference
    /// log-probs to the policy's own plus that shift (for the KL loss); `replayed` is a
    /// self-imitation buffer (empty: off).
    #[allow(clippy::type_complexity)]
    fn run_with(
        advantage: f32,
        loss: LossConfig,
        reference_shift: Option<f32>,
        replayed: &[StepRecord],
    ) -> ((Scalars, Vec<f32>, Vec<f32>), f32, f32) {
        let device = Device::Cpu;
        let policy = Model::new(&ModelConfig::tiny(64), 7, &device).unwrap();
        let mut opt = AdamW::new(policy.named_vars(), &OptimizerConfig::default()).unwrap();
        let mut records = vec![record(3)];
        records[0].response_logprobs = token_logprobs(&policy, &records[0]);
        let weights = |m: &Model| {
            m.named_vars()[0]
                .1
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let before = weights(&policy);
        let lp_before = response_logprob(&policy, &records[0]);
        let replayed_spans: Vec<_> = (0..replayed.len()).map(|i| i..i + 1).collect();
        let inputs = UpdateInputs {
            records: &records,
            sequences: vec![vec![0]],
            actor_keep: vec![true],
            critic_keep: vec![true],
            advantages: vec![vec![advantage; 3]],
            returns: vec![vec![0.0; 3]],
            old_values: Vec::new(),
            critic_target: None,
            ref_logprobs: reference_shift.map(|shift| {
                vec![records[0]
                    .response_logprobs
                    .iter()
                    .map(|l| l + shift)
                    .collect()]
            }),
            proximal_logprobs: None,
            replay: (!replayed.is_empty()).then_some(Replay {
                records: replayed,
                spans: &replayed_spans,
                coef: 1.0,
                batch_size: 1,
                seed: 3,
            }),
        };
        let settings = UpdateSettings {
            loss: &loss,
            epochs: 1,
            critic_epochs: 1,
            mini_batch: 1,
            actor_lr: 1e-2,
            critic_lr: 1e-2,
            max_grad_norm: 1.0,
            temperature: 1.0,
            pad_id: 0,
            shuffle_seed: 1,
            masks: &ResponseMasks::default(),
            freeze_actor: false,
            dist: &crate::dist::Single,
            tree_forward: false,
            memory: None,
        };
        let mut learners = Learners {
            policy: &policy,
            actor_opt: &mut opt,
            critic: None,
        };
        let out = ppo_update(&inputs, &settings, &mut learners)
            .unwrap()
            .scalars;
        let lp_after = response_logprob(&policy, &records[0]);
        ((out, before, weights(&policy)), lp_before, lp_after)
    }

    #[test]
    fn positive_advantage_raises_the_response_logprob() {
        let (_, before, after) = run_on(1.0);
        assert!(after > before, "{before} -> {after}");
        let (_, before, after) = run_on(-1.0);
        assert!(after < before, "{before} -> {after}");
    }

    #[test]
    fn kl_loss_pulls_the_response_towards_the_reference() {
        let loss = LossConfig {
            kl: crate::algo::config::KlConfig {
                coef: 1.0,
                estimator: crate::algo::config::KlEstimator::K3,
                mode: crate::algo::config::KlMode::Loss,
            },
            ..LossConfig::default()
        };
        // Zero advantage: only the KL term moves the policy.
        let ((out, _, _), before, after) = run_with(0.0, loss.clone(), Some(1.0), &[]);
        assert!(out["actor/kl_loss"] > 0.0, "{out:?}");
        assert!(after > before, "reference more likely: {before} -> {after}");
        let (_, before, after) = run_with(0.0, loss, Some(-1.0), &[]);
        assert!(after < before, "reference less likely: {before} -> {after}");
    }

    #[test]
    fn self_imitation_raises_the_replayed_response() {
        // Zero advantage: only the replayed negative log-likelihood moves the policy, and the
        // replayed step is the trained record itself.
        let ((out, _, _), before, after) = run_with(0.0, LossConfig::default(), None, &[record(3)]);
        assert!(out["self_imitation/nll"] > 0.0, "{out:?}");
        assert!(after > before, "{before} -> {after}");
        let ((out, _, _), before, after) = run_with(0.0, LossConfig::default(), None, &[]);
        assert!(!out.contains_key("self_imitation/nll"));
        assert!((after - before).abs() < 1e-4, "{before} -> {after}");
    }

    #[test]
    fn finite_update_changes_weights() {
        let (out, before, after) = run(1.0);
        assert_eq!(out["actor/skipped_updates"], 0.0);
        assert_eq!(out["actor/updates"], 1.0);
        assert_ne!(before, after);
    }

    #[test]
    fn nan_loss_is_skipped_and_weights_stay() {
        let (out, before, after) = run(f32::NAN);
        assert_eq!(out["actor/skipped_updates"], 1.0);
        assert_eq!(out["actor/updates"], 0.0);
        assert_eq!(before, after);
    }

    /// Token `i` of a stream named by `salt` (ids 2..62 of the tiny model's 64).
    fn token(salt: u64, i: usize) -> u32 {
        ((salt.wrapping_mul(2654435761) >> 7).wrapping_add(i as u64 * 37 + salt * 11) % 60) as u32
            + 2
    }

    /// `groups` groups of `branches` two-step trajectories each: the group's 30-token prompt, a
    /// step-0 response (the same in every branch of a group with `same_first_step`, else one of
    /// each branch's own), a 4-token observation, and a step-1 response of each branch's own.
    fn group_records(groups: u64, branches: u64, same_first_step: bool) -> Vec<StepRecord> {
        let mut records = Vec::new();
        for g in 0..groups {
            for b in 0..branches {
                let traj = g * branches + b;
                let (first, first_len) = if same_first_step {
                    (100 + g, 6)
                } else {
                    (200 + traj, 6 + b as usize % 2)
                };
                let steps = [
                    (
                        (0..30).map(|i| token(g, i)).collect::<Vec<_>>(),
                        first_len,
                        first,
                    ),
                    (vec![3, 4, 5, 6], 4 + b as usize, 300 + traj),
                ];
                let mut context = 0;
                for (step, (obs, len, salt)) in steps.into_iter().enumerate() {
                    let response: Vec<u32> = (0..len).map(|i| token(salt, i)).collect();
                    let n = obs.len() + response.len();
                    records.push(StepRecord {
                        traj_id: traj,
                        group_id: g,
                        step_index: step as u32,
                        context_len: context,
                        obs_ids: obs,
                        response_logprobs: vec![-4.0; response.len()],
                        response_ids: response,
                        ..Default::default()
                    });
                    context += n as u32;
                }
            }
        }
        records
    }

    /// Per record: the value `f(record, token)` at each response token.
    fn per_token(records: &[StepRecord], f: impl Fn(usize, usize) -> f32) -> Vec<Vec<f32>> {
        records
            .iter()
            .enumerate()
            .map(|(r, rec)| (0..rec.response_ids.len()).map(|j| f(r, j)).collect())
            .collect()
    }

    fn tree_inputs<'a>(records: &'a [StepRecord], sequences: Vec<Vec<usize>>) -> UpdateInputs<'a> {
        let n = records.len();
        UpdateInputs {
            records,
            sequences,
            actor_keep: vec![true; n],
            critic_keep: vec![true; n],
            advantages: per_token(records, |r, j| ((r * 7 + j) as f32 * 0.37).sin()),
            returns: per_token(records, |r, _| (r as f32 * 0.3).cos()),
            old_values: per_token(records, |r, _| (r as f32 * 0.5).sin() * 0.1),
            critic_target: Some(CriticTarget::StepStart),
            ref_logprobs: None,
            replay: None,
            proximal_logprobs: None,
        }
    }

    /// The actor loss plus the shared head's value loss of one mini-batch of every sequence of
    /// `inputs`, forwarded padded or as a tree; with the gradient of every parameter by name.
    fn actor_and_head(
        inputs: &UpdateInputs,
        policy: &Model,
        tree_forward: bool,
    ) -> (f32, Vec<(String, Tensor)>) {
        let loss = LossConfig {
            entropy_loss_coef: 0.01,
            ..LossConfig::default()
        };
        let settings = settings_for(&loss, tree_forward);
        let mut head_opt = AdamW::new(policy.named_vars(), &OptimizerConfig::default()).unwrap();
        let mut actor_opt = AdamW::new(policy.named_vars(), &OptimizerConfig::default()).unwrap();
        let learners = Learners {
            policy,
            actor_opt: &mut actor_opt,
            critic: Some(CriticLearner {
                critic: &mut SharedHead,
                opt: &mut head_opt,
            }),
        };
        let (p, batch) = local_batch(inputs, &settings, policy, &inputs.sequences)
            .unwrap()
            .unwrap();
        assert_eq!(matches!(batch.input, TrainInput::Tree(_)), tree_forward);
        let mut means = Means::default();
        let mut ratios = StepRatios::new(inputs.records.len());
        let pass = (&mut ratios, 0);
        let (pg, values) =
            actor_loss(inputs, &settings, &learners, (&p, &batch), &mut means, pass).unwrap();
        let (vf, _) =
            critic_loss(inputs, &settings, &values.unwrap(), &p, &batch, &mut means).unwrap();
        let total = (pg + vf).unwrap();
        let grads = total.backward().unwrap();
        let named = policy
            .named_vars()
            .into_iter()
            .map(|(name, var)| {
                let g = grads
                    .get(var.as_tensor())
                    .expect("every parameter has a gradient");
                (name, g.clone())
            })
            .collect();
        (total.to_scalar::<f32>().unwrap(), named)
    }

    fn settings_for(loss: &LossConfig, tree_forward: bool) -> UpdateSettings<'_> {
        UpdateSettings {
            loss,
            epochs: 1,
            critic_epochs: 1,
            mini_batch: 64,
            actor_lr: 1e-3,
            critic_lr: 1e-3,
            max_grad_norm: 1.0,
            temperature: 1.0,
            pad_id: 0,
            shuffle_seed: 1,
            masks: &EMPTY_MASKS,
            freeze_actor: false,
            dist: &crate::dist::Single,
            tree_forward,
            memory: None,
        }
    }

    static EMPTY_MASKS: std::sync::LazyLock<ResponseMasks> =
        std::sync::LazyLock::new(ResponseMasks::default);

    /// The tree forward's loss and every gradient against the padded forward's, on `records`
    /// in one mini-batch of `sequences`.
    fn assert_tree_matches_padded(records: &[StepRecord], sequences: Vec<Vec<usize>>) {
        let mut policy = Model::new(&ModelConfig::tiny(64), 5, &Device::Cpu).unwrap();
        policy.attach_value_head(6).unwrap();
        let inputs = tree_inputs(records, sequences);
        let (padded_loss, padded) = actor_and_head(&inputs, &policy, false);
        let (tree_loss, tree) = actor_and_head(&inputs, &policy, true);
        assert!(
            (tree_loss - padded_loss).abs() <= 1e-5 * padded_loss.abs(),
            "loss {tree_loss} vs {padded_loss}"
        );
        assert_eq!(tree.len(), padded.len());
        for ((name, t), (_, p)) in tree.iter().zip(&padded) {
            assert_close(name, t, p);
        }
    }

    /// The packed tokens of the tree of every sequence of `records` (concat layout).
    fn packed_tokens(records: &[StepRecord]) -> (usize, usize) {
        let sequences = trajectories(records);
        let p = pack(records, &sequences).unwrap();
        let groups: Vec<u64> = sequences.iter().map(|s| records[s[0]].group_id).collect();
        let tree = crate::train::learner::prefix_tree::PrefixTree::new(&p, &groups);
        (p.inputs.iter().map(Vec::len).sum(), tree.ids.len())
    }

    #[test]
    fn tree_forward_matches_padded_loss_and_every_gradient() {
        // Two groups of three trajectories: each shares its prompt, then diverges at step 0.
        let records = group_records(2, 3, false);
        let (total, packed) = packed_tokens(&records);
        // The last prompt token (which scores the first response token) is shared: 29 of 30
        // prompt tokens are saved per extra branch.
        assert_eq!(total - packed, 2 * 2 * 30, "{total} → {packed}");
        assert_tree_matches_padded(&records, trajectories(&records));
    }

    #[test]
    fn tree_forward_is_exact_when_the_whole_first_step_and_its_scores_are_shared() {
        // Every branch of a group sampled the same step-0 response: the groups share the prompt,
        // the response and the step-1 observation, so all of step 0's scored positions (and the
        // step-start values of both steps) lie in the shared prefix and count once per branch.
        let records = group_records(2, 3, true);
        let (total, packed) = packed_tokens(&records);
        let shared_per_branch = 30 + 6 + 4;
        assert!(
            total - packed >= 2 * 2 * shared_per_branch,
            "{total} → {packed}"
        );
        assert_tree_matches_padded(&records, trajectories(&records));
    }

    #[test]
    fn tree_forward_is_exact_on_window_steps_and_singletons() {
        // Window layout: every step its own sequence (step 1 re-rendered from scratch), and a
        // third group with a single trajectory, which shares nothing.
        let mut records = group_records(3, 3, false);
        records.retain(|r| r.group_id < 2 || r.traj_id == 6);
        for r in records.iter_mut().filter(|r| r.step_index == 1) {
            r.obs_ids = [vec![token(r.group_id, 0)], r.obs_ids.clone()].concat();
            r.context_len = 0;
        }
        let sequences = (0..records.len()).map(|i| vec![i]).collect();
        assert_tree_matches_padded(&records, sequences);
    }

    #[test]
    fn a_separate_critic_reads_the_same_values_from_the_tree() {
        let records = group_records(2, 3, true);
        let inputs = tree_inputs(&records, trajectories(&records));
        let critic = CriticTrunk::new(&ModelConfig::tiny(64), 9, &Device::Cpu).unwrap();
        let policy = Model::new(&ModelConfig::tiny(64), 5, &Device::Cpu).unwrap();
        let loss = LossConfig::default();
        let run = |tree| {
            let settings = settings_for(&loss, tree);
            let (p, batch) = local_batch(&inputs, &settings, &policy, &inputs.sequences)
                .unwrap()
                .unwrap();
            let values = critic.values_of(&batch.input).unwrap();
            let at_starts = batch.at_step_starts(&values, &p).unwrap();
            let (vf, _) = critic_loss(
                &inputs,
                &settings,
                &values,
                &p,
                &batch,
                &mut Means::default(),
            )
            .unwrap();
            let grads = vf.backward().unwrap();
            let named: Vec<Tensor> = critic
                .named_vars()
                .iter()
                .map(|(_, v)| grads.get(v.as_tensor()).unwrap().clone())
                .collect();
            (at_starts, named)
        };
        let ((padded_values, padded), (tree_values, tree)) = (run(false), run(true));
        assert_close("step-start values", &tree_values, &padded_values);
        for ((name, _), (t, p)) in critic.named_vars().iter().zip(tree.iter().zip(&padded)) {
            assert_close(name, t, p);
        }
    }

    /// Two groups of three trajectories each sharing its prompt, and a trajectory alone in its
    /// group (concat layout).
    fn groups_and_a_singleton() -> Vec<StepRecord> {
        let mut records = group_records(3, 3, false);
        records.retain(|r| r.group_id < 2 || r.traj_id == 6);
        records
    }

    #[test]
    fn rollout_values_and_reference_logprobs_are_the_same_in_the_tree_layout() {
        let records = groups_and_a_singleton();
        let sequences = trajectories(&records);
        let cfg = ModelConfig::tiny(64);
        let mut policy = Model::new(&cfg, 5, &Device::Cpu).unwrap();
        policy.attach_value_head(6).unwrap();
        let critic = SeparateCritic::new(CriticTrunk::new(&cfg, 9, &Device::Cpu).unwrap());
        let features = FeatureCritic::new(ValueMlp::new(&policy, 4).unwrap());
        // Chunks of 4 sequences: a group is split over two chunks.
        let chunks = |tree| (4, BatchLayout { pad_id: 0, tree });
        let masks = ResponseMasks::default();
        let by_separate = |x: &TrainInput| critic.values(&policy, x);
        let by_features = |x: &TrainInput| features.values(&policy, x);
        let by_head = |x: &TrainInput| Ok(policy.values(x)?);
        type ValuesOf<'a> = &'a dyn Fn(&TrainInput) -> Result<Tensor, TrainError>;
        let critics: [(&str, ValuesOf); 3] = [
            ("separate critic", &by_separate),
            ("feature critic", &by_features),
            ("shared head", &by_head),
        ];
        for target in [CriticTarget::StepStart, CriticTarget::AllResponseTokens] {
            for (name, values_of) in critics {
                let run = |tree| {
                    let (seqs, device) = (&sequences, &Device::Cpu);
                    critic_values(
                        values_of,
                        &records,
                        seqs,
                        target,
                        chunks(tree),
                        &masks,
                        device,
                    )
                    .unwrap()
                };
                assert_rows_close(&format!("{name}, {target:?}"), &run(true), &run(false));
            }
        }
        let run = |tree| {
            response_logprobs(&policy, &records, &sequences, chunks(tree), 1.0, &masks).unwrap()
        };
        assert_rows_close("reference log-probs", &run(true), &run(false));
    }

    #[test]
    fn the_feature_critic_fit_reads_the_same_rows_from_the_tree() {
        let records = groups_and_a_singleton();
        let mut inputs = tree_inputs(&records, trajectories(&records));
        let policy = Model::new(&ModelConfig::tiny(64), 5, &Device::Cpu).unwrap();
        let loss = LossConfig::default();
        for target in [CriticTarget::StepStart, CriticTarget::AllResponseTokens] {
            inputs.critic_target = Some(target);
            let batch = inputs.fit_batch(target);
            let rows = |tree| {
                let settings = settings_for(&loss, tree);
                fit::feature_rows(&batch, &policy, (settings.layout(), settings.masks))
            };
            let (tree, padded) = (rows(true).unwrap(), rows(false).unwrap());
            assert_eq!(tree.returns, padded.returns, "{target:?}");
            assert_eq!(tree.old_values, padded.old_values, "{target:?}");
            assert_close(
                &format!("features, {target:?}"),
                &tree.features,
                &padded.features,
            );
        }
    }
}
