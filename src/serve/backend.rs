//! The backend of `stepppo serve`: a fixed policy (built-in or an HF-format directory) behind the
//! radix engine, and the [`Recorder`] that writes each closed session into a step dataset with
//! ids of its own (trajectory ids in closing order; one group id per task, sessions without a
//! task in a group of their own), continuing after the ids of a dataset it appends to. Each
//! trajectory is flushed when it is written, so a killed server loses only open sessions.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};

use super::api::ApiError;
use super::session::ClosedTrajectory;
use super::worker::Backend;
use crate::model::Model;
use crate::rollout::engine::Engine;
use crate::store::{Dataset, DatasetWriter, StoreError, WriterOptions};
use crate::tokenizer::Tokenizer;

/// Writes closed sessions into a dataset.
pub struct Recorder {
    writer: DatasetWriter,
    next_traj: u64,
    next_group: u64,
    task_groups: HashMap<String, u64>,
    trajectories: u64,
    steps: u64,
}

impl Recorder {
    /// Creates the dataset at `dir`, or appends to the one there (ids continue after its own).
    pub fn open(dir: &Path, opts: WriterOptions) -> Result<Self, StoreError> {
        let (writer, next_traj, next_group) = match Dataset::open(dir) {
            Ok(existing) => {
                let trajs = existing.trajectories();
                let next = |f: fn(&crate::store::Trajectory) -> u64| {
                    trajs.iter().map(f).max().map_or(0, |m| m + 1)
                };
                let ids = (next(|t| t.traj_id), next(|t| t.group_id));
                (DatasetWriter::open_append(dir, opts)?, ids.0, ids.1)
            }
            Err(_) if !dir.join(crate::store::MANIFEST_FILE).exists() => {
                (DatasetWriter::create(dir, opts)?, 0, 0)
            }
            Err(e) => return Err(e),
        };
        Ok(Self {
            writer,
            next_traj,
            next_group,
            task_groups: HashMap::new(),
            trajectories: 0,
            steps: 0,
        })
    }

    /// Writes a closed session as the next trajectory and flushes it.
    pub fn write(&mut self, mut t: ClosedTrajectory) -> Result<Value, StoreError> {
        let traj_id = self.next_traj;
        let group_id = match &t.task {
            Some(task) => *self.task_groups.entry(task.clone()).or_insert_with(|| {
                self.next_group += 1;
                self.next_group - 1
            }),
            None => {
                self.next_group += 1;
                self.next_group - 1
            }
        };
        for r in &mut t.records {
            r.traj_id = traj_id;
            r.group_id = group_id;
            self.writer.append(r)?;
        }
        self.writer.flush()?;
        self.next_traj += 1;
        self.trajectories += 1;
        self.steps += t.records.len() as u64;
        Ok(json!({
            "session": t.session, "trajectory_id": traj_id, "group_id": group_id,
            "steps": t.records.len(), "recorded": true,
        }))
    }

    fn stats(&self) -> Value {
        json!({
            "dataset": self.writer.dir().display().to_string(),
            "trajectories_written": self.trajectories,
            "steps_written": self.steps,
        })
    }
}

/// A fixed policy, and optionally a recorder.
pub struct PolicyBackend {
    /// The policy that samples every reply.
    pub model: Model,
    /// The policy's tokenizer.
    pub tokenizer: Tokenizer,
    /// The generation engine (KV pool and prefix cache) requests run on.
    pub engine: Engine,
    /// Writes closed sessions into a dataset; `None`: they are not recorded.
    pub recorder: Option<Recorder>,
}

impl Backend for PolicyBackend {
    fn parts(&mut self) -> (&mut Engine, &Model, &Tokenizer) {
        (&mut self.engine, &self.model, &self.tokenizer)
    }

    fn request_grammars(&self) -> bool {
        self.recorder.is_none()
    }

    fn policy_version(&self) -> u64 {
        self.engine.policy_version()
    }

    fn closed(&mut self, trajectory: ClosedTrajectory) -> Result<Value, ApiError> {
        match self.recorder.as_mut() {
            Some(r) => r
                .write(trajectory)
                .map_err(|e| ApiError::internal(format!("recording the trajectory: {e}"))),
            None => Ok(json!({
                "session": trajectory.session, "steps": trajectory.records.len(), "recorded": false,
            })),
        }
    }

    fn after_round(&mut self) -> anyhow::Result<bool> {
        Ok(true)
    }

    fn stats(&self) -> Value {
        self.recorder.as_ref().map_or(Value::Null, Recorder::stats)
    }
}
