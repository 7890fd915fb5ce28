//! Reading a dataset back for people and tools: a text transcript per trajectory, the JSONL
//! export, and summary statistics (`stepppo replay`).
//!
//! JSONL export: one JSON object per step, in trajectory order, with exactly the fields of
//! [`StepRecord`]: `traj_id`, `group_id`, `step_index`, `env_tag`, `seed`, `policy_version`,
//! `context_len` (tokens before this step's `obs_ids`), `obs_ids`, `response_ids`,
//! `response_logprobs` (behaviour log-probs; 0.0 for model-free agents), `reward`,
//! `terminated`, `truncated`, `state_hash`, and `info` = {`success`, `action_is_valid`,
//! `action_is_effective`, `format_penalty`, `num_actions`, `observation_text`, `action_text`,
//! `tool_call_error`, `context_rebuilt`} (the last two false for records of format versions
//! before 5). Each line parses back into a `StepRecord` with serde_json (lines written before
//! those two fields existed too: they default to false).
//!
//! Open trajectories: a trajectory whose last stored step is neither terminated nor truncated
//! has no end yet ([`Trajectory::is_open`]): it is still being written, or its writer stopped
//! mid-episode. By default the transcript's header says `open` and each of its JSONL lines
//! carries `"open": true` (finished trajectories' lines have no such field); `stepppo replay
//! --skip-open` leaves them out instead. Statistics always leave them out of every figure and
//! count them apart (`open_trajectories`), since their returns and lengths are not final.
//!
//! Incomplete trajectories: a trajectory whose stored step indices skip one
//! ([`Trajectory::missing_step`]) lost that step to damage; its return and length are those of a
//! shorter episode. The transcript's header says `incomplete: step N missing`, each of its JSONL
//! lines carries `"incomplete": true, "missing_step": N`, and statistics leave it out of every
//! figure and count it apart (`incomplete_trajectories`; a trajectory that is both is counted
//! here, not as open).

use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Write as _};

use serde::Serialize;

use super::dataset::{first_missing_step, Dataset, Trajectory};
use super::error::StoreError;
use super::record::StepRecord;
use crate::tokenizer::Tokenizer;

/// Whether a trajectory's figures are those of a finished episode: the marks the replay output
/// puts on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completeness {
    /// No terminal step yet ([`Trajectory::is_open`]).
    pub open: bool,
    /// The first step index missing among the stored steps ([`Trajectory::missing_step`]).
    pub missing_step: Option<u32>,
}

impl Completeness {
    /// The marks of `traj`; errors when its last step's metadata does not decode.
    pub fn of(traj: &Trajectory<'_>) -> Result<Self, StoreError> {
        Ok(Self {
            open: traj.is_open()?,
            missing_step: traj.missing_step(),
        })
    }

    /// Neither open nor missing a step.
    pub fn is_complete(&self) -> bool {
        !self.open && self.missing_step.is_none()
    }
}

/// The marks of every trajectory of `dataset`, from one pass over the records' step indices and
/// end flags (16 bytes a record are held, not the records).
pub fn completeness_by_trajectory(
    dataset: &Dataset,
) -> Result<HashMap<u64, Completeness>, StoreError> {
    let mut steps = Vec::with_capacity(dataset.len());
    for view in dataset.records() {
        let meta = view.meta_view()?;
        steps.push((
            view.traj_id,
            view.step_index,
            meta.terminated || meta.truncated,
        ));
    }
    steps.sort_unstable();
    let mut out = HashMap::new();
    for traj in steps.chunk_by(|a, b| a.0 == b.0) {
        let marks = Completeness {
            open: !traj.last().is_some_and(|s| s.2),
            missing_step: first_missing_step(traj.iter().map(|s| s.1)),
        };
        out.insert(traj[0].0, marks);
    }
    Ok(out)
}

/// The steps of a trajectory decoded into records.
pub fn decode_trajectory(traj: &Trajectory<'_>) -> Result<Vec<StepRecord>, StoreError> {
    traj.steps.iter().map(|s| s.to_record()).collect()
}

fn flags(info: &crate::env::StepInfo) -> String {
    let mut parts = Vec::new();
    parts.push(if info.action_is_valid {
        "valid"
    } else {
        "invalid"
    });
    if info.action_is_effective {
        parts.push("effective");
    }
    if info.success {
        parts.push("success");
    }
    if info.tool_call_error {
        parts.push("tool call error");
    }
    if info.context_rebuilt {
        parts.push("context rebuilt");
    }
    parts.join(", ")
}

/// A readable transcript of one trajectory: observation, action, reward and flags per step; with
/// a tokenizer, each step's new context tokens decoded too (what the model saw: the instruction
/// and the task at a context's start, tool results, template markers).
pub fn transcript(
    traj: &Trajectory<'_>,
    tokenizer: Option<&Tokenizer>,
) -> Result<String, StoreError> {
    let steps = decode_trajectory(traj)?;
    let mut out = String::new();
    let ret: f32 = steps.iter().map(|s| s.reward).sum();
    let success = steps.iter().any(|s| s.info.success);
    let first = steps.first().cloned().unwrap_or_default();
    let mut marks = String::new();
    if traj.is_open()? {
        marks.push_str(" | open: no terminal step yet");
    }
    if let Some(step) = traj.missing_step() {
        let _ = write!(marks, " | incomplete: step {step} missing");
    }
    let _ = writeln!(
        out,
        "=== trajectory {} | group {} | {} | seed {} | policy v{} | {} steps | return {ret:.3} | {}{marks} ===",
        traj.traj_id,
        traj.group_id,
        first.env_tag,
        first.seed,
        first.policy_version,
        steps.len(),
        if success { "success" } else { "no success" }
    );
    for step in &steps {
        let _ = writeln!(
            out,
            "--- step {} | reward {:.3} (format penalty {:.3}) | {} | {} actions | tokens: context {}, obs {}, response {} ---",
            step.step_index,
            step.reward,
            step.info.format_penalty,
            flags(&step.info),
            step.info.num_actions,
            step.context_len,
            step.obs_ids.len(),
            step.response_ids.len()
        );
        if let Some(tok) = tokenizer {
            let _ = writeln!(
                out,
                "[context: {} new tokens]\n{}",
                step.obs_ids.len(),
                tok.decode(&step.obs_ids).trim_end()
            );
        }
        let _ = writeln!(
            out,
            "[observation]\n{}",
            step.info.observation_text.trim_end()
        );
        let _ = writeln!(out, "[action]\n{}", step.info.action_text.trim_end());
        match (step.terminated, step.truncated) {
            (true, _) => out.push_str("[end: terminated]\n"),
            (false, true) => out.push_str("[end: truncated]\n"),
            _ => {}
        }
    }
    Ok(out)
}

/// One JSONL line (no newline) for a step; see the module documentation for the fields. A step
/// of an open trajectory is marked `"open": true`, one of a trajectory missing step N
/// `"incomplete": true, "missing_step": N`.
pub fn jsonl_line(record: &StepRecord, marks: Completeness) -> Result<String, serde_json::Error> {
    if marks.is_complete() {
        return serde_json::to_string(record);
    }
    let mut value = serde_json::to_value(record)?;
    if let serde_json::Value::Object(fields) = &mut value {
        if marks.open {
            fields.insert("open".into(), true.into());
        }
        if let Some(step) = marks.missing_step {
            fields.insert("incomplete".into(), true.into());
            fields.insert("missing_step".into(), step.into());
        }
    }
    serde_json::to_string(&value)
}

/// Mean, standard deviation (population), minimum and maximum of a sample.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Arithmetic mean (0 for an empty sample, as are the other fields).
    pub mean: f64,
    /// Population standard deviation.
    pub std: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

impl Summary {
    fn of(values: &[f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        Self {
            mean,
            std: var.sqrt(),
            min: values.iter().copied().fold(f64::INFINITY, f64::min),
            max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }
}

/// Statistics over a set of trajectories.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    /// Trajectories counted.
    pub trajectories: usize,
    /// Steps of those trajectories.
    pub steps: usize,
    /// Fraction of trajectories with a successful step.
    pub success_rate: f64,
    /// Per-trajectory return (sum of step rewards).
    pub return_stats: Summary,
    /// Per-step reward.
    pub reward: Summary,
    /// Trajectory length in steps.
    pub steps_per_trajectory: Summary,
    /// Fraction of steps whose actions were all valid.
    pub valid_action_rate: f64,
}

/// `replay --stats`: overall statistics and the same per env tag, over finished, complete
/// trajectories; the open and the incomplete ones counted apart; and the number of problems
/// (damage found at open, and records repeating an earlier record's key).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DatasetStats {
    /// Statistics over every finished, complete trajectory (flattened into the JSON).
    #[serde(flatten)]
    pub overall: Stats,
    /// The same statistics per env tag (the tag of a trajectory's first step).
    pub per_env: BTreeMap<String, Stats>,
    /// Trajectories with no terminal step yet, left out of every figure above.
    pub open_trajectories: usize,
    /// Trajectories missing a step (lost to damage), left out of every figure above.
    pub incomplete_trajectories: usize,
    /// Damage found when opening the dataset plus records repeating an earlier record's key.
    pub problems: usize,
}

#[derive(Default)]
struct Accumulator {
    returns: Vec<f64>,
    rewards: Vec<f64>,
    lengths: Vec<f64>,
    successes: usize,
    valid_steps: usize,
}

impl Accumulator {
    fn add(&mut self, steps: &[StepRecord]) {
        self.returns
            .push(steps.iter().map(|s| s.reward as f64).sum());
        self.rewards.extend(steps.iter().map(|s| s.reward as f64));
        self.lengths.push(steps.len() as f64);
        self.successes += usize::from(steps.iter().any(|s| s.info.success));
        self.valid_steps += steps.iter().filter(|s| s.info.action_is_valid).count();
    }

    fn finish(&self) -> Stats {
        let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        Stats {
            trajectories: self.returns.len(),
            steps: self.rewards.len(),
            success_rate: ratio(self.successes, self.returns.len()),
            return_stats: Summary::of(&self.returns),
            reward: Summary::of(&self.rewards),
            steps_per_trajectory: Summary::of(&self.lengths),
            valid_action_rate: ratio(self.valid_steps, self.rewards.len()),
        }
    }
}

impl DatasetStats {
    /// Decodes every trajectory of `dataset` and summarises it.
    pub fn compute(dataset: &Dataset) -> Result<Self, StoreError> {
        let mut overall = Accumulator::default();
        let mut per_env: BTreeMap<String, Accumulator> = BTreeMap::new();
        let (mut open_trajectories, mut incomplete_trajectories) = (0, 0);
        for traj in dataset.trajectories() {
            let marks = Completeness::of(&traj)?;
            if marks.missing_step.is_some() {
                incomplete_trajectories += 1;
                continue;
            }
            if marks.open {
                open_trajectories += 1;
                continue;
            }
            let steps = decode_trajectory(&traj)?;
            let tag = steps.first().map(|s| s.env_tag.clone()).unwrap_or_default();
            overall.add(&steps);
            per_env.entry(tag).or_default().add(&steps);
        }
        Ok(Self {
            overall: overall.finish(),
            per_env: per_env
                .iter()
                .map(|(k, v)| (k.clone(), v.finish()))
                .collect(),
            open_trajectories,
            incomplete_trajectories,
            problems: dataset.problems().len() + super::verify::duplicate_keys(dataset).len(),
        })
    }
}

fn write_stats_line(f: &mut fmt::Formatter<'_>, name: &str, s: &Stats) -> fmt::Result {
    writeln!(
        f,
        "{name:<16} {:>6} {:>7} {:>8.3} {:>8.3} ± {:<7.3} {:>7.2} [{}..{}] {:>6.3}",
        s.trajectories,
        s.steps,
        s.success_rate,
        s.return_stats.mean,
        s.return_stats.std,
        s.steps_per_trajectory.mean,
        s.steps_per_trajectory.min,
        s.steps_per_trajectory.max,
        s.valid_action_rate
    )
}

impl fmt::Display for DatasetStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<16} {:>6} {:>7} {:>8} {:>18} {:>16} {:>6}",
            "env", "trajs", "steps", "success", "return mean ± std", "steps/traj", "valid"
        )?;
        for (tag, stats) in &self.per_env {
            write_stats_line(f, tag, stats)?;
        }
        write_stats_line(f, "all", &self.overall)?;
        let r = &self.overall.reward;
        writeln!(f, "step reward: mean {:.4}, std {:.4}", r.mean, r.std)?;
        if self.open_trajectories > 0 {
            writeln!(
                f,
                "open trajectories (no terminal step yet; left out above): {}",
                self.open_trajectories
            )?;
        }
        if self.incomplete_trajectories > 0 {
            writeln!(
                f,
                "incomplete trajectories (a step lost to damage; left out above): {}",
                self.incomplete_trajectories
            )?;
        }
        writeln!(f, "problems: {}", self.problems)
    }
}
