//! The per-trajectory summary index the trajectory list is served from: one pass over the
//! metadata of every frame (decoded in place, nothing allocated per record) at open, a few
//! dozen bytes per trajectory, then filtering, sorting and per-env figures without touching
//! the segments again; a [`Snapshot`] keeps the dataset beside it, with the trainer's credit rows
//! of a run, and remembers its latest selections, so paging through a sorted list sorts it once. The query parameters are
//! `query`'s.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::store::{Dataset, StepMetaView, StepView};
use crate::train::run::credit_log::StepCredit;

use super::error::ViewError;
use super::source::{Fingerprint, Source};

/// What one trajectory looks like from its step metadata.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrajSummary {
    /// The trajectory's id.
    pub traj_id: u64,
    /// Its group's id.
    pub group_id: u64,
    /// Lowest policy version among its steps (the rollouts of training step N have N − 1).
    pub policy_version: u64,
    /// Env seed (of the first of its records read).
    pub seed: u64,
    /// Sum of the step rewards.
    pub ret: f32,
    /// Steps stored.
    pub steps: u32,
    /// Highest step index seen.
    pub last_step: u32,
    /// Index into [`TrajIndex::envs`].
    pub env: u16,
    /// Some step reports success.
    pub success: bool,
    /// The step with the highest index is neither terminated nor truncated.
    pub open: bool,
}

impl TrajSummary {
    fn start(view: &StepView<'_>, meta: &StepMetaView<'_>, env: u16) -> Self {
        Self {
            traj_id: view.traj_id,
            group_id: view.group_id,
            policy_version: meta.policy_version,
            seed: meta.seed,
            ret: 0.0,
            steps: 0,
            last_step: 0,
            env,
            success: false,
            open: true,
        }
    }

    fn add(&mut self, view: &StepView<'_>, meta: &StepMetaView<'_>) {
        if self.steps == 0 || view.step_index >= self.last_step {
            self.last_step = view.step_index;
            self.open = !meta.terminated && !meta.truncated;
        }
        self.steps += 1;
        self.ret += meta.reward;
        self.success |= meta.success;
        self.policy_version = self.policy_version.min(meta.policy_version);
    }
}

/// How to sort the list.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SortKey {
    /// By trajectory id.
    #[default]
    Id,
    /// By return (sum of step rewards).
    Return,
    /// By number of steps.
    Length,
    /// By lowest policy version.
    Version,
    /// By group id.
    Group,
    /// By env name.
    Env,
}

/// Which trajectories the list shows; `None` lets everything through.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Filter {
    /// Only trajectories of this env tag.
    pub env: Option<String>,
    /// Only trajectories whose lowest policy version is this.
    pub version: Option<u64>,
    /// Only this group's trajectories.
    pub group: Option<u64>,
    /// Only trajectories that succeeded (`true`) or did not (`false`).
    pub success: Option<bool>,
    /// Only open (`true`) or ended (`false`) trajectories.
    pub open: Option<bool>,
    /// Only returns of at least this.
    pub min_return: Option<f32>,
    /// Only returns of at most this.
    pub max_return: Option<f32>,
    /// Only trajectories of at least this many steps.
    pub min_len: Option<u32>,
    /// Only trajectories of at most this many steps.
    pub max_len: Option<u32>,
}

/// Finished-trajectory figures of one environment.
#[derive(Clone, Debug, PartialEq)]
pub struct EnvFigures {
    pub env: String,
    pub trajectories: usize,
    pub open: usize,
    pub success_rate: f64,
    pub mean_return: f64,
    pub mean_length: f64,
}

/// Summaries of every trajectory, ordered by id.
#[derive(Debug, Default)]
pub struct TrajIndex {
    /// One summary per trajectory, ordered by `traj_id`.
    pub trajs: Vec<TrajSummary>,
    /// Env tags in first-seen order ([`TrajSummary::env`] indexes it).
    pub envs: Vec<String>,
    /// Records read, unreadable ones included.
    pub records: usize,
    /// Records whose metadata did not decode (left out of the summaries).
    pub unreadable: usize,
    groups: HashMap<u64, Vec<u32>>,
}

impl TrajIndex {
    /// One pass over the metadata of every valid record of `dataset`.
    pub fn build(dataset: &Dataset) -> Self {
        let mut index = Self::default();
        let mut slots: HashMap<u64, u32> = HashMap::new();
        for view in dataset.records() {
            index.records += 1;
            let Ok(meta) = view.meta_view() else {
                index.unreadable += 1;
                continue;
            };
            let env = index.intern(meta.env_tag);
            let slot = *slots.entry(view.traj_id).or_insert_with(|| {
                index.trajs.push(TrajSummary::start(&view, &meta, env));
                (index.trajs.len() - 1) as u32
            });
            index.trajs[slot as usize].add(&view, &meta);
        }
        index.trajs.sort_unstable_by_key(|t| t.traj_id);
        for (i, t) in index.trajs.iter().enumerate() {
            index.groups.entry(t.group_id).or_default().push(i as u32);
        }
        index
    }

    fn intern(&mut self, env: &str) -> u16 {
        match self.envs.iter().position(|e| e == env) {
            Some(i) => i as u16,
            None => {
                self.envs.push(env.to_string());
                (self.envs.len() - 1) as u16
            }
        }
    }

    /// The env tag of `t`.
    pub fn env_name(&self, t: &TrajSummary) -> &str {
        self.envs.get(t.env as usize).map_or("", String::as_str)
    }

    /// The summary of trajectory `traj_id`.
    pub fn get(&self, traj_id: u64) -> Option<&TrajSummary> {
        let at = self.trajs.binary_search_by_key(&traj_id, |t| t.traj_id);
        at.ok().map(|i| &self.trajs[i])
    }

    /// The trajectories of group `group_id`, ordered by id.
    pub fn group(&self, group_id: u64) -> impl Iterator<Item = &TrajSummary> {
        let members = self.groups.get(&group_id).map_or(&[][..], Vec::as_slice);
        members.iter().map(|&i| &self.trajs[i as usize])
    }

    /// Positions (into `trajs`) of the trajectories `filter` lets through, sorted by `key`
    /// (ties by id), descending when `desc`.
    pub fn select(&self, filter: &Filter, key: SortKey, desc: bool) -> Vec<u32> {
        let env = match &filter.env {
            Some(name) => match self.envs.iter().position(|e| e == name) {
                Some(i) => Some(i as u16),
                None => return Vec::new(),
            },
            None => None,
        };
        let mut hits: Vec<u32> = (0..self.trajs.len() as u32)
            .filter(|&i| passes(&self.trajs[i as usize], filter, env))
            .collect();
        if key != SortKey::Id {
            let rank = self.env_ranks();
            let trajs = &self.trajs;
            hits.sort_by(|&a, &b| {
                let (a, b) = (&trajs[a as usize], &trajs[b as usize]);
                compare(a, b, key, &rank).then(a.traj_id.cmp(&b.traj_id))
            });
        }
        if desc {
            hits.reverse();
        }
        hits
    }

    /// Position of each interned env in name order.
    fn env_ranks(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.envs.len()).collect();
        order.sort_by_key(|&i| &self.envs[i]);
        let mut rank = vec![0; order.len()];
        for (r, i) in order.into_iter().enumerate() {
            rank[i] = r;
        }
        rank
    }

    /// Figures per environment over finished trajectories, open ones counted apart.
    pub fn env_figures(&self) -> Vec<EnvFigures> {
        let mut out: Vec<EnvFigures> = Vec::new();
        for (i, env) in self.envs.iter().enumerate() {
            let all = self.trajs.iter().filter(|t| t.env as usize == i);
            let (open, done): (Vec<&TrajSummary>, Vec<_>) = all.partition(|t| t.open);
            let n = done.len().max(1) as f64;
            out.push(EnvFigures {
                env: env.clone(),
                trajectories: done.len(),
                open: open.len(),
                success_rate: done.iter().filter(|t| t.success).count() as f64 / n,
                mean_return: done.iter().map(|t| f64::from(t.ret)).sum::<f64>() / n,
                mean_length: done.iter().map(|t| f64::from(t.steps)).sum::<f64>() / n,
            });
        }
        out
    }
}

fn passes(t: &TrajSummary, f: &Filter, env: Option<u16>) -> bool {
    env.is_none_or(|e| t.env == e)
        && f.version.is_none_or(|v| t.policy_version == v)
        && f.group.is_none_or(|g| t.group_id == g)
        && f.success.is_none_or(|s| t.success == s)
        && f.open.is_none_or(|o| t.open == o)
        && f.min_return.is_none_or(|r| t.ret >= r)
        && f.max_return.is_none_or(|r| t.ret <= r)
        && f.min_len.is_none_or(|n| t.steps >= n)
        && f.max_len.is_none_or(|n| t.steps <= n)
}

fn compare(a: &TrajSummary, b: &TrajSummary, key: SortKey, env_rank: &[usize]) -> Ordering {
    match key {
        SortKey::Id => a.traj_id.cmp(&b.traj_id),
        SortKey::Return => a.ret.total_cmp(&b.ret),
        SortKey::Length => a.steps.cmp(&b.steps),
        SortKey::Version => a.policy_version.cmp(&b.policy_version),
        SortKey::Group => a.group_id.cmp(&b.group_id),
        SortKey::Env => env_rank[a.env as usize].cmp(&env_rank[b.env as usize]),
    }
}

/// How many recent selections a snapshot keeps.
const KEPT_SELECTIONS: usize = 8;

/// A selection (filter, sort key, descending) and its result.
type Selection = (Filter, SortKey, bool, Arc<Vec<u32>>);

/// A dataset as opened at one moment, with its index and the fingerprint it was opened at.
#[derive(Debug)]
pub struct Snapshot {
    /// The opened dataset.
    pub dataset: Dataset,
    /// Its trajectory index.
    pub index: TrajIndex,
    /// The dataset's segment files and sizes at open.
    pub fingerprint: Fingerprint,
    /// What the trainer used for each step, by (trajectory, step) (empty for a bare dataset).
    pub credit: HashMap<(u64, u32), StepCredit>,
    /// Counts the re-opens of a live dataset (0 for the first open).
    pub generation: u64,
    /// The latest selections, newest last: paging through one sorts it once.
    selections: Mutex<Vec<Selection>>,
}

impl Snapshot {
    /// Opens the dataset of `source` and builds its index.
    pub fn open(source: &Source, generation: u64) -> Result<Self, ViewError> {
        let fingerprint = source.fingerprint()?;
        let dataset = Dataset::open(&source.dataset)?;
        let index = TrajIndex::build(&dataset);
        Ok(Self {
            dataset,
            index,
            fingerprint,
            credit: source.credit()?,
            generation,
            selections: Mutex::new(Vec::new()),
        })
    }

    /// [`TrajIndex::select`], remembered for the next pages of the same selection.
    pub fn select(&self, filter: &Filter, key: SortKey, desc: bool) -> Arc<Vec<u32>> {
        let same = |s: &Selection| s.0 == *filter && s.1 == key && s.2 == desc;
        if let Some(hit) = self.selections.lock().iter().find(|s| same(s)) {
            return hit.3.clone();
        }
        let hits = Arc::new(self.index.select(filter, key, desc));
        let mut kept = self.selections.lock();
        if kept.len() >= KEPT_SELECTIONS {
            kept.remove(0);
        }
        kept.push((filter.clone(), key, desc, hits.clone()));
        hits
    }

    /// Problems found at open plus records whose metadata did not decode.
    pub fn problems(&self) -> usize {
        self.dataset.problems().len() + self.index.unreadable
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::StepInfo;
    use crate::store::{DatasetWriter, StepRecord, WriterOptions};

    fn step(traj: u64, group: u64, index: u32, reward: f32, last: bool) -> StepRecord {
        StepRecord {
            traj_id: traj,
            group_id: group,
            step_index: index,
            env_tag: if traj < 3 { "b_env" } else { "a_env" }.into(),
            policy_version: traj % 2,
            reward,
            terminated: last,
            info: StepInfo {
                success: last && reward > 0.0,
                ..StepInfo::default()
            },
            ..StepRecord::default()
        }
    }

    /// Trajectories 0..4; the steps of 1 are stored out of order, 4 has no terminal step.
    fn index() -> TrajIndex {
        let dir = tempfile::tempdir().unwrap();
        let opts = WriterOptions {
            durable: false,
            ..WriterOptions::default()
        };
        let mut w = DatasetWriter::create(dir.path(), opts).unwrap();
        for r in [
            step(0, 0, 0, 1.0, true),
            step(1, 0, 1, 2.0, true),
            step(1, 0, 0, -0.5, false),
            step(2, 1, 0, -1.0, true),
            step(3, 1, 0, 0.5, true),
            step(4, 2, 0, 0.0, false),
        ] {
            w.append(&r).unwrap();
        }
        w.seal().unwrap();
        TrajIndex::build(&Dataset::open(dir.path()).unwrap())
    }

    #[test]
    fn summaries_add_up_steps_and_find_open_trajectories() {
        let idx = index();
        assert_eq!((idx.records, idx.trajs.len()), (6, 5));
        let one = idx.get(1).unwrap();
        assert_eq!(
            (one.steps, one.last_step, one.ret, one.open),
            (2, 1, 1.5, false)
        );
        assert!(one.success);
        assert!(idx.get(4).unwrap().open);
        let group: Vec<u64> = idx.group(1).map(|t| t.traj_id).collect();
        assert_eq!(group, [2, 3]);
    }

    #[test]
    fn select_filters_and_sorts_with_ties_by_id() {
        let idx = index();
        let ids = |hits: Vec<u32>| -> Vec<u64> {
            hits.iter()
                .map(|&i| idx.trajs[i as usize].traj_id)
                .collect()
        };
        let by_return = idx.select(&Filter::default(), SortKey::Return, true);
        assert_eq!(ids(by_return), [1, 0, 3, 4, 2]);
        let by_env = idx.select(&Filter::default(), SortKey::Env, false);
        assert_eq!(ids(by_env), [3, 4, 0, 1, 2]);
        let odd_finished = Filter {
            version: Some(1),
            open: Some(false),
            ..Filter::default()
        };
        assert_eq!(ids(idx.select(&odd_finished, SortKey::Id, false)), [1, 3]);
        let unknown_env = Filter {
            env: Some("nowhere".into()),
            ..Filter::default()
        };
        assert!(idx.select(&unknown_env, SortKey::Id, false).is_empty());
    }

    #[test]
    fn env_figures_leave_open_trajectories_out() {
        let figures = index().env_figures();
        let a = figures.iter().find(|f| f.env == "a_env").unwrap();
        assert_eq!((a.trajectories, a.open), (1, 1));
        assert_eq!((a.success_rate, a.mean_return), (1.0, 0.5));
    }
}
