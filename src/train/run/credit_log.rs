//! The trainer's account of every step it learned from, `<run>/credit.jsonl`: one JSON object per
//! step record of each update's batch, holding the numbers the update used for it: the critic's
//! value at the step's start (as the rollout-time scoring gave it), the return and advantage the
//! estimator assigned, whether the rollout filter kept it, its importance ratio on its first and
//! last pass through the update, and the behaviour policy's version against the learner's. The
//! viewer joins it to the records by (trajectory, step), so a run's trajectory page shows the
//! run's own credit assignment rather than a re-scoring. The file is one of the run's append-only
//! files: a checkpoint records its length ([`CreditLog::position`]) and a resume cuts it back
//! ([`rewind`]).

use crate::train::run::metrics::{self, io_err, MetricsError};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The credit log's name under the run directory.
pub const CREDIT_FILE: &str = "credit.jsonl";

/// What the update used for one step record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepCredit {
    /// The step record's trajectory.
    pub traj_id: u64,
    /// The step's 0-based index in its trajectory.
    pub step_index: u32,
    /// The policy version the update trained: the learner's.
    pub learner_version: u64,
    /// The policy version that sampled the response: the behaviour policy's.
    pub behaviour_version: u64,
    /// Whether the rollout filter kept the step for the policy loss.
    pub kept: bool,
    /// The critic's value at the step's start (a token-level critic's at its first response
    /// token), as the rollout-time scoring gave it; `None` when the estimator reads no critic.
    pub value: Option<f32>,
    /// The return the estimator assigned (at the step's first response token).
    #[serde(rename = "return")]
    pub ret: f32,
    /// The advantage, averaged over the step's response tokens: the step's one advantage under a
    /// step-level estimator. Before the behaviour correction of decoupled PPO, which weighs it
    /// per token.
    pub advantage: f32,
    /// The step's importance ratio `exp(mean over its tokens of log π/π_old)` on its first pass
    /// through the update; `None` when the policy loss never saw it (filtered out, actor frozen).
    pub ratio_first: Option<f32>,
    /// The same on its last pass (after the mini-batches and epochs before it moved the policy).
    pub ratio_last: Option<f32>,
}

impl StepCredit {
    /// Behaviour policy versions between the sampler and the learner (0 on-policy).
    pub fn staleness(&self) -> u64 {
        self.learner_version.saturating_sub(self.behaviour_version)
    }
}

/// Appends the credit rows of each update to `credit.jsonl`.
pub struct CreditLog {
    path: PathBuf,
    out: BufWriter<File>,
}

impl CreditLog {
    /// Opens `<run>/credit.jsonl` for appending (a resumed run continues the same file).
    pub fn open(run_dir: &Path) -> Result<Self, MetricsError> {
        let path = run_dir.join(CREDIT_FILE);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io_err(&path))?;
        Ok(CreditLog {
            out: BufWriter::new(file),
            path,
        })
    }

    /// Writes one line per row and flushes, so a reader never waits on a buffer.
    pub fn append(&mut self, rows: &[StepCredit]) -> Result<(), MetricsError> {
        for row in rows {
            let line = serde_json::to_string(row).map_err(|e| MetricsError::Record {
                path: self.path.clone(),
                offset: 0,
                msg: format!("trajectory {} step {}: {e}", row.traj_id, row.step_index),
            })?;
            writeln!(self.out, "{line}").map_err(io_err(&self.path))?;
        }
        self.out.flush().map_err(io_err(&self.path))
    }

    /// The log's length in bytes (everything appended is flushed).
    pub fn position(&mut self) -> Result<u64, MetricsError> {
        self.out.flush().map_err(io_err(&self.path))?;
        metrics::file_len(&self.path)
    }
}

/// Cuts the credit log of `run_dir` back to `bytes`, as a checkpoint recorded it.
pub fn rewind(run_dir: &Path, bytes: u64) -> Result<(), MetricsError> {
    metrics::cut(&run_dir.join(CREDIT_FILE), bytes)
}

/// The rows of a credit log by (trajectory, step); an empty map when there is no log. A later
/// row of the same step replaces an earlier one. A last line without its newline is a row still
/// being written (or cut by a crash) and is left out; any other line that does not read is an
/// error naming its line.
pub fn read_credit(path: &Path) -> Result<HashMap<(u64, u32), StepCredit>, MetricsError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(e) => return Err(io_err(path)(e)),
    };
    let complete = match text.rfind('\n') {
        Some(end) => &text[..=end],
        None => "",
    };
    let mut rows = HashMap::new();
    for (i, line) in complete.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row: StepCredit = serde_json::from_str(line).map_err(|e| MetricsError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            msg: e.to_string(),
        })?;
        rows.insert((row.traj_id, row.step_index), row);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(traj_id: u64, step_index: u32, advantage: f32) -> StepCredit {
        StepCredit {
            traj_id,
            step_index,
            learner_version: 3,
            behaviour_version: 1,
            kept: true,
            value: Some(0.5),
            ret: 1.0,
            advantage,
            ratio_first: Some(1.0),
            ratio_last: None,
        }
    }

    #[test]
    fn rows_read_back_by_step_and_a_torn_last_line_is_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = CreditLog::open(dir.path()).unwrap();
        log.append(&[row(7, 0, 0.25), row(7, 1, -0.5)]).unwrap();
        log.append(&[row(7, 1, 0.75)]).unwrap();
        let path = dir.path().join(CREDIT_FILE);
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        write!(file, "{{\"traj_id\": 9, \"step_").unwrap();
        let rows = read_credit(&path).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[&(7, 0)], row(7, 0, 0.25));
        assert_eq!(
            rows[&(7, 1)].advantage,
            0.75,
            "the later row of a step wins"
        );
        assert_eq!(rows[&(7, 0)].staleness(), 2);
        assert!(std::fs::read_to_string(&path)
            .unwrap()
            .contains("\"return\":1.0"));
    }

    #[test]
    fn a_bad_line_is_an_error_naming_it_and_a_missing_log_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CREDIT_FILE);
        assert!(read_credit(&path).unwrap().is_empty());
        std::fs::write(&path, "{\"traj_id\": 1}\n").unwrap();
        let err = read_credit(&path).unwrap_err().to_string();
        assert!(err.contains("credit.jsonl:1:"), "{err}");
    }
}
