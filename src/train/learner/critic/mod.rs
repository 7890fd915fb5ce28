//! The critic a run trains beside its policy ([`CriticModel`]): a separate model of the policy's
//! family with a value head, or a value MLP on the policy's features or on the env's state facts
//! (a shared value head lives in the policy itself). The value MLPs are fitted after each update
//! ([`fit`]), a state critic on the rows of the last batches ([`history`]).

pub mod fit;
pub mod history;

use crate::config::{Config, CriticMode};
use crate::env::build_session;
use crate::model::{Critic, Model, TrainInput, ValueMlp};
use crate::seed;
use crate::train::TrainError;
use candle_core::{Device, Tensor};
use std::path::Path;

/// Seed-path tag of the critic's initial weights.
const SEED_CRITIC: u64 = 2;

/// Where a run's critic comes from.
#[derive(Clone, Copy, Debug)]
pub enum CriticOrigin<'a> {
    /// A fresh run: a new critic as the config asks (a separate critic only when
    /// `critic.pretrain` names one; without, the trainer copies the policy after its warm start,
    /// [`Critic::from_policy`]).
    Fresh,
    /// A checkpoint's `critic/` directory (a shared head comes back with the policy).
    Checkpoint(&'a Path),
}

/// The critic model a run trains beside its policy (a shared value head lives in the policy).
pub enum CriticModel {
    /// A model of the policy's family with a value head (boxed: a trunk is large).
    Separate(Box<Critic>),
    /// A value MLP on the policy's detached hidden states.
    Features(ValueMlp),
    /// A value MLP on the env's facts about the whole state (each record's `critic_state`).
    State(ValueMlp),
}

impl CriticModel {
    /// The critic of `cfg.critic.mode` from `origin`; `None` for a shared head (which a fresh run
    /// attaches to `policy`), for no critic, and for a fresh separate critic that `critic.pretrain`
    /// does not name.
    pub fn open(
        cfg: &Config,
        policy: &mut Model,
        origin: CriticOrigin,
    ) -> Result<Option<Self>, TrainError> {
        let device = policy.device().clone();
        let seed = critic_seed(cfg);
        Ok(match (cfg.critic.mode, origin) {
            (CriticMode::Separate, CriticOrigin::Fresh) => {
                critic_from_pretrain(cfg, policy, &device)?.map(|c| Self::Separate(Box::new(c)))
            }
            (CriticMode::Separate, CriticOrigin::Checkpoint(dir)) => {
                Some(Self::Separate(Box::new(Critic::load(dir, &device, seed)?)))
            }
            (CriticMode::Features, CriticOrigin::Fresh) => {
                Some(Self::Features(ValueMlp::new(policy, seed)?))
            }
            (CriticMode::Features, CriticOrigin::Checkpoint(dir)) => {
                Some(Self::Features(ValueMlp::load(dir, policy)?))
            }
            (CriticMode::State, CriticOrigin::Fresh) => {
                let width = critic_state_width(cfg)?;
                let mlp = ValueMlp::with_width(width, policy.config(), seed, &device)?;
                Some(Self::State(mlp))
            }
            (CriticMode::State, CriticOrigin::Checkpoint(dir)) => Some(Self::State(
                ValueMlp::load_width(dir, critic_state_width(cfg)?, &device)?,
            )),
            (CriticMode::Shared, CriticOrigin::Fresh) => {
                policy.attach_value_head(seed)?;
                None
            }
            (CriticMode::Shared, CriticOrigin::Checkpoint(_)) | (CriticMode::None, _) => None,
        })
    }

    /// Values at every position of `input`, `[B, T]` padded or `[1, N]` a tree (`policy`
    /// supplies a feature critic's features). A state critic reads records, not tokens
    /// ([`fit::state_values`]): an error.
    pub fn values(&self, policy: &Model, input: &TrainInput) -> Result<Tensor, TrainError> {
        Ok(match self {
            CriticModel::Separate(c) => c.values_of(input)?,
            CriticModel::Features(c) => c.values(policy, input)?,
            CriticModel::State(_) => {
                return Err(TrainError::Data(
                    "a state critic values records' critic states, not token positions".into(),
                ))
            }
        })
    }

    /// The parameters its optimizer steps, by name, sorted by name (a separate critic with LoRA
    /// adapters: the adapters and its value head).
    pub fn trainable_vars(&self) -> Vec<(String, candle_core::Var)> {
        match self {
            CriticModel::Separate(c) => c.trainable_vars(),
            CriticModel::Features(c) | CriticModel::State(c) => c.named_vars(),
        }
    }

    /// Writes the critic into checkpoint directory `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), TrainError> {
        match self {
            CriticModel::Separate(c) => c.save(dir)?,
            CriticModel::Features(c) | CriticModel::State(c) => c.save(dir)?,
        }
        Ok(())
    }
}

/// Seed of the critic's initial weights.
pub(in crate::train) fn critic_seed(cfg: &Config) -> u64 {
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
/// made after the warm start ([`Critic::from_policy`]).
fn critic_from_pretrain(
    cfg: &Config,
    policy: &Model,
    device: &Device,
) -> Result<Option<Critic>, TrainError> {
    Ok(match cfg.critic.pretrain.as_deref() {
        None => None,
        Some("builtin") => Some(Critic::new(policy.config(), critic_seed(cfg), device)?),
        Some(dir) => Some(Critic::load(Path::new(dir), device, critic_seed(cfg))?),
    })
}
