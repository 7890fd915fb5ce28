//! What `stepppo view PATH` reads: PATH as a run directory (`dataset/`, `metrics.jsonl`,
//! `credit.jsonl`, `config.json`, checkpoints) or as a bare dataset; the tokenizer to show token boundaries
//! with; the advantage settings of the run; and the cheap fingerprint (segment file names and
//! sizes) that tells a live dataset grew. Everything here only reads.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use crate::algo::AdvantageConfig;
use crate::config::Config;
use crate::store::{Manifest, EXTRA_WORDS_KEY, MANIFEST_FILE, TOKENIZER_DIR_KEY};
use crate::tokenizer::Tokenizer;
use crate::train::run::checkpoint;
use crate::train::run::credit_log::{read_credit, StepCredit, CREDIT_FILE};

use super::error::ViewError;

/// The files behind one viewer.
#[derive(Clone, Debug)]
pub struct Source {
    /// PATH as given.
    pub root: PathBuf,
    /// The dataset directory (PATH itself, or `PATH/dataset`).
    pub dataset: PathBuf,
    /// `PATH/metrics.jsonl` of a run directory (it may not exist yet).
    pub metrics: Option<PathBuf>,
    /// `PATH/credit.jsonl` of a run directory: what the trainer used for each step (it may not
    /// exist yet, or ever for a run of an older stepppo).
    pub credit: Option<PathBuf>,
}

impl Source {
    /// Reads PATH: a dataset when it holds `manifest.json`, a run directory when
    /// `dataset/manifest.json` is inside it.
    pub fn locate(path: &Path) -> Result<Self, ViewError> {
        if path.join(MANIFEST_FILE).is_file() {
            return Ok(Self {
                root: path.to_path_buf(),
                dataset: path.to_path_buf(),
                metrics: None,
                credit: None,
            });
        }
        let dataset = path.join("dataset");
        if dataset.join(MANIFEST_FILE).is_file() {
            return Ok(Self {
                root: path.to_path_buf(),
                dataset,
                metrics: Some(path.join("metrics.jsonl")),
                credit: Some(path.join(CREDIT_FILE)),
            });
        }
        Err(ViewError::NotADataset {
            path: path.to_path_buf(),
        })
    }

    /// Whether PATH is a run directory (training steps exist) rather than a bare dataset.
    pub fn is_run(&self) -> bool {
        self.metrics.is_some()
    }

    /// The run's tokenizer: its latest checkpoint's `policy/tokenizer.json` when there is one,
    /// else the built-in tokenizer with the words the records were tokenised with (a run's
    /// `config.json` envs, a collected dataset's manifest list). A bare dataset whose manifest
    /// names the checkpoint that tokenised it (an imported chat log) reads with that one.
    pub fn tokenizer(&self) -> Result<Tokenizer, ViewError> {
        if !self.is_run() {
            if let Some(dir) = self.recorded_tokenizer_dir() {
                return Tokenizer::from_dir(&dir)
                    .map_err(|source| ViewError::Tokenizer { path: dir, source });
            }
            return Ok(Tokenizer::builtin_with_words(&self.collected_words()));
        }
        let latest = checkpoint::latest(&self.root).ok().flatten();
        match latest.map(|ckpt| ckpt.join("policy")) {
            Some(policy) if policy.join("tokenizer.json").is_file() => Tokenizer::from_dir(&policy)
                .map_err(|source| ViewError::Tokenizer {
                    path: policy,
                    source,
                }),
            _ => Ok(Tokenizer::builtin_with_words(
                &self
                    .config()
                    .and_then(|cfg| cfg.builtin_words().ok())
                    .unwrap_or_default(),
            )),
        }
    }

    /// The dataset manifest's `tokenizer` entry `key`, when there is one.
    fn tokenizer_entry(&self, key: &str) -> Option<serde_json::Value> {
        let manifest = Manifest::read(&self.dataset).ok()?;
        manifest.metadata.get("tokenizer")?.get(key).cloned()
    }

    /// The extra built-in words a collected dataset's manifest lists (none when it lists none).
    fn collected_words(&self) -> Vec<String> {
        self.tokenizer_entry(EXTRA_WORDS_KEY)
            .and_then(|words| serde_json::from_value(words).ok())
            .unwrap_or_default()
    }

    /// The checkpoint directory the manifest says tokenised the records, when it still holds a
    /// `tokenizer.json`.
    fn recorded_tokenizer_dir(&self) -> Option<PathBuf> {
        let dir = PathBuf::from(self.tokenizer_entry(TOKENIZER_DIR_KEY)?.as_str()?);
        dir.join("tokenizer.json").is_file().then_some(dir)
    }

    /// The advantage settings the run trained with (its `config.json`), else the defaults.
    pub fn advantage_config(&self) -> AdvantageConfig {
        self.config()
            .map_or_else(AdvantageConfig::default, |c| c.advantage_config())
    }

    /// The run's `config.json`, when it reads.
    fn config(&self) -> Option<Config> {
        let path = self.root.join("config.json");
        fs::read_to_string(&path)
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok())
            .and_then(|value| Config::from_value(value, &path.display().to_string()).ok())
    }

    /// The trainer's credit rows by (trajectory, step); empty for a bare dataset or a run
    /// without a credit log.
    pub fn credit(&self) -> Result<HashMap<(u64, u32), StepCredit>, ViewError> {
        match &self.credit {
            Some(path) => Ok(read_credit(path)?),
            None => Ok(HashMap::new()),
        }
    }

    /// Names and sizes of the dataset's segment files, in name order, and the size of the
    /// credit log: either changes when a live run writes.
    pub fn fingerprint(&self) -> Result<Fingerprint, ViewError> {
        let io = |source| ViewError::Io {
            path: self.dataset.clone(),
            source,
        };
        let mut files = Vec::new();
        for entry in fs::read_dir(&self.dataset).map_err(io)? {
            let entry = entry.map_err(io)?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("seg-") && name.ends_with(".stp") {
                files.push((name, entry.metadata().map_err(io)?.len()));
            }
        }
        files.sort();
        if let Some(credit) = self.credit.as_ref().filter(|p| p.is_file()) {
            let bytes = fs::metadata(credit).map_err(io)?.len();
            files.push((CREDIT_FILE.to_string(), bytes));
        }
        Ok(Fingerprint(files))
    }
}

/// Segment file names and sizes: a dataset whose fingerprint changed has new records.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fingerprint(Vec<(String, u64)>);
