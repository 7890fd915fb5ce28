//! The four critics a run can train, one per `critic.mode` with a critic: a separate model of the
//! policy's family ([`SeparateCritic`]), a value head on the policy's trunk ([`SharedHead`]), a
//! value MLP on the policy's detached features ([`FeatureCritic`]) and one on the env's state
//! facts with its fitting history ([`StateCritic`]). Each says how it is valued, trained, fitted
//! and saved through [`Critic`].

use super::fit::{self, FitBatch};
use super::history::{self, CriticHistory};
use super::{Critic, FitContext, ValueReading, CHECKPOINT_DIR};
use crate::algo::AdamW;
use crate::config::Config;
use crate::model::critic::VALUE_HEAD_PREFIX;
use crate::model::{Critic as CriticTrunk, Model, TrainInput, ValueMlp};
use crate::train::learner::optimizer_step::Means;
use crate::train::TrainError;
use candle_core::{Tensor, Var};
use std::path::Path;

/// A model of the policy's family with a value head (boxed: a trunk is large): its own forward
/// and optimizer step on each of the actor's mini-batches.
pub struct SeparateCritic(Box<CriticTrunk>);

impl SeparateCritic {
    /// Wraps a critic model (trunk and value head).
    pub fn new(trunk: CriticTrunk) -> Self {
        Self(Box::new(trunk))
    }
}

impl Critic for SeparateCritic {
    fn values(&self, _policy: &Model, input: &TrainInput) -> Result<Tensor, TrainError> {
        Ok(self.0.values_of(input)?)
    }

    fn trainable_vars(&self, _policy: &Model) -> Vec<(String, Var)> {
        self.0.trainable_vars()
    }

    fn weights(&self) -> Vec<(String, Var)> {
        let adapters = self.0.adapters().map(|a| a.named_vars());
        self.0
            .named_vars()
            .into_iter()
            .chain(adapters.into_iter().flatten())
            .collect()
    }

    fn broadcast_vars(&self) -> Vec<(String, Var)> {
        self.0.named_vars()
    }

    fn save(&self, ckpt: &Path) -> Result<(), TrainError> {
        Ok(self.0.save(&ckpt.join(CHECKPOINT_DIR))?)
    }

    fn set_numerics(&mut self, cfg: &Config) {
        self.0
            .set_activation_checkpointing(cfg.activation_checkpointing);
        self.0.set_precision(cfg.precision);
    }

    fn trunk(&self) -> Option<&CriticTrunk> {
        Some(&self.0)
    }

    fn trunk_mut(&mut self) -> Option<&mut CriticTrunk> {
        Some(&mut self.0)
    }
}

/// A value head on the policy's trunk: its loss joins the actor's in one backward pass, and its
/// optimizer (over the head's parameters, at the critic's learning rate and weight decay) steps
/// the head while the actor's steps the trunk. Its weights live in the policy.
pub struct SharedHead;

impl Critic for SharedHead {
    fn values(&self, policy: &Model, input: &TrainInput) -> Result<Tensor, TrainError> {
        Ok(policy.head_values(&policy.hidden(input)?)?)
    }

    fn trains_in_actor_backward(&self) -> bool {
        true
    }

    fn trainable_vars(&self, policy: &Model) -> Vec<(String, Var)> {
        policy
            .trainable_vars()
            .into_iter()
            .filter(|(name, _)| name.starts_with(VALUE_HEAD_PREFIX))
            .collect()
    }

    fn weights(&self) -> Vec<(String, Var)> {
        Vec::new()
    }

    fn save(&self, _ckpt: &Path) -> Result<(), TrainError> {
        Ok(())
    }
}

/// A value MLP on the policy's detached hidden states, fitted after the actor's epochs on the
/// features of the updated policy ([`fit::fit_value_mlp`]).
pub struct FeatureCritic(ValueMlp);

impl FeatureCritic {
    /// Wraps a value MLP over the policy's features.
    pub fn new(mlp: ValueMlp) -> Self {
        Self(mlp)
    }
}

impl Critic for FeatureCritic {
    fn values(&self, policy: &Model, input: &TrainInput) -> Result<Tensor, TrainError> {
        Ok(self.0.values(policy, input)?)
    }

    fn trains_on_mini_batches(&self) -> bool {
        false
    }

    fn fit(
        &mut self,
        batch: &FitBatch,
        ctx: &FitContext,
        opt: &mut AdamW,
        means: &mut Means,
    ) -> Result<usize, TrainError> {
        let rows = fit::feature_rows(batch, ctx.policy, (ctx.layout, ctx.masks))?;
        let newest = rows.returns.len();
        fit::fit_value_mlp(&rows, newest, &self.0, opt, &ctx.settings, means)
    }

    fn trainable_vars(&self, _policy: &Model) -> Vec<(String, Var)> {
        self.0.named_vars()
    }

    fn weights(&self) -> Vec<(String, Var)> {
        self.0.named_vars()
    }

    fn save(&self, ckpt: &Path) -> Result<(), TrainError> {
        Ok(self.0.save(&ckpt.join(CHECKPOINT_DIR))?)
    }
}

/// A value MLP on the records' critic states (the env's facts about the whole state), fitted
/// after the actor's epochs on the rows of its history, the batch's own added first
/// ([`fit::fit_value_mlp`]). It values records, not token positions.
pub struct StateCritic {
    mlp: ValueMlp,
    history: CriticHistory,
}

impl StateCritic {
    /// A state critic with an empty history of `capacity` batches.
    pub fn new(mlp: ValueMlp, capacity: usize) -> Self {
        let history = CriticHistory::new(capacity, mlp.input_width());
        Self { mlp, history }
    }

    /// A state critic whose history is the one checkpoint `ckpt` saved (empty when it saved
    /// none: a run that fitted on each batch alone).
    pub fn resume(mlp: ValueMlp, capacity: usize, ckpt: &Path) -> Result<Self, TrainError> {
        let mut critic = Self::new(mlp, capacity);
        let saved = ckpt.join(history::CHECKPOINT_FILE);
        if saved.exists() {
            critic.history = CriticHistory::load(&saved, capacity, critic.history.width())?;
        }
        Ok(critic)
    }
}

impl Critic for StateCritic {
    fn values(&self, _policy: &Model, _input: &TrainInput) -> Result<Tensor, TrainError> {
        Err(TrainError::Data(
            "a state critic values records' critic states, not token positions".into(),
        ))
    }

    /// The same on every rank and cheap: no split.
    fn record_values(&self, r: &ValueReading) -> Result<Vec<Vec<f32>>, TrainError> {
        fit::state_values(&self.mlp, r.records, r.target, r.policy.device())
    }

    fn trains_on_mini_batches(&self) -> bool {
        false
    }

    fn fit(
        &mut self,
        batch: &FitBatch,
        ctx: &FitContext,
        opt: &mut AdamW,
        means: &mut Means,
    ) -> Result<usize, TrainError> {
        self.history
            .push(fit::state_rows(batch, self.history.width())?);
        let rows = fit::history_rows(&self.history, ctx.policy.device())?;
        means.add("critic/history_rows", rows.returns.len() as f64);
        let newest = self.history.newest_len();
        fit::fit_value_mlp(&rows, newest, &self.mlp, opt, &ctx.settings, means)
    }

    fn trainable_vars(&self, _policy: &Model) -> Vec<(String, Var)> {
        self.mlp.named_vars()
    }

    fn weights(&self) -> Vec<(String, Var)> {
        self.mlp.named_vars()
    }

    fn save(&self, ckpt: &Path) -> Result<(), TrainError> {
        self.mlp.save(&ckpt.join(CHECKPOINT_DIR))?;
        self.history.save(&ckpt.join(history::CHECKPOINT_FILE))
    }
}
