//! The critic a run trains beside its policy, behind one trait ([`Critic`]) with one
//! implementation per `critic.mode` ([`kinds`]): a separate model of the policy's family with a
//! value head, a value head on the policy's own trunk, or a value MLP on the policy's features or
//! on the env's state facts. The kind is chosen once, where the config is read ([`open`],
//! [`complete_fresh`]); the update and the run loop ask the critic what it does, never which it
//! is. The value MLPs are fitted after each update ([`fit`]), a state critic on the rows of the
//! last batches ([`history`]).

pub mod fit;
pub mod history;
pub mod kinds;

pub use kinds::{FeatureCritic, SeparateCritic, SharedHead, StateCritic};

use crate::algo::{AdamW, CriticTarget};
use crate::config::{Config, CriticMode};
use crate::dist::Collective;
use crate::env::build_session;
use crate::model::{Critic as CriticTrunk, Model, TrainInput, ValueMlp};
use crate::seed;
use crate::store::StepRecord;
use crate::train::learner::device_batch::BatchLayout;
use crate::train::learner::masks::ResponseMasks;
use crate::train::learner::optimizer_step::Means;
use crate::train::learner::ranks;
use crate::train::learner::scoring::critic_values;
use crate::train::TrainError;
use candle_core::{Device, Tensor, Var};
use fit::{FitBatch, FitSettings};
use std::path::Path;

/// Seed-path tag of the critic's initial weights.
const SEED_CRITIC: u64 = 2;

/// Where a run's critic comes from.
#[derive(Clone, Copy, Debug)]
pub enum CriticOrigin<'a> {
    /// A fresh run: a new critic as the config asks (a separate critic only when
    /// `critic.pretrain` names one; without, [`complete_fresh`] copies the policy after its warm
    /// start).
    Fresh,
    /// A checkpoint directory: its `critic/` (a shared head comes back with the policy) and a
    /// state critic's fitting history.
    Checkpoint(&'a Path),
}

/// What reading the rollout-time values of a batch takes besides the critic.
pub struct ValueReading<'a> {
    /// The policy (a shared head's trunk, a feature critic's features).
    pub policy: &'a Model,
    /// The batch's step records.
    pub records: &'a [StepRecord],
    /// Sequences (lists of record indices in step order).
    pub sequences: &'a [Vec<usize>],
    /// Which positions' values are read: step starts or every response token.
    pub target: CriticTarget,
    /// Sequences per forward pass, and their layout.
    pub chunks: (usize, BatchLayout),
    /// Constrained-decoding masks of the forward passes.
    pub masks: &'a ResponseMasks,
    /// The ranks that share the work.
    pub dist: &'a dyn Collective,
}

/// What fitting a value MLP after the actor's epochs takes besides the critic.
pub struct FitContext<'a> {
    /// The updated policy, whose features a feature critic reads.
    pub policy: &'a Model,
    /// How the fitting passes lay out their sequences.
    pub layout: BatchLayout,
    /// Constrained-decoding masks of the forward passes.
    pub masks: &'a ResponseMasks,
    /// Epochs, mini-batch size, learning rate and the other fitting settings.
    pub settings: FitSettings<'a>,
}

/// The critic a run trains beside its policy, whatever its kind.
pub trait Critic: Send {
    /// Values at every position of `input`, `[B, T]` padded or `[1, N]` a tree (`policy` supplies
    /// a shared head's trunk and a feature critic's features). A critic that values records
    /// rather than token positions (the state critic) answers with an error.
    fn values(&self, policy: &Model, input: &TrainInput) -> Result<Tensor, TrainError>;

    /// The rollout-time values of every record: read off the token values of each sequence,
    /// each rank computing its share.
    fn record_values(&self, reading: &ValueReading) -> Result<Vec<Vec<f32>>, TrainError> {
        let r = reading;
        let device = r.policy.device().clone();
        ranks::per_record_rows(r.records.len(), r.sequences, r.dist, |mine| {
            critic_values(
                &|input| self.values(r.policy, input),
                r.records,
                mine,
                r.target,
                r.chunks,
                r.masks,
                &device,
            )
        })
    }

    /// Whether it trains on the actor's mini-batches (its loss on their rows); a value MLP is
    /// fitted after the actor's epochs instead ([`Critic::fit`]).
    fn trains_on_mini_batches(&self) -> bool {
        true
    }

    /// Whether its loss joins the actor's in one backward pass (a head on the policy's trunk);
    /// it then trains alone only in the passes where the actor does not.
    fn trains_in_actor_backward(&self) -> bool {
        false
    }

    /// Fits it after the actor's epochs on `batch` with `opt`, logging into `means`; returns the
    /// skipped optimizer steps. Nothing for a critic that trains on the mini-batches.
    fn fit(
        &mut self,
        _batch: &FitBatch,
        _ctx: &FitContext,
        _opt: &mut AdamW,
        _means: &mut Means,
    ) -> Result<usize, TrainError> {
        Ok(0)
    }

    /// The parameters its optimizer steps, by name, sorted by name (a separate critic with LoRA
    /// adapters: the adapters and its value head; a shared head: the head's, in `policy`).
    fn trainable_vars(&self, policy: &Model) -> Vec<(String, Var)>;

    /// Its weights by name, LoRA adapters included (for comparisons and tests); empty for a
    /// shared head, whose weights are the policy's.
    fn weights(&self) -> Vec<(String, Var)>;

    /// The weights every rank of a fresh run takes from rank 0 (a separate critic's; the value
    /// MLPs and a shared head are seeded alike on every rank).
    fn broadcast_vars(&self) -> Vec<(String, Var)> {
        Vec::new()
    }

    /// Writes what it keeps into checkpoint directory `ckpt` (`critic/`, and a state critic's
    /// fitting history); a shared head is saved with the policy.
    fn save(&self, ckpt: &Path) -> Result<(), TrainError>;

    /// Takes the config's `activation_checkpointing` and `precision` (a trunk of its own only).
    fn set_numerics(&mut self, _cfg: &Config) {}

    /// The model of the policy's family it is, when it is one: the trunk the warm start's value
    /// warm-up trains and LoRA adapters attach to.
    fn trunk(&self) -> Option<&CriticTrunk> {
        None
    }

    /// [`Critic::trunk`], to attach adapters to.
    fn trunk_mut(&mut self) -> Option<&mut CriticTrunk> {
        None
    }
}

/// The critic of `cfg.critic.mode` from `origin`; `None` for no critic and for a fresh separate
/// critic that `critic.pretrain` does not name (made after the warm start, [`complete_fresh`]). A
/// fresh shared head is attached to `policy`.
pub fn open(
    cfg: &Config,
    policy: &mut Model,
    origin: CriticOrigin,
) -> Result<Option<Box<dyn Critic>>, TrainError> {
    let device = policy.device().clone();
    let seed = critic_seed(cfg);
    let dir = |ckpt: &Path| ckpt.join(CHECKPOINT_DIR);
    Ok(match (cfg.critic.mode, origin) {
        (CriticMode::Separate, CriticOrigin::Fresh) => critic_from_pretrain(cfg, policy, &device)?
            .map(|c| Box::new(SeparateCritic::new(c)) as Box<dyn Critic>),
        (CriticMode::Separate, CriticOrigin::Checkpoint(ckpt)) => Some(Box::new(
            SeparateCritic::new(CriticTrunk::load(&dir(ckpt), &device, seed)?),
        )),
        (CriticMode::Features, CriticOrigin::Fresh) => {
            Some(Box::new(FeatureCritic::new(ValueMlp::new(policy, seed)?)))
        }
        (CriticMode::Features, CriticOrigin::Checkpoint(ckpt)) => Some(Box::new(
            FeatureCritic::new(ValueMlp::load(&dir(ckpt), policy)?),
        )),
        (CriticMode::State, CriticOrigin::Fresh) => {
            let width = critic_state_width(cfg)?;
            let mlp = ValueMlp::with_width(width, policy.config(), seed, &device)?;
            Some(Box::new(StateCritic::new(mlp, cfg.critic.history_batches)))
        }
        (CriticMode::State, CriticOrigin::Checkpoint(ckpt)) => {
            let mlp = ValueMlp::load_width(&dir(ckpt), critic_state_width(cfg)?, &device)?;
            Some(Box::new(StateCritic::resume(
                mlp,
                cfg.critic.history_batches,
                ckpt,
            )?))
        }
        (CriticMode::Shared, CriticOrigin::Fresh) => {
            policy.attach_value_head(seed)?;
            Some(Box::new(SharedHead))
        }
        (CriticMode::Shared, CriticOrigin::Checkpoint(_)) => Some(Box::new(SharedHead)),
        (CriticMode::None, _) => None,
    })
}

/// A fresh run's critic as RL starts, after the warm start: a separate critic that
/// `critic.pretrain` did not name is a copy of `policy` now (a LoRA critic beside a LoRA policy
/// reads the policy's frozen base: no second copy); any other comes through unchanged.
pub fn complete_fresh(
    cfg: &Config,
    policy: &Model,
    critic: Option<Box<dyn Critic>>,
) -> Result<Option<Box<dyn Critic>>, TrainError> {
    if cfg.critic.mode != CriticMode::Separate || critic.is_some() {
        return Ok(critic);
    }
    let share_base = cfg.lora_enabled() && cfg.critic.lora.is_some();
    let copy = CriticTrunk::from_policy(policy, critic_seed(cfg), share_base)?;
    Ok(Some(Box::new(SeparateCritic::new(copy))))
}

/// The critic's directory in a checkpoint.
pub const CHECKPOINT_DIR: &str = "critic";

/// Seed of the critic's initial weights.
fn critic_seed(cfg: &Config) -> u64 {
    seed::derive(cfg.seed, &[SEED_CRITIC])
}

/// Width of the critic state that every training env supplies (`critic.mode: state`); an
/// error naming the env tag whose env supplies none, or another width than the first.
fn critic_state_width(cfg: &Config) -> Result<usize, TrainError> {
    let mut width: Option<(usize, &str)> = None;
    for tag in &cfg.train_env_manager.tags {
        let spec = &cfg.custom_envs[tag];
        let fail =
            |msg: String| TrainError::Data(format!("critic.mode state: custom_envs.{tag}: {msg}"));
        let mut session =
            build_session(&spec.env_type, &spec.env_config).map_err(|e| fail(e.to_string()))?;
        session.reset(cfg.seed).map_err(|e| fail(e.to_string()))?;
        let Some(state) = session.env().critic_state() else {
            return Err(fail(format!(
                "env {} supplies no critic state (envs that do: frozen_lake, sokoban, hotpotqa)",
                spec.env_type
            )));
        };
        match width {
            Some((w, first)) if w != state.len() => {
                return Err(fail(format!(
                    "its critic state has {} numbers, custom_envs.{first}'s {w}: one state \
                     critic reads one width",
                    state.len()
                )))
            }
            Some(_) => {}
            None => width = Some((state.len(), tag)),
        }
    }
    width
        .map(|(w, _)| w)
        .ok_or_else(|| TrainError::Data("critic.mode state: no training env".into()))
}

/// A separate critic that `critic.pretrain` names: `builtin` (a fresh trunk) or a checkpoint
/// directory. `None` when it names nothing: the critic is then a copy of the policy as RL starts,
/// made after the warm start ([`complete_fresh`]).
fn critic_from_pretrain(
    cfg: &Config,
    policy: &Model,
    device: &Device,
) -> Result<Option<CriticTrunk>, TrainError> {
    Ok(match cfg.critic.pretrain.as_deref() {
        None => None,
        Some("builtin") => Some(CriticTrunk::new(policy.config(), critic_seed(cfg), device)?),
        Some(dir) => Some(CriticTrunk::load(Path::new(dir), device, critic_seed(cfg))?),
    })
}
