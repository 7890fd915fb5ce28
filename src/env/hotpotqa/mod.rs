//! HotpotQA-style multi-hop search QA. The env loads records ([`data`]: official or Hugging
//! Face layout; by default the embedded synthetic fixture from [`synthetic`]), builds a local
//! corpus from every context paragraph of the loaded records, and answers `<search>query</search>`
//! with the BM25 top-k ([`bm25`]) wrapped as `\n\n<information>Doc i(Title: t) text\n…</information>\n\n`
//! (Search-R1). `<answer>…</answer>` ends the episode with reward = exact match after the
//! official normalization ([`metric`]); F1 is reported as a metric.
//!
//! Differences from StepPO / Search-R1 / ROLL: BM25 over the records' own paragraphs instead of a
//! dense retriever over Wikipedia; the question is part of the instruction and the per-turn state
//! is the latest search result (initially "No search results yet."); the turn limit is the
//! protocol's `max_turns` (default 4); an unparseable turn gets the format penalty instead of
//! Search-R1's "My previous action is invalid…" observation. The episode's record is chosen from
//! the split by the reset seed; `split` is `train`, `val` or `all`, assigned per record id hash.

pub mod bm25;
pub mod data;
pub mod metric;
pub mod synthetic;

use rand::seq::IndexedRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{bad_value, stable_hash, Action, ActionSpace, Env, EnvError, EnvInfo, Transition};
use bm25::Bm25;
use data::HotpotRecord;

/// HotpotQA settings (`--set key=value`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotpotQaConfig {
    /// Records file (official JSON list, HF JSON list or HF JSON Lines); `null` = the embedded
    /// synthetic fixture.
    pub data_file: Option<String>,
    /// `train`, `val` or `all`.
    pub split: String,
    /// Fraction of records (by id hash) in the `val` split.
    pub val_fraction: f64,
    /// Passages returned per search.
    pub topk: usize,
}

impl Default for HotpotQaConfig {
    fn default() -> Self {
        HotpotQaConfig {
            data_file: None,
            split: "train".into(),
            val_fraction: 0.2,
            topk: 3,
        }
    }
}

/// A corpus passage.
struct Passage {
    title: String,
    text: String,
}

/// Records and the search index.
struct QaData {
    records: Vec<HotpotRecord>,
    passages: Vec<Passage>,
    index: Bm25,
}

/// The QA env.
pub struct HotpotQaEnv {
    cfg: HotpotQaConfig,
    data: QaData,
    /// Indices into `data.records` of this split.
    split: Vec<usize>,
    current: usize,
    observation: String,
    searched: bool,
    finished: bool,
}

impl HotpotQaEnv {
    pub fn new(cfg: HotpotQaConfig) -> Result<Self, EnvError> {
        if cfg.topk == 0 {
            return Err(bad_value("hotpotqa", "topk", "must be at least 1"));
        }
        if !(0.0..=1.0).contains(&cfg.val_fraction) {
            return Err(bad_value("hotpotqa", "val_fraction", "must be in [0, 1]"));
        }
        let records = match &cfg.data_file {
            Some(path) => data::load_file(path)?,
            None => data::parse_records(data::EMBEDDED_FIXTURE, data::EMBEDDED_NAME)?,
        };
        let split = split_indices(&records, &cfg.split, cfg.val_fraction)?;
        let passages = corpus(&records);
        let docs: Vec<String> = passages
            .iter()
            .map(|p| format!("{} {}", p.title, p.text))
            .collect();
        let index = Bm25::new(&docs);
        let mut env = HotpotQaEnv {
            cfg,
            data: QaData {
                records,
                passages,
                index,
            },
            current: split[0],
            split,
            observation: String::new(),
            searched: false,
            finished: false,
        };
        env.reset(0);
        Ok(env)
    }

    /// The record of the current episode.
    pub fn record(&self) -> &HotpotRecord {
        &self.data.records[self.current]
    }

    /// Number of records in this env's split.
    pub fn split_len(&self) -> usize {
        self.split.len()
    }

    /// The `<information>` block for a query.
    fn search(&self, query: &str) -> String {
        let docs: String = self
            .data
            .index
            .search(query, self.cfg.topk)
            .iter()
            .enumerate()
            .map(|(i, &(doc, _))| {
                let p = &self.data.passages[doc];
                format!("Doc {}(Title: {}) {}\n", i + 1, p.title, p.text)
            })
            .collect();
        format!("\n\n<information>{docs}</information>\n\n")
    }
}

/// Indices of the records in `split`; a record is `val` when its id hash falls below
/// `val_fraction`.
fn split_indices(
    records: &[HotpotRecord],
    split: &str,
    val_fraction: f64,
) -> Result<Vec<usize>, EnvError> {
    let is_val = |r: &HotpotRecord| {
        let unit = crate::seed::splitmix64(stable_hash(r.id.as_bytes())) as f64 / u64::MAX as f64;
        unit < val_fraction
    };
    let keep: Box<dyn Fn(&HotpotRecord) -> bool> = match split {
        "all" => Box::new(|_| true),
        "train" => Box::new(|r| !is_val(r)),
        "val" => Box::new(is_val),
        other => {
            return Err(bad_value(
                "hotpotqa",
                "split",
                format!("`{other}` is not one of train, val, all"),
            ))
        }
    };
    let indices: Vec<usize> = (0..records.len()).filter(|&i| keep(&records[i])).collect();
    if indices.is_empty() {
        return Err(bad_value(
            "hotpotqa",
            "split",
            format!("split `{split}` holds no records"),
        ));
    }
    Ok(indices)
}

/// Every distinct context paragraph of the records, in first-seen order.
fn corpus(records: &[HotpotRecord]) -> Vec<Passage> {
    let mut seen = std::collections::HashSet::new();
    let mut passages = Vec::new();
    for (title, sentences) in records.iter().flat_map(|r| &r.context) {
        let text = sentences.concat().trim().to_string();
        if seen.insert((title.clone(), text.clone())) {
            passages.push(Passage {
                title: title.clone(),
                text,
            });
        }
    }
    passages
}

impl Env for HotpotQaEnv {
    fn tag(&self) -> &str {
        "hotpotqa"
    }

    fn reset(&mut self, seed: u64) -> String {
        let pick = crate::seed::derive(seed, &[1]) % self.split.len() as u64;
        self.current = self.split[pick as usize];
        self.observation = "No search results yet.".to_string();
        self.searched = false;
        self.finished = false;
        self.state_text()
    }

    fn step(&mut self, action: &Action) -> Transition {
        let mut info = EnvInfo::default();
        let (reward, terminated) = match action {
            _ if self.finished => (0.0, true),
            Action::Search(query) => {
                self.observation = self.search(query);
                self.searched = true;
                info.action_is_valid = true;
                info.action_is_effective = true;
                (0.0, false)
            }
            Action::Answer(answer) => {
                let gold = &self.record().answer;
                let em = metric::exact_match(answer, gold);
                let (f1, _, _) = metric::f1_score(answer, gold);
                self.observation = format!("Your answer: {answer}");
                self.finished = true;
                info = EnvInfo {
                    success: em == 1.0,
                    action_is_valid: true,
                    action_is_effective: true,
                    metrics: vec![("em", em), ("f1", f1)],
                };
                (em, true)
            }
            Action::Move(_) => (0.0, false),
        };
        Transition {
            observation: self.observation.clone(),
            reward,
            terminated,
            truncated: false,
            info,
        }
    }

    fn instruction(&self) -> String {
        format!(
            "Answer the question. Search with <search>query</search>; results come back in <information>…</information>. Give the final answer as <answer>short answer</answer>.\nQuestion: {}",
            self.record().question
        )
    }

    fn state_text(&self) -> String {
        self.observation.clone()
    }

    fn action_space(&self) -> ActionSpace {
        ActionSpace::SearchOrAnswer
    }

    fn max_steps(&self) -> usize {
        usize::MAX
    }

    fn oracle_action(&self) -> Action {
        if self.searched {
            Action::Answer(self.record().answer.clone())
        } else {
            Action::Search(self.record().question.clone())
        }
    }

    fn random_action(&self, rng: &mut ChaCha8Rng) -> Action {
        let titles: Vec<&String> = self.record().context.iter().map(|(t, _)| t).collect();
        let title = titles
            .choose(rng)
            .map(|t| t.to_string())
            .unwrap_or_default();
        if rng.random_bool(0.5) {
            Action::Search(title)
        } else {
            Action::Answer(title)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_returns_wrapped_top_k_with_gold_paragraphs() {
        let mut env = HotpotQaEnv::new(HotpotQaConfig::default()).unwrap();
        env.reset(5);
        let question = env.record().question.clone();
        let t = env.step(&Action::Search(question));
        assert!(t.observation.starts_with("\n\n<information>Doc 1(Title: "));
        assert!(t.observation.ends_with("</information>\n\n"));
        assert_eq!(t.observation.matches("Doc ").count(), 3);
        assert!(!t.terminated && t.reward == 0.0);
    }

    #[test]
    fn answers_are_scored_by_exact_match_with_f1_reported() {
        let mut env = HotpotQaEnv::new(HotpotQaConfig::default()).unwrap();
        env.reset(2);
        let gold = env.record().answer.clone();
        let t = env.step(&Action::Answer(format!("The {gold}.")));
        assert!(t.terminated && t.info.success && t.reward == 1.0);
        env.reset(2);
        let t = env.step(&Action::Answer("zzz".into()));
        assert_eq!(t.reward, 0.0);
        assert_eq!(t.info.metrics, vec![("em", 0.0), ("f1", 0.0)]);
    }

    #[test]
    fn splits_partition_the_records() {
        let cfg = |split: &str| HotpotQaConfig {
            split: split.into(),
            ..HotpotQaConfig::default()
        };
        let train = HotpotQaEnv::new(cfg("train")).unwrap().split_len();
        let val = HotpotQaEnv::new(cfg("val")).unwrap().split_len();
        let all = HotpotQaEnv::new(cfg("all")).unwrap().split_len();
        assert_eq!(train + val, all);
        assert!(val > 0 && train > val);
        let err = HotpotQaEnv::new(cfg("test")).err().unwrap().to_string();
        assert!(err.contains("split"), "{err}");
    }
}
