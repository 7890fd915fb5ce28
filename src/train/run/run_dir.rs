//! The run directory as a whole: which directory a fresh run may start in, and the position of
//! its append-only files (the step dataset, `metrics.jsonl`, the TensorBoard events, the credit
//! log) that every checkpoint records, so that resuming brings each of them back to the
//! checkpoint's moment and nothing written after it (the rollouts, metric rows and events of steps
//! the crash undid) is kept twice. Checkpoint directories themselves are [`crate::train::run::checkpoint`]'s.

use crate::config::Config;
use crate::store::{self, DatasetPosition, DatasetWriter};
use crate::train::run::checkpoint;
use crate::train::run::credit_log::{self, CreditLog, CREDIT_FILE};
use crate::train::run::metrics::{self, MetricsPosition, MetricsSink};
use crate::train::warm_start::setup::{CRITIC_BASE_DIR, LORA_BASE_DIR, WARM_START_DIR};
use crate::train::TrainError;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Name (without `.json`) of the file in a checkpoint that holds its [`RunPosition`].
pub const POSITION_FILE: &str = "run_position";
/// The run's step dataset, under the run directory.
pub const DATASET_DIR: &str = "dataset";
/// The config a run was created with, under the run directory.
pub const CONFIG_FILE: &str = "config.json";
/// The frozen reference policy (HF layout), for a run that keeps one.
pub const REFERENCE_DIR: &str = "reference";
/// Where the run's append-only files stood when a checkpoint was taken.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunPosition {
    /// Where the step dataset's segments stood.
    pub dataset: DatasetPosition,
    /// Lengths of `metrics.jsonl` and the TensorBoard event files.
    pub metrics: MetricsPosition,
    /// Length of the credit log (`None` in checkpoints written before runs kept one).
    #[serde(default)]
    pub credit_bytes: Option<u64>,
}

impl RunPosition {
    /// Flushes the dataset, the metric sinks and the credit log and records where they stand.
    pub fn capture(
        run_dir: &Path,
        dataset: &mut DatasetWriter,
        sink: &mut MetricsSink,
        credit: &mut CreditLog,
    ) -> Result<Self, TrainError> {
        Ok(RunPosition {
            dataset: dataset.position()?,
            metrics: sink.position(run_dir)?,
            credit_bytes: Some(credit.position()?),
        })
    }
}

/// What a rewind removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rewound {
    /// Step records removed from the dataset.
    pub records: u64,
    /// Rows removed from `metrics.jsonl`.
    pub metric_rows: usize,
}

/// Brings the dataset and metric files of `run_dir` back to `position` (idempotent).
pub fn rewind(run_dir: &Path, position: &RunPosition) -> Result<Rewound, TrainError> {
    if let Some(bytes) = position.credit_bytes {
        credit_log::rewind(run_dir, bytes)?;
    }
    Ok(Rewound {
        records: store::rewind(&run_dir.join(DATASET_DIR), &position.dataset)?,
        metric_rows: metrics::rewind(run_dir, &position.metrics)?,
    })
}

/// The entries a run writes into its directory (checkpoints aside); `--overwrite` removes these
/// and nothing else, so a run directory that also holds a user's own files keeps them.
const RUN_ENTRIES: &[&str] = &[
    CONFIG_FILE,
    DATASET_DIR,
    "metrics.jsonl",
    CREDIT_FILE,
    "tb",
    REFERENCE_DIR,
    WARM_START_DIR,
    LORA_BASE_DIR,
    CRITIC_BASE_DIR,
    checkpoint::LATEST,
];

/// The checkpoint directories (complete or `.tmp`) and the run's own entries in `run_dir`.
fn run_entries(run_dir: &Path) -> Result<Vec<PathBuf>, TrainError> {
    if !run_dir.is_dir() {
        return Ok(Vec::new());
    }
    let io = |e| TrainError::Io {
        path: run_dir.to_path_buf(),
        source: e,
    };
    let mut found = Vec::new();
    for entry in std::fs::read_dir(run_dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let is_checkpoint = name.starts_with("ckpt-");
        let is_plot = name == crate::train::run::plot::PLOT_FILE;
        if is_checkpoint || is_plot || RUN_ENTRIES.contains(&name) {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}

/// Makes `run_dir` ready for a fresh run, creating nothing: a directory that already holds a run
/// is an error that says whether it can be resumed, unless `overwrite`, which removes that run's
/// files.
pub fn prepare_fresh(run_dir: &Path, overwrite: bool) -> Result<(), TrainError> {
    let entries = run_entries(run_dir)?;
    if !entries.is_empty() && !overwrite {
        let why = match checkpoint::latest(run_dir)? {
            Some(ckpt) => format!(
                "already holds a run (latest checkpoint {}); pass --resume to continue it",
                ckpt.file_name().unwrap_or_default().to_string_lossy()
            ),
            None => "holds a run that stopped before its first checkpoint, so there is nothing \
                     to resume"
                .to_string(),
        };
        return Err(TrainError::Data(format!(
            "{}: {why}, --overwrite to start over, or choose another --out",
            run_dir.display()
        )));
    }
    for path in entries {
        let removed = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.map_err(|source| TrainError::Io {
            path: path.clone(),
            source,
        })?;
    }
    Ok(())
}

/// The latest checkpoint of the run in `run_dir`, or an error that says why there is none to
/// resume from (and how to start over when the run stopped before its first checkpoint).
pub fn checkpoint_to_resume(run_dir: &Path) -> Result<PathBuf, TrainError> {
    if let Some(ckpt) = checkpoint::latest(run_dir)? {
        return Ok(ckpt);
    }
    let why = if run_entries(run_dir)?.is_empty() {
        "no run here to resume".to_string()
    } else {
        "the run stopped before its first checkpoint, so there is nothing to resume; \
         start it over with --overwrite"
            .to_string()
    };
    Err(TrainError::Data(format!("{}: {why}", run_dir.display())))
}

/// The config checkpoint `ckpt` was trained with (its `config.json`), with `--set` overrides.
pub fn checkpoint_config(ckpt: &Path, sets: &[String]) -> Result<Config, TrainError> {
    let mut value: serde_json::Value = checkpoint::load_json(ckpt, "config")?;
    for set in sets {
        crate::config::apply_set(&mut value, set)?;
    }
    let name = ckpt.join(CONFIG_FILE).display().to_string();
    Ok(Config::from_value(value, &name)?)
}
