//! Training from the gateway: the trainer as the [`Backend`] of the OpenAI-compatible gateway.
//! Outside agents play episodes through it and close each session with its reward; closed
//! sessions wait in their task's queue until `group_size` of them make a group (sessions that
//! name no task are grouped in closing order). When `train_env_manager`'s groups are ready they are
//! one rollout batch: ids are given as the agent loop gives them (group `next_group_id + g`,
//! trajectory `group_id · group_size + member`), the trainer learns from them, and the gateway's
//! next request is served by the new policy version (the engine's cache was flushed with it).
//! A session spanning an update holds steps of two versions; the stored behaviour log-probs
//! are what the update's ratio is taken against, and `gateway/staleness` reports the lag. With
//! `constrained_decoding: true`, a session whose env tag (`metadata.env`) names a config env with
//! named actions is sampled under that env's answer grammar, the one the update scores its tokens
//! under (a free-text env's sessions decode freely: its grammars come from states the gateway does
//! not see).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use crate::model::Model;
use crate::rollout::engine::{CacheCounters, Engine};
use crate::rollout::grammar::ResponseGrammar;
use crate::serve::{ApiError, Backend, ClosedTrajectory};
use crate::store::StepRecord;
use crate::tokenizer::Tokenizer;
use crate::train::run::trainer::{Event, Trainer};
use crate::train::TrainError;

/// The queue of closed sessions of one task (or of the sessions without a task).
const NO_TASK: &str = "";

/// The trainer behind the gateway, until `until` steps are done.
pub struct GatewayTrainer<'a> {
    trainer: &'a mut Trainer,
    on_event: &'a mut dyn FnMut(Event),
    until: u64,
    queues: BTreeMap<String, Vec<ClosedTrajectory>>,
    ready: VecDeque<Vec<ClosedTrajectory>>,
    counters: CacheCounters,
    since: Instant,
    grammars: BTreeMap<String, Arc<ResponseGrammar>>,
}

impl<'a> GatewayTrainer<'a> {
    /// Trains `trainer` on closed sessions until it has done `until` steps, handing each event to
    /// `on_event`.
    pub fn new(trainer: &'a mut Trainer, until: u64, on_event: &'a mut dyn FnMut(Event)) -> Self {
        let grammars = trainer.answer_grammars();
        Self {
            grammars,
            trainer,
            on_event,
            until,
            queues: BTreeMap::new(),
            ready: VecDeque::new(),
            counters: CacheCounters::default(),
            since: Instant::now(),
        }
    }

    fn group_size(&self) -> usize {
        self.trainer.config().train_env_manager.group_size
    }

    fn groups_per_step(&self) -> usize {
        self.trainer.config().train_env_manager.groups()
    }

    /// The oldest ready groups as one batch of records with the agent loop's ids.
    fn take_batch(&mut self) -> Vec<StepRecord> {
        let first_group = self.trainer.next_group_id();
        let size = self.group_size() as u64;
        let mut records = Vec::new();
        for g in 0..self.groups_per_step() as u64 {
            let group = self
                .ready
                .pop_front()
                .expect("checked: enough groups are ready");
            let group_id = first_group + g;
            for (member, t) in group.into_iter().enumerate() {
                for mut r in t.records {
                    r.group_id = group_id;
                    r.traj_id = group_id * size + member as u64;
                    records.push(r);
                }
            }
        }
        records
    }

    fn learn(&mut self) -> Result<(), TrainError> {
        let records = self.take_batch();
        let version = self.trainer.state().step;
        let steps = records.len().max(1) as f64;
        let lag: Vec<f64> = records
            .iter()
            .map(|r| version.saturating_sub(r.policy_version) as f64)
            .collect();
        let t_rollout = self.since.elapsed().as_secs_f64();
        let counters = std::mem::take(&mut self.counters);
        let mut scalars = self
            .trainer
            .learn(records, counters, self.since, t_rollout)?;
        scalars.insert(
            "gateway/staleness_mean".into(),
            lag.iter().sum::<f64>() / steps,
        );
        scalars.insert(
            "gateway/staleness_max".into(),
            lag.iter().copied().fold(0.0, f64::max),
        );
        scalars.insert("gateway/groups_waiting".into(), self.ready.len() as f64);
        self.trainer
            .after_step(&scalars, self.until, self.on_event)?;
        self.since = Instant::now();
        Ok(())
    }
}

impl Backend for GatewayTrainer<'_> {
    fn parts(&mut self) -> (&mut Engine, &Model, &Tokenizer) {
        self.trainer.generation_parts()
    }

    fn policy_version(&self) -> u64 {
        self.trainer.state().step
    }

    fn grammars(&self) -> BTreeMap<String, Arc<ResponseGrammar>> {
        self.grammars.clone()
    }

    fn request_grammars(&self) -> bool {
        false
    }

    fn generated(&mut self, counters: &CacheCounters) {
        self.counters.add(counters);
        self.counters.forward_s += counters.forward_s;
    }

    fn closed(&mut self, trajectory: ClosedTrajectory) -> Result<Value, ApiError> {
        let task = trajectory.task.clone().unwrap_or_else(|| NO_TASK.into());
        let session = trajectory.session.clone();
        let steps = trajectory.records.len();
        let group_size = self.group_size();
        let queue = self.queues.entry(task.clone()).or_default();
        queue.push(trajectory);
        if queue.len() == group_size {
            let group = std::mem::take(queue);
            self.ready.push_back(group);
        }
        Ok(json!({
            "session": session, "task": task, "steps": steps, "recorded": true,
            "policy_version": self.policy_version(),
            "groups_ready": self.ready.len(), "groups_per_update": self.groups_per_step(),
        }))
    }

    fn after_round(&mut self) -> anyhow::Result<bool> {
        while self.ready.len() >= self.groups_per_step() && self.policy_version() < self.until {
            self.learn()?;
        }
        Ok(self.policy_version() < self.until)
    }

    fn stats(&self) -> Value {
        let waiting: usize = self.queues.values().map(Vec::len).sum();
        json!({
            "training": true, "step": self.policy_version(), "until": self.until,
            "groups_ready": self.ready.len(), "sessions_in_partial_groups": waiting,
        })
    }
}
