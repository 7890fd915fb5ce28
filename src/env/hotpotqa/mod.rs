//! HotpotQA-style multi-hop search QA. The env's records come from a generated world
//! ([`world`], the default: a world per (`world_seed`, `split`), train and val worlds sharing no
//! entity name), the embedded 80-record fixture ([`synthetic`], `world: fixture`) or a file
//! ([`data`]: official or Hugging Face layout, `data_file`). `<search>query</search>` returns the
//! BM25 top-k ([`corpus`], [`bm25`]) wrapped as `\n\n<information>Doc i(Title: t) text\n…
//! </information>\n\n` (Search-R1), searched over the episode record's own context (`corpus:
//! distractor`, HotpotQA's distractor setting) or over every paragraph of the world (`corpus:
//! world`, full-wiki-like; for a fixture or file, every distinct paragraph of the loaded
//! records). `question_type` (`bridge` or `comparison`) restricts an env to one type of question,
//! `templates` a generated world's env to some of its question templates. `<answer>…</answer>`
//! ends the episode with reward = exact match after the official normalization ([`metric`]), or
//! its token F1 with `reward: f1`; success is exact match and F1 is reported as a metric either
//! way. `retrieval_bonus` optionally pays a search that first brings up a gold paragraph (at
//! most once per gold paragraph, so at most twice an episode and below an answer's 1), logged
//! apart from EM. The oracle does the two hops: it
//! searches each supporting title in turn, then answers.
//!
//! Differences from StepPO / Search-R1 / ROLL: BM25 over generated or loaded paragraphs instead
//! of a dense retriever over Wikipedia; the question is part of the instruction and the per-turn
//! state is the latest search result (initially "No search results yet."), followed by the
//! question again with `restate_question`; the turn limit is the protocol's `max_turns` (default
//! 4); an unparseable turn gets the format penalty instead of Search-R1's "My previous action is
//! invalid…" observation. The episode's record is chosen from
//! the split by the reset seed. For a fixture or file, `split` (`train`, `val` or `all`) is
//! assigned per record id hash; for a generated world it picks the train or the val world.
//! Generated data (and its world index) is built once per process and shared by every env of
//! the same settings.

pub mod bm25;
pub mod corpus;
pub mod data;
pub mod metric;
pub mod synthetic;
pub mod world;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use rand::seq::IndexedRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{
    bad_value, flag, stable_hash, Action, ActionSpace, Env, EnvError, EnvInfo, Transition,
};
use corpus::Corpus;
use data::HotpotRecord;
use world::{Split, World};

/// Where the records come from when no `data_file` is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WorldKind {
    /// A made-up world of `world_size` entities with `world_questions` bridge and comparison
    /// questions and `distractors` distractor paragraphs per question, drawn from `world_seed`;
    /// `split: train` and `split: val` are two worlds of that seed that share no entity name,
    /// so validation answers can never be memorised. Names are made of 192 invented name words
    /// shared by both worlds, and a run on generated worlds with the built-in model gives each
    /// name word and each word of the world's text a whole-word token, so a name is two tokens
    /// to copy, not ten bytes to spell (the built-in byte and word ids stay as they are; the new
    /// words follow them, and the special tokens follow the new words).
    Generated,
    /// The embedded 80-record fixture, split by record id hash (`val_fraction`).
    Fixture,
}

/// What a search runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CorpusKind {
    /// The question's own context: its 2 gold and its distractor paragraphs (HotpotQA's
    /// distractor setting).
    Distractor,
    /// Every paragraph of the split's world (fixture or file: every distinct paragraph of the
    /// loaded records), full-wiki-like.
    World,
}

/// Which questions an env asks, by the record's `type`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum QuestionType {
    /// Every question of the split.
    #[default]
    All,
    /// Bridge questions only (`type: bridge`).
    Bridge,
    /// Comparison questions only (`type: comparison`).
    Comparison,
}

impl QuestionType {
    /// The word a config writes for this type.
    fn name(self) -> &'static str {
        match self {
            QuestionType::All => "all",
            QuestionType::Bridge => "bridge",
            QuestionType::Comparison => "comparison",
        }
    }

    /// Whether a record of HotpotQA `type` `kind` is asked.
    fn admits(self, kind: &str) -> bool {
        match self {
            QuestionType::All => true,
            QuestionType::Bridge => kind == "bridge",
            QuestionType::Comparison => kind == "comparison",
        }
    }
}

/// What an answer is paid. Success, the reported score, is exact match either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AnswerReward {
    /// 1 for an exact match after the official normalization, else 0.
    #[default]
    Em,
    /// The answer's token F1 against the gold answer (R1-Searcher's reward): a name with one of
    /// its two words right earns 0.5, so a near miss is told apart from a wrong name.
    F1,
}

/// HotpotQA's own keys (`env_type: hotpotqa`): multi-hop search QA over a generated world, the
/// embedded fixture or a records file. `<search>query</search>` returns the BM25 top-k passages
/// (Search-R1's `<information>` block); `<answer>…</answer>` ends the episode, paid by exact
/// match after the official normalization (or token F1, `reward: f1`); F1 is reported either
/// way. The question is part of the instruction and each turn's state is the latest search
/// result. The episode's record is chosen from the split by the reset seed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(default)]
pub struct HotpotQaConfig {
    /// Where the records come from; unused when `data_file` is set.
    pub world: WorldKind,
    /// Seed of the generated train and val worlds (and of their shared name partition).
    pub world_seed: u64,
    /// Entities per generated world.
    pub world_size: usize,
    /// Questions per generated world, bridge and comparison alternating; at least 1.
    pub world_questions: usize,
    /// Distractor paragraphs per generated question (the official distractor setting uses 8).
    pub distractors: usize,
    /// Records file (official HotpotQA JSON list, HF JSON list or HF JSON Lines); when set, it
    /// replaces the world and the `world*` keys are unused.
    pub data_file: Option<String>,
    /// Which records the env asks.
    #[schemars(schema_with = "split_schema")]
    pub split: String,
    /// Fraction of records (by id hash) in the `val` split of a fixture or file, in [0, 1].
    pub val_fraction: f64,
    /// What a search runs over.
    pub corpus: CorpusKind,
    /// Passages returned per search; at least 1.
    pub topk: usize,
    /// A generated world of its own for every episode (`world: generated` and no `data_file`
    /// only): the reset seed draws a world of `world_size` entities whose names come from the
    /// split's side of `world_seed`'s name partition, and one of its questions (one per
    /// template). No name keeps its facts from one episode to the next, so answers can only be
    /// read, never remembered, even on the training split.
    pub episode_worlds: bool,
    /// The env asks only questions of this HotpotQA `type` (e.g. the transcripts of a warm start
    /// that teaches one type and leaves the other to RL); an error when the split holds none.
    pub question_type: QuestionType,
    /// What an answer is paid; success and the reported EM stay exact match either way.
    pub reward: AnswerReward,
    /// Names of the generated question templates the env asks, e.g. `[founder_birth_city,
    /// same_country]`; empty: all twelve (`founder_birth_city`, `born_first`,
    /// `director_employer`, `same_birth_city`, `headquarters_country`, `founded_earlier`,
    /// `employer_founder`, `same_employer`, `film_country`, `released_first`,
    /// `director_birth_city`, `same_country`). Generated worlds only (a warm start on some
    /// templates, RL and validation on all); an unknown name, or templates with a fixture or a
    /// file, is an error.
    pub templates: Vec<String>,
    /// Paid on a search whose top-k shows one of the question's two gold paragraphs for the
    /// first time in the episode, once per gold paragraph; in [0, 0.5), so the two of an episode
    /// stay below a right answer's 1. Logged as the metric `retrieval_bonus`, apart from EM;
    /// success stays exact match.
    pub retrieval_bonus: f32,
    /// Ends every turn's state with the question again (`Question: …`), so that it sits next to
    /// the search results the next action reads, not only in the first message's instruction.
    pub restate_question: bool,
}

/// The JSON Schema of `split`: a string read per data source.
fn split_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "oneOf": [
            {
                "const": "train",
                "description": "The train world (generated), or the records outside the val \
                    fraction (fixture or file)."
            },
            {
                "const": "val",
                "description": "The val world (generated: it shares no entity name with the \
                    train world), or the `val_fraction` of the records by id hash (fixture or \
                    file)."
            },
            {
                "const": "all",
                "description": "Every record (fixture or file only)."
            }
        ]
    })
}

impl Default for HotpotQaConfig {
    fn default() -> Self {
        HotpotQaConfig {
            world: WorldKind::Generated,
            world_seed: 0,
            world_size: 400,
            world_questions: 2400,
            distractors: 6,
            data_file: None,
            split: "train".into(),
            val_fraction: 0.2,
            corpus: CorpusKind::Distractor,
            topk: 3,
            episode_worlds: false,
            question_type: QuestionType::All,
            reward: AnswerReward::Em,
            templates: Vec::new(),
            retrieval_bonus: 0.0,
            restate_question: false,
        }
    }
}

impl HotpotQaConfig {
    /// Whether the records come from a generated world (no `data_file`, `world: generated`).
    fn is_generated(&self) -> bool {
        self.data_file.is_none() && self.world == WorldKind::Generated
    }

    /// The words a generated world writes ([`world::vocabulary`]); none for a fixture or a
    /// file, whose text the tokenizer takes as it comes.
    pub fn builtin_words(&self) -> Vec<String> {
        if self.is_generated() {
            world::vocabulary()
        } else {
            Vec::new()
        }
    }

    /// Whether the env asks generated record `index`, by its template and its `type`.
    fn asks(&self, index: usize, kind: &str) -> bool {
        let template = world::template_name(index);
        self.question_type.admits(kind)
            && (self.templates.is_empty() || self.templates.iter().any(|t| t == template))
    }

    /// Errors of `templates` and `retrieval_bonus`.
    fn check_questions_and_bonus(&self) -> Result<(), EnvError> {
        if !self.templates.is_empty() && !self.is_generated() {
            return Err(bad_value(
                "hotpotqa",
                "templates",
                "needs world: generated and no data_file (templates are the generated \
                 questions')",
            ));
        }
        if let Some(unknown) = self
            .templates
            .iter()
            .find(|t| !world::template_names().any(|name| name == t.as_str()))
        {
            let known: Vec<&str> = world::template_names().collect();
            return Err(bad_value(
                "hotpotqa",
                "templates",
                format!("unknown template `{unknown}` (known: {})", known.join(", ")),
            ));
        }
        if !(0.0..0.5).contains(&self.retrieval_bonus) {
            return Err(bad_value(
                "hotpotqa",
                "retrieval_bonus",
                format!(
                    "{} is not in [0, 0.5): the bonus of both gold paragraphs must stay below \
                     a right answer's 1",
                    self.retrieval_bonus
                ),
            ));
        }
        Ok(())
    }
}

/// Records, the split and the whole-world index: everything an env reads and never changes.
struct QaData {
    records: Vec<HotpotRecord>,
    /// Indices into `records` of this split.
    split: Vec<usize>,
    /// The index over the whole world (`corpus: world`).
    world: Option<Corpus>,
}

/// Data of generated worlds and of the fixture, by settings, shared across the envs of a
/// process (a rollout builds one env per trajectory).
static SHARED: OnceLock<Mutex<HashMap<String, Arc<QaData>>>> = OnceLock::new();
/// Settings kept in [`SHARED`] before it is emptied.
const SHARED_MAX: usize = 16;

impl QaData {
    /// The data of `cfg`, from the process-wide share unless it is read from a file.
    fn get(cfg: &HotpotQaConfig) -> Result<Arc<QaData>, EnvError> {
        if cfg.data_file.is_some() {
            return Ok(Arc::new(QaData::build(cfg)?));
        }
        let key = serde_json::to_string(&HotpotQaConfig {
            topk: 0,
            ..cfg.clone()
        })
        .expect("configs serialize");
        let shared = SHARED.get_or_init(Default::default);
        let mut shared = shared
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(data) = shared.get(&key) {
            return Ok(Arc::clone(data));
        }
        let data = Arc::new(QaData::build(cfg)?);
        if shared.len() >= SHARED_MAX {
            shared.clear();
        }
        shared.insert(key, Arc::clone(&data));
        Ok(data)
    }

    fn build(cfg: &HotpotQaConfig) -> Result<QaData, EnvError> {
        let Source {
            records,
            mut split,
            world,
        } = match (&cfg.data_file, cfg.world) {
            (Some(path), _) => loaded(data::load_file(path)?, cfg)?,
            (None, WorldKind::Fixture) => loaded(
                data::parse_records(data::EMBEDDED_FIXTURE, data::EMBEDDED_NAME)?,
                cfg,
            )?,
            (None, WorldKind::Generated) => generated(cfg)?,
        };
        split.retain(|&i| match world {
            Some(_) => cfg.asks(i, &records[i].kind),
            None => cfg.question_type.admits(&records[i].kind),
        });
        if split.is_empty() {
            return Err(no_question_of_type(cfg));
        }
        let world = match cfg.corpus {
            CorpusKind::Distractor => None,
            CorpusKind::World => Some(match &world {
                Some(world) => Corpus::new(world.paragraphs()),
                None => Corpus::new(records.iter().flat_map(|r| &r.context)),
            }),
        };
        Ok(QaData {
            records,
            split,
            world,
        })
    }
}

/// The error of a `question_type` (and `templates`) that leaves the split without a question.
fn no_question_of_type(cfg: &HotpotQaConfig) -> EnvError {
    let templates = if cfg.templates.is_empty() {
        String::new()
    } else {
        format!(" among templates {}", cfg.templates.join(", "))
    };
    bad_value(
        "hotpotqa",
        "question_type",
        format!(
            "split `{}` holds no question of type `{}`{templates}",
            cfg.split,
            cfg.question_type.name()
        ),
    )
}

/// Records, the indices of the split and, for a generated world, the world.
struct Source {
    records: Vec<HotpotRecord>,
    split: Vec<usize>,
    world: Option<World>,
}

/// Loaded records and their split by id hash; no world.
fn loaded(records: Vec<HotpotRecord>, cfg: &HotpotQaConfig) -> Result<Source, EnvError> {
    let split = split_indices(&records, &cfg.split, cfg.val_fraction)?;
    Ok(Source {
        records,
        split,
        world: None,
    })
}

/// Seed path of the worlds made per episode (`episode_worlds`).
const EPISODE_WORLD_STREAM: u64 = 0xE915;

/// The side of a generated world named by `split`.
fn split_of(split: &str) -> Result<Split, EnvError> {
    match split {
        "train" => Ok(Split::Train),
        "val" => Ok(Split::Val),
        other => Err(bad_value(
            "hotpotqa",
            "split",
            format!(
                "`{other}` is not one of train, val (a generated world is either the train \
                 or the val world; `all` needs world: fixture or a data_file)"
            ),
        )),
    }
}

/// The split's generated world and its questions, all in the split.
fn generated(cfg: &HotpotQaConfig) -> Result<Source, EnvError> {
    let split = split_of(&cfg.split)?;
    if cfg.world_questions == 0 {
        return Err(bad_value(
            "hotpotqa",
            "world_questions",
            "must be at least 1",
        ));
    }
    let world = World::generate(cfg.world_seed, split, cfg.world_size)
        .map_err(|reason| bad_value("hotpotqa", "world_size", reason))?;
    let records = world
        .records(cfg.world_questions, cfg.distractors)
        .map_err(|reason| bad_value("hotpotqa", "world_size", reason))?;
    Ok(Source {
        split: (0..records.len()).collect(),
        records,
        world: Some(world),
    })
}

/// The QA env.
pub struct HotpotQaEnv {
    cfg: HotpotQaConfig,
    data: Arc<QaData>,
    /// Index into `data.records` of the episode's record.
    current: usize,
    /// The episode's record when it comes from a world of its own (`episode_worlds`).
    episode_record: Option<HotpotRecord>,
    /// The episode record's own context (`corpus: distractor`).
    episode_corpus: Option<Corpus>,
    /// The generated question template of the episode's record (`None` for a fixture or file).
    template: Option<&'static str>,
    /// Queries searched this episode.
    queries: Vec<String>,
    /// Gold titles a search has shown this episode (each paid `retrieval_bonus` once).
    gold_retrieved: Vec<String>,
    /// Whether a search has shown the gold answer this episode (a fact of the critic state).
    answer_shown: bool,
    observation: String,
    finished: bool,
}

impl HotpotQaEnv {
    /// Builds the env from `cfg` (loading or generating its records) and resets it with seed 0;
    /// fails on an invalid config value.
    pub fn new(cfg: HotpotQaConfig) -> Result<Self, EnvError> {
        if cfg.topk == 0 {
            return Err(bad_value("hotpotqa", "topk", "must be at least 1"));
        }
        if !(0.0..=1.0).contains(&cfg.val_fraction) {
            return Err(bad_value("hotpotqa", "val_fraction", "must be in [0, 1]"));
        }
        cfg.check_questions_and_bonus()?;
        if cfg.episode_worlds && !cfg.is_generated() {
            return Err(bad_value(
                "hotpotqa",
                "episode_worlds",
                "needs world: generated and no data_file (a fixture or a file is one set of \
                 records)",
            ));
        }
        let data = QaData::get(&cfg)?;
        let mut env = HotpotQaEnv {
            cfg,
            current: data.split[0],
            episode_record: None,
            data,
            episode_corpus: None,
            template: None,
            queries: Vec::new(),
            gold_retrieved: Vec::new(),
            answer_shown: false,
            observation: String::new(),
            finished: false,
        };
        env.reset(0)?;
        Ok(env)
    }

    /// The record of the current episode.
    pub fn record(&self) -> &HotpotRecord {
        self.episode_record
            .as_ref()
            .unwrap_or(&self.data.records[self.current])
    }

    /// The groups of questions the episode's record is counted under in the metrics: its
    /// HotpotQA `type` (when the record has one) and its generated template (when it has one).
    fn question_groups(&self) -> Vec<String> {
        let kind = &self.record().kind;
        (!kind.is_empty())
            .then(|| kind.clone())
            .into_iter()
            .chain(self.template.map(str::to_string))
            .collect()
    }

    /// Number of records in this env's split.
    pub fn split_len(&self) -> usize {
        self.data.split.len()
    }

    /// The records of this env's split.
    pub fn split_records(&self) -> impl Iterator<Item = &HotpotRecord> {
        self.data.split.iter().map(|&i| &self.data.records[i])
    }

    /// The corpus searches run over in the current episode.
    fn corpus(&self) -> &Corpus {
        self.episode_corpus
            .as_ref()
            .or(self.data.world.as_ref())
            .expect("a reset builds the episode's corpus unless the world's is shared")
    }

    /// The record, its template and the corpus of a world made for the episode of reset seed
    /// `seed`.
    fn episode_world(&self, seed: u64) -> Result<(HotpotRecord, &'static str, Corpus), EnvError> {
        let split = split_of(&self.cfg.split)?;
        let world_seed = crate::seed::derive(self.cfg.world_seed, &[EPISODE_WORLD_STREAM, seed]);
        let world = World::generate_in(self.cfg.world_seed, world_seed, split, self.cfg.world_size)
            .map_err(|reason| bad_value("hotpotqa", "world_size", reason))?;
        let records = world
            .records(world::TEMPLATE_COUNT, self.cfg.distractors)
            .map_err(|reason| bad_value("hotpotqa", "world_size", reason))?;
        let asked: Vec<(usize, &HotpotRecord)> = records
            .iter()
            .enumerate()
            .filter(|(index, r)| self.cfg.asks(*index, &r.kind))
            .collect();
        if asked.is_empty() {
            return Err(no_question_of_type(&self.cfg));
        }
        let pick = crate::seed::derive(seed, &[1]) % asked.len() as u64;
        let (index, record) = asked[pick as usize];
        let record = record.clone();
        let corpus = match self.cfg.corpus {
            CorpusKind::Distractor => Corpus::new(&record.context),
            CorpusKind::World => Corpus::new(world.paragraphs()),
        };
        Ok((record, world::template_name(index), corpus))
    }

    /// The question's gold paragraphs' titles, once each, in the order of its supporting facts.
    fn gold_titles(&self) -> Vec<&str> {
        let mut titles: Vec<&str> = Vec::new();
        for (title, _) in &self.record().supporting_facts {
            if !titles.contains(&title.as_str()) {
                titles.push(title);
            }
        }
        titles
    }

    /// Notes the gold paragraphs among a search's `shown` titles; returns how many it shows for
    /// the first time this episode.
    fn note_gold_shown(&mut self, shown: &[String]) -> usize {
        let new: Vec<String> = self
            .gold_titles()
            .into_iter()
            .filter(|title| shown.iter().any(|s| s == title))
            .filter(|title| !self.gold_retrieved.iter().any(|g| g == title))
            .map(str::to_string)
            .collect();
        let count = new.len();
        self.gold_retrieved.extend(new);
        count
    }

    /// Whether `text` holds the gold answer as whole words, both under the official
    /// normalization.
    fn holds_answer(&self, text: &str) -> bool {
        let answer = metric::normalize_answer(&self.record().answer);
        !answer.is_empty()
            && format!(" {} ", metric::normalize_answer(text)).contains(&format!(" {answer} "))
    }

    /// Titles of the top-k passages for `query` in the current episode, best first.
    pub fn search_titles(&self, query: &str) -> Vec<&str> {
        self.corpus().titles(query, self.cfg.topk)
    }

    /// A search's `<information>` block and the titles it shows, from one ranking.
    fn search(&self, query: &str) -> (String, Vec<String>) {
        let shown = self.corpus().passages(query, self.cfg.topk);
        let titles = shown.iter().map(|(title, _)| title.to_string()).collect();
        (Corpus::render_passages(&shown), titles)
    }
}

/// Searches the critic state counts before it saturates (the search-QA configs allow 4 turns).
const SEARCHES_COUNTED: usize = 4;

/// First words of a yes/no question.
const YES_NO_OPENERS: [&str; 7] = ["Is", "Are", "Was", "Were", "Do", "Does", "Did"];

impl HotpotQaEnv {
    /// The searcher agent's answer (see [`Env::searcher_action`]).
    fn guess(&self, rng: &mut ChaCha8Rng) -> String {
        let question = &self.record().question;
        let (opener, rest) = question.split_once(' ').unwrap_or((question, ""));
        if YES_NO_OPENERS.contains(&opener) {
            return ["yes", "no"].choose(rng).expect("non-empty").to_string();
        }
        if let Some(options) = offered_options(question) {
            return options.choose(rng).expect("two options").clone();
        }
        let mut names: std::collections::BTreeSet<String> = names_in(rest).into_iter().collect();
        for query in &self.queries {
            for (title, text) in self.corpus().passages(query, self.cfg.topk) {
                names.insert(title.to_string());
                names.extend(names_in(text));
            }
        }
        let names: Vec<String> = names.into_iter().collect();
        names.choose(rng).cloned().unwrap_or_default()
    }
}

/// The two options a choice question offers after its last comma, as in "Who was born first,
/// Rovsta Galnax or Melpim Ulvor?" or "Which magazine was started first, Arthur's Magazine or
/// First for Women?" (HotpotQA's comparison questions take this form); `None` without a clause
/// "A or B?" of two non-empty options.
fn offered_options(question: &str) -> Option<[String; 2]> {
    let (_, clause) = question.rsplit_once(", ")?;
    let (first, second) = clause.trim_end().strip_suffix('?')?.split_once(" or ")?;
    let (first, second) = (first.trim(), second.trim());
    (!first.is_empty() && !second.is_empty()).then(|| [first.to_string(), second.to_string()])
}

/// Runs of capitalized words in `text` (a name; punctuation ends a run), e.g. "The Vorgal
/// Harbor", "Meleko Motors".
fn names_in(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut run: Vec<&str> = Vec::new();
    for raw in text.split_whitespace() {
        let word = raw.trim_start_matches(|c: char| !c.is_alphanumeric());
        let bare = word.trim_end_matches(|c: char| !c.is_alphanumeric());
        let capitalized = bare.chars().next().is_some_and(char::is_uppercase)
            && bare.chars().all(char::is_alphabetic);
        if capitalized && word.len() == raw.len() {
            run.push(bare);
        } else if capitalized {
            // Punctuation before the word starts a new run.
            flush(&mut run, &mut names);
            run.push(bare);
        } else {
            flush(&mut run, &mut names);
        }
        if bare.len() < word.len() {
            flush(&mut run, &mut names);
        }
    }
    flush(&mut run, &mut names);
    names
}

/// Moves a finished run into `names` (a lone sentence-opening "The" is no name).
fn flush(run: &mut Vec<&str>, names: &mut Vec<String>) {
    if !run.is_empty() && run[..] != ["The"] {
        names.push(run.join(" "));
    }
    run.clear();
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

impl Env for HotpotQaEnv {
    fn tag(&self) -> &str {
        "hotpotqa"
    }

    fn reset(&mut self, seed: u64) -> Result<String, EnvError> {
        if self.cfg.episode_worlds {
            let (record, template, corpus) = self.episode_world(seed)?;
            self.episode_record = Some(record);
            self.template = Some(template);
            self.episode_corpus = Some(corpus);
        } else {
            let pick = crate::seed::derive(seed, &[1]) % self.data.split.len() as u64;
            self.current = self.data.split[pick as usize];
            self.template = self
                .cfg
                .is_generated()
                .then(|| world::template_name(self.current));
            self.episode_corpus = match self.data.world {
                Some(_) => None,
                None => Some(Corpus::new(&self.record().context)),
            };
        }
        self.observation = "No search results yet.".to_string();
        self.queries.clear();
        self.gold_retrieved.clear();
        self.answer_shown = false;
        self.finished = false;
        Ok(self.state_text())
    }

    /// Metrics (summed over an episode's turns by the rollout): `searches` (1 per search, 0 with
    /// the answer), `em` and `f1` of the answer (also 0 at a first action that searches, so the
    /// keys exist even when no episode of a batch answered), `em_<group>` (the answer's EM under
    /// each group of questions it belongs to: its type, e.g. `em_bridge`, and for a generated
    /// world its template, e.g. `em_director_employer`) and `question_<group>` (1 at the
    /// episode's first action), so that `em_bridge / question_bridge` is the EM of the bridge
    /// questions whose episodes made a valid action (the env never sees the others).
    fn step(&mut self, action: &Action) -> Result<Transition, EnvError> {
        let mut info = EnvInfo::default();
        let first_action = self.queries.is_empty() && !self.finished;
        let groups = self.question_groups();
        let mut bonus = 0.0;
        let (reward, terminated) = match action {
            _ if self.finished => (0.0, true),
            Action::Search(query) => {
                let (observation, shown) = self.search(query);
                bonus = self.cfg.retrieval_bonus * self.note_gold_shown(&shown) as f32;
                self.answer_shown |= self.holds_answer(&observation);
                self.observation = observation;
                self.queries.push(query.clone());
                info.action_is_valid = true;
                info.action_is_effective = true;
                info.metrics.push(("searches".into(), 1.0));
                (bonus, false)
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
                    metrics: vec![
                        ("em".into(), em),
                        ("f1".into(), f1),
                        // Logged as 0 when no episode searched, rather than left out.
                        ("searches".into(), 0.0),
                    ],
                };
                info.metrics
                    .extend(groups.iter().map(|g| (format!("em_{g}"), em)));
                let paid = match self.cfg.reward {
                    AnswerReward::Em => em,
                    AnswerReward::F1 => f1,
                };
                (paid, true)
            }
            Action::Move(_) => (0.0, false),
        };
        if first_action && !matches!(action, Action::Answer(_)) {
            // An episode scores 0 until it answers, so EM and F1 are logged (as 0) even when no
            // episode of a batch answered, rather than left out.
            info.metrics
                .extend([("em".into(), 0.0), ("f1".into(), 0.0)]);
            info.metrics
                .extend(groups.iter().map(|g| (format!("em_{g}"), 0.0)));
        }
        if first_action {
            info.metrics
                .extend(groups.iter().map(|g| (format!("question_{g}"), 1.0)));
        }
        if self.cfg.retrieval_bonus > 0.0 {
            info.metrics.push(("retrieval_bonus".into(), bonus));
        }
        Ok(Transition {
            observation: self.state_text(),
            reward,
            terminated,
            truncated: false,
            info,
        })
    }

    fn instruction(&self) -> String {
        format!(
            "Answer the question. Search with <search>query</search>; results come back in <information>…</information>. Give the final answer as <answer>short answer</answer>.\nQuestion: {}",
            self.record().question
        )
    }

    fn tool_instruction(&self) -> String {
        format!(
            "Answer the question. Search with the `search` function; give the final answer with the `answer` function.\nQuestion: {}",
            self.record().question
        )
    }

    fn state_text(&self) -> String {
        if self.cfg.restate_question {
            let observation = self.observation.trim_end_matches('\n');
            format!("{observation}\nQuestion: {}", self.record().question)
        } else {
            self.observation.clone()
        }
    }

    /// Privileged facts for an asymmetric critic (`critic.mode: state`), each in [0, 1]: what
    /// the searches so far have found, read against the gold the policy never sees. The share
    /// of the question's gold paragraphs shown, whether the first and the second were shown,
    /// whether a search showed the gold answer, whether the latest state holds it, whether the
    /// question itself holds it (a choice between two names), whether it is a comparison
    /// question, the searches made (counted up to [`SEARCHES_COUNTED`]) and whether the episode
    /// has answered.
    fn critic_state(&self) -> Option<Vec<f32>> {
        let gold = self.gold_titles();
        let shown = |title: &str| self.gold_retrieved.iter().any(|g| g == title);
        let share = gold.iter().filter(|t| shown(t)).count() as f32 / gold.len().max(1) as f32;
        let searches = self.queries.len().min(SEARCHES_COUNTED) as f32 / SEARCHES_COUNTED as f32;
        Some(vec![
            share,
            flag(gold.first().is_some_and(|t| shown(t))),
            flag(gold.get(1).is_some_and(|t| shown(t))),
            flag(self.answer_shown),
            flag(self.holds_answer(&self.observation)),
            flag(self.holds_answer(&self.record().question)),
            flag(self.record().kind == "comparison"),
            searches,
            flag(self.finished),
        ])
    }

    fn action_space(&self) -> ActionSpace {
        ActionSpace::SearchOrAnswer
    }

    fn max_steps(&self) -> usize {
        usize::MAX
    }

    /// Searches each supporting title not searched yet, in order (the first entity, then the
    /// bridge or second entity), then answers; a record without supporting facts gets one
    /// search of its question.
    fn oracle_action(&self) -> Result<Action, EnvError> {
        let record = self.record();
        let next = record
            .supporting_facts
            .iter()
            .map(|(title, _)| title)
            .find(|title| !self.queries.contains(title));
        Ok(match next {
            Some(title) => Action::Search(title.clone()),
            None if record.supporting_facts.is_empty() && self.queries.is_empty() => {
                Action::Search(record.question.clone())
            }
            None => Action::Answer(record.answer.clone()),
        })
    }

    /// The oracle's searches, then an answer drawn uniformly from what a reader could guess
    /// without knowing the answer: `yes`/`no` for a question that opens like a yes/no question,
    /// the two offered names for a choice question ("…, A or B?"), else the names (capitalized
    /// word runs) of the question and of every passage read.
    fn searcher_action(&self, rng: &mut ChaCha8Rng) -> Result<Action, EnvError> {
        Ok(match self.oracle_action()? {
            Action::Answer(_) => Action::Answer(self.guess(rng)),
            search => search,
        })
    }

    fn random_action(&self, rng: &mut ChaCha8Rng) -> Result<Action, EnvError> {
        let titles: Vec<&String> = self.record().context.iter().map(|(t, _)| t).collect();
        let title = titles
            .choose(rng)
            .map(|t| t.to_string())
            .unwrap_or_default();
        Ok(if rng.random_bool(0.5) {
            Action::Search(title)
        } else {
            Action::Answer(title)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use rand::SeedableRng;

    use super::*;

    #[test]
    fn search_returns_wrapped_top_k_with_gold_paragraphs() {
        let mut env = HotpotQaEnv::new(HotpotQaConfig::default()).unwrap();
        env.reset(5).unwrap();
        let question = env.record().question.clone();
        let t = env.step(&Action::Search(question)).unwrap();
        assert!(t.observation.starts_with("\n\n<information>Doc 1(Title: "));
        assert!(t.observation.ends_with("</information>\n\n"));
        assert_eq!(t.observation.matches("Doc ").count(), 3);
        assert!(!t.terminated && t.reward == 0.0);
    }

    #[test]
    fn answers_are_scored_by_exact_match_with_f1_reported() {
        let mut env = HotpotQaEnv::new(HotpotQaConfig::default()).unwrap();
        env.reset(2).unwrap();
        let gold = env.record().answer.clone();
        let t = env.step(&Action::Answer(format!("The {gold}."))).unwrap();
        assert!(t.terminated && t.info.success && t.reward == 1.0);
        env.reset(2).unwrap();
        let t = env.step(&Action::Answer("zzz".into())).unwrap();
        assert_eq!(t.reward, 0.0);
        let kind = env.record().kind.clone();
        let template = env.template.expect("a generated record has a template");
        let expected: Vec<(String, f32)> = vec![
            ("em".into(), 0.0),
            ("f1".into(), 0.0),
            ("searches".into(), 0.0),
            (format!("em_{kind}"), 0.0),
            (format!("em_{template}"), 0.0),
            (format!("question_{kind}"), 1.0),
            (format!("question_{template}"), 1.0),
        ];
        assert_eq!(t.info.metrics, expected);
        env.reset(2).unwrap();
        let t = env.step(&Action::Search("zzz".into())).unwrap();
        let expected: Vec<(String, f32)> = vec![
            ("searches".into(), 1.0),
            ("em".into(), 0.0),
            ("f1".into(), 0.0),
            (format!("em_{kind}"), 0.0),
            (format!("em_{template}"), 0.0),
            (format!("question_{kind}"), 1.0),
            (format!("question_{template}"), 1.0),
        ];
        assert_eq!(t.info.metrics, expected, "an unanswered episode scores 0");
        let t = env.step(&Action::Answer(gold)).unwrap();
        let expected: Vec<(String, f32)> = vec![
            ("em".into(), 1.0),
            ("f1".into(), 1.0),
            ("searches".into(), 0.0),
            (format!("em_{kind}"), 1.0),
            (format!("em_{template}"), 1.0),
        ];
        assert_eq!(t.info.metrics, expected, "the groups are counted once");
    }

    #[test]
    fn metrics_count_each_generated_template_and_no_template_for_a_fixture() {
        let names: Vec<&str> = world::template_names().collect();
        assert!(!names.contains(&"bridge") && !names.contains(&"comparison"));
        // Templates alternate bridge and comparison, so a template's position gives its type.
        let kind_of = |template: &str| {
            let position = names.iter().position(|n| *n == template).unwrap();
            ["bridge", "comparison"][position % 2]
        };
        for episode_worlds in [false, true] {
            for templates in [vec![], vec!["director_employer".to_string()]] {
                let cfg = HotpotQaConfig {
                    episode_worlds,
                    world_size: 60,
                    templates: templates.clone(),
                    ..HotpotQaConfig::default()
                };
                let mut env = HotpotQaEnv::new(cfg).unwrap();
                let mut seen = BTreeSet::new();
                for seed in 0..24 {
                    env.reset(seed).unwrap();
                    let kind = env.record().kind.clone();
                    let t = env.step(&Action::Search("zzz".into())).unwrap();
                    let groups: Vec<&str> = t
                        .info
                        .metrics
                        .iter()
                        .filter_map(|(k, _)| k.strip_prefix("question_"))
                        .collect();
                    let [own_kind, template] = groups[..] else {
                        panic!("a type and a template: {groups:?}");
                    };
                    assert_eq!(own_kind, kind);
                    assert_eq!(kind_of(template), kind, "{template} is a {kind} question");
                    seen.insert(template.to_string());
                }
                match templates.as_slice() {
                    [] => assert!(seen.len() > 4, "draws vary the template: {seen:?}"),
                    only => assert_eq!(seen.into_iter().collect::<Vec<_>>(), only),
                }
            }
        }
        let fixture = HotpotQaConfig {
            world: WorldKind::Fixture,
            ..HotpotQaConfig::default()
        };
        let mut env = HotpotQaEnv::new(fixture).unwrap();
        env.reset(0).unwrap();
        let t = env.step(&Action::Search("zzz".into())).unwrap();
        let questions = t
            .info
            .metrics
            .iter()
            .filter(|(k, _)| k.starts_with("question_"));
        let count = questions.count();
        assert_eq!(count, 1, "a fixture record counts under its type alone");
    }

    #[test]
    fn an_f1_reward_pays_a_near_miss_and_success_stays_exact_match() {
        let cfg = HotpotQaConfig {
            reward: AnswerReward::F1,
            ..HotpotQaConfig::default()
        };
        let mut env = HotpotQaEnv::new(cfg).unwrap();
        let seed = (0..64)
            .find(|&s| {
                env.reset(s).unwrap();
                env.record().answer.split_whitespace().count() == 2
            })
            .expect("a two-word answer among 64 questions");
        env.reset(seed).unwrap();
        let gold = env.record().answer.clone();
        let first = gold.split_whitespace().next().unwrap().to_string();
        let t = env.step(&Action::Answer(format!("{first} Zzz"))).unwrap();
        assert_eq!(t.reward, 0.5, "one word of two, precision and recall 1/2");
        assert!(!t.info.success);
        assert_eq!(t.info.metrics[0], ("em".into(), 0.0));
        env.reset(seed).unwrap();
        let t = env.step(&Action::Answer(gold)).unwrap();
        assert!(t.info.success && t.reward == 1.0);
    }

    #[test]
    fn names_are_capitalized_runs() {
        let text = "The capital of Ulsol Ora is Kalo Mir. The Vorgal Harbor is a 1990 film \
                    directed by Melpim Beltha (born 1968), of Galvor Textiles.";
        assert_eq!(
            names_in(text),
            [
                "Ulsol Ora",
                "Kalo Mir",
                "The Vorgal Harbor",
                "Melpim Beltha",
                "Galvor Textiles"
            ]
        );
    }

    #[test]
    fn restate_question_ends_every_state_with_the_question() {
        let mut env = HotpotQaEnv::new(HotpotQaConfig {
            restate_question: true,
            ..HotpotQaConfig::default()
        })
        .unwrap();
        let mut plain = HotpotQaEnv::new(HotpotQaConfig::default()).unwrap();
        let restated = |question: &str| format!("\nQuestion: {question}");
        let state = env.reset(4).unwrap();
        let question = env.record().question.clone();
        assert_eq!(
            state,
            format!("No search results yet.{}", restated(&question))
        );
        plain.reset(4).unwrap();
        let search = env.oracle_action().unwrap();
        let t = env.step(&search).unwrap();
        let shown = plain.step(&search).unwrap().observation;
        assert_eq!(
            t.observation,
            format!("{}{}", shown.trim_end_matches('\n'), restated(&question))
        );
        assert_eq!(env.state_text(), t.observation);
    }

    #[test]
    fn choice_questions_offer_the_two_names_after_their_last_comma() {
        assert_eq!(
            offered_options("Who was born first, Rovsta Galnax or Melpim Ulvor?"),
            Some(["Rovsta Galnax".into(), "Melpim Ulvor".into()])
        );
        assert_eq!(
            offered_options(
                "Which magazine was started first, Arthur's Magazine or First for Women?"
            ),
            Some(["Arthur's Magazine".into(), "First for Women".into()])
        );
        for not_a_choice in [
            "In which city was the director of The Vorgal Harbor born?",
            "Who founded the company that employs Melpim Beltha?",
            "Were Kalo Mir and Ulsol Ora born in the same city?",
            "Which film came out first, The Vorgal Harbor or ?",
            "Which of these, cats or dogs",
        ] {
            assert_eq!(offered_options(not_a_choice), None, "{not_a_choice}");
        }
    }

    #[test]
    fn the_searcher_searches_like_the_oracle_and_guesses_an_offered_option_or_a_name_it_read() {
        let mut env = HotpotQaEnv::new(HotpotQaConfig::default()).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (mut hits, mut answers, mut choices) = (0, 0, 0);
        for seed in 0..200 {
            env.reset(seed).unwrap();
            loop {
                let oracle = env.oracle_action().unwrap();
                let action = env.searcher_action(&mut rng).unwrap();
                let Action::Answer(answer) = &action else {
                    assert_eq!(action, oracle);
                    env.step(&action).unwrap();
                    continue;
                };
                let question = env.record().question.clone();
                let read: String = env
                    .queries
                    .iter()
                    .flat_map(|q| env.corpus().passages(q, 3))
                    .map(|(t, text)| format!("{t} {text}"))
                    .collect();
                let yes_no = answer == "yes" || answer == "no";
                match offered_options(&question) {
                    Some(options) => {
                        assert!(options.contains(answer), "{question}: {answer}");
                        choices += 1;
                    }
                    None => assert!(
                        yes_no
                            || question.contains(answer.as_str())
                            || read.contains(answer.as_str())
                    ),
                }
                hits += usize::from(env.step(&action).unwrap().info.success);
                answers += 1;
                break;
            }
        }
        assert_eq!(answers, 200);
        assert!(choices > 0, "the generated world asks choice questions");
        // A guess, not the task: well above nothing (yes/no questions), far below the oracle.
        assert!((10..=80).contains(&hits), "{hits} of 200");
    }

    #[test]
    fn episode_worlds_are_new_per_seed_disjoint_across_splits_and_solvable() {
        let cfg = |split: &str| HotpotQaConfig {
            episode_worlds: true,
            world_size: 60,
            split: split.into(),
            ..HotpotQaConfig::default()
        };
        let mut titles = [BTreeSet::new(), BTreeSet::new()];
        for (side, split) in ["train", "val"].into_iter().enumerate() {
            let mut env = HotpotQaEnv::new(cfg(split)).unwrap();
            let mut again = HotpotQaEnv::new(cfg(split)).unwrap();
            let mut questions = BTreeSet::new();
            for seed in 0..60 {
                env.reset(seed).unwrap();
                again.reset(seed).unwrap();
                assert_eq!(env.record(), again.record(), "seed {seed}");
                questions.insert(env.record().question.clone());
                titles[side].extend(env.record().context.iter().map(|(t, _)| t.clone()));
                loop {
                    let t = env.step(&env.oracle_action().unwrap()).unwrap();
                    if t.terminated {
                        assert!(t.info.success, "{split} seed {seed}");
                        break;
                    }
                }
            }
            assert!(questions.len() >= 58, "a new question per episode");
        }
        let shared: Vec<_> = titles[0].intersection(&titles[1]).collect();
        assert!(shared.is_empty(), "{shared:?}");
        // The same name means different things in different episodes: no fact to remember.
        let people = |env: &mut HotpotQaEnv, seed| {
            env.reset(seed).unwrap();
            env.record().context.clone()
        };
        let mut env = HotpotQaEnv::new(cfg("train")).unwrap();
        assert_ne!(people(&mut env, 1), people(&mut env, 2));
        let err = HotpotQaEnv::new(HotpotQaConfig {
            world: WorldKind::Fixture,
            ..cfg("train")
        })
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("`episode_worlds`"), "{err}");
    }

    #[test]
    fn question_type_asks_only_questions_of_that_type() {
        let kinds = |cfg: HotpotQaConfig| {
            let mut env = HotpotQaEnv::new(cfg).unwrap();
            (0..48)
                .map(|seed| {
                    env.reset(seed).unwrap();
                    env.record().kind.clone()
                })
                .collect::<BTreeSet<_>>()
        };
        let per_episode = HotpotQaConfig {
            episode_worlds: true,
            world_size: 60,
            ..HotpotQaConfig::default()
        };
        let fixture = HotpotQaConfig {
            world: WorldKind::Fixture,
            split: "all".into(),
            ..HotpotQaConfig::default()
        };
        for base in [
            per_episode.clone(),
            HotpotQaConfig::default(),
            fixture.clone(),
        ] {
            assert_eq!(kinds(base.clone()).len(), 2, "{base:?} asks both types");
            for (only, kind) in [
                (QuestionType::Bridge, "bridge"),
                (QuestionType::Comparison, "comparison"),
            ] {
                let cfg = HotpotQaConfig {
                    question_type: only,
                    ..base.clone()
                };
                assert_eq!(kinds(cfg), BTreeSet::from([kind.to_string()]));
            }
        }
        // `all` picks exactly the episodes it picked before the key existed.
        let mut env = HotpotQaEnv::new(per_episode).unwrap();
        env.reset(7).unwrap();
        let record = env.record().clone();
        let records = World::generate_in(
            0,
            crate::seed::derive(0, &[EPISODE_WORLD_STREAM, 7]),
            Split::Train,
            60,
        )
        .unwrap()
        .records(world::TEMPLATE_COUNT, 6)
        .unwrap();
        let pick = crate::seed::derive(7, &[1]) % records.len() as u64;
        assert_eq!(record, records[pick as usize]);
        // A file without a question of the type is refused by name.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bridge_only.json");
        let bridges: Vec<HotpotRecord> = data::parse_records(data::EMBEDDED_FIXTURE, "fixture")
            .unwrap()
            .into_iter()
            .filter(|r| r.kind == "bridge")
            .collect();
        std::fs::write(&path, data::to_json(&bridges)).unwrap();
        let err = HotpotQaEnv::new(HotpotQaConfig {
            data_file: Some(path.display().to_string()),
            question_type: QuestionType::Comparison,
            ..fixture
        })
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("question_type") && err.contains("type `comparison`"),
            "{err}"
        );
    }

    #[test]
    fn templates_ask_only_the_named_generated_questions() {
        let openings = |cfg: HotpotQaConfig| {
            let mut env = HotpotQaEnv::new(cfg).unwrap();
            (0..48)
                .map(|seed| {
                    env.reset(seed).unwrap();
                    let question = &env.record().question;
                    question.split(' ').take(3).collect::<Vec<_>>().join(" ")
                })
                .collect::<BTreeSet<_>>()
        };
        let two = vec!["founder_birth_city".to_string(), "same_country".to_string()];
        for base in [
            HotpotQaConfig {
                episode_worlds: true,
                world_size: 60,
                ..HotpotQaConfig::default()
            },
            HotpotQaConfig::default(),
        ] {
            let asked = openings(HotpotQaConfig {
                templates: two.clone(),
                ..base.clone()
            });
            // "In which city was the founder of …", "Are A and B in the same country?".
            assert!(
                asked
                    .iter()
                    .all(|o| o == "In which city" || o.starts_with("Are ")),
                "{base:?}: {asked:?}"
            );
            assert!(asked.contains("In which city") && asked.iter().any(|o| o.starts_with("Are ")));
            // With a question type, the templates of that type among those named.
            let bridge_only = openings(HotpotQaConfig {
                templates: two.clone(),
                question_type: QuestionType::Bridge,
                ..base
            });
            assert_eq!(bridge_only, BTreeSet::from(["In which city".to_string()]));
        }
        let err = |cfg: HotpotQaConfig| HotpotQaEnv::new(cfg).err().unwrap().to_string();
        let unknown = err(HotpotQaConfig {
            templates: vec!["founder_shoe_size".into()],
            ..HotpotQaConfig::default()
        });
        assert!(
            unknown.contains("templates") && unknown.contains("`founder_shoe_size`"),
            "{unknown}"
        );
        let fixture = err(HotpotQaConfig {
            world: WorldKind::Fixture,
            split: "all".into(),
            templates: two,
            ..HotpotQaConfig::default()
        });
        assert!(
            fixture.contains("templates") && fixture.contains("generated"),
            "{fixture}"
        );
    }

    #[test]
    fn the_critic_state_reads_the_searches_against_the_gold() {
        let mut env = HotpotQaEnv::new(HotpotQaConfig {
            episode_worlds: true,
            world_size: 60,
            ..HotpotQaConfig::default()
        })
        .unwrap();
        let state = |env: &HotpotQaEnv| env.critic_state().expect("hotpotqa has one");
        for seed in 0..24 {
            env.reset(seed).unwrap();
            let comparison = flag(env.record().kind == "comparison");
            let at_start = state(&env);
            assert_eq!(at_start.len(), 9);
            assert_eq!(
                &at_start[..4],
                &[0.0; 4],
                "seed {seed}: nothing searched yet"
            );
            assert_eq!(
                (at_start[6], at_start[7], at_start[8]),
                (comparison, 0.0, 0.0)
            );
            // A search for nothing in the world finds no gold.
            env.step(&Action::Search("qqqq zzzz".into())).unwrap();
            let missed = state(&env);
            assert_eq!(
                (missed[0], missed[7]),
                (0.0, 0.25),
                "seed {seed}: {missed:?}"
            );
            let mut share = 0.0;
            while let Action::Search(query) = env.oracle_action().unwrap() {
                env.step(&Action::Search(query)).unwrap();
                let now = state(&env);
                assert!(now.iter().all(|x| (0.0..=1.0).contains(x)), "{now:?}");
                assert!(now[0] >= share, "seed {seed}: the gold shown only grows");
                share = now[0];
            }
            let searched = state(&env);
            // The oracle's searches show both gold paragraphs; a bridge question's answer is in
            // them, a comparison's is one of the two names the question offers or yes/no.
            assert_eq!(&searched[..3], &[1.0, 1.0, 1.0], "seed {seed}");
            if comparison == 0.0 {
                assert_eq!(searched[3], 1.0, "seed {seed}: {}", env.record().question);
            }
            let answer = env.oracle_action().unwrap();
            env.step(&answer).unwrap();
            assert_eq!(state(&env)[8], 1.0);
        }
    }

    #[test]
    fn retrieval_bonus_pays_each_gold_paragraph_once_and_is_logged_apart() {
        let cfg = HotpotQaConfig {
            episode_worlds: true,
            world_size: 60,
            retrieval_bonus: 0.2,
            ..HotpotQaConfig::default()
        };
        let mut env = HotpotQaEnv::new(cfg.clone()).unwrap();
        for seed in 0..24 {
            env.reset(seed).unwrap();
            let mut paid = 0.0;
            let mut logged = 0.0;
            let mut answer_reward = 0.0;
            loop {
                let action = env.oracle_action().unwrap();
                // Every search twice: the repeat shows nothing new and earns nothing.
                let repeats = if matches!(action, Action::Search(_)) {
                    2
                } else {
                    1
                };
                let mut last = None;
                for _ in 0..repeats {
                    let t = env.step(&action).unwrap();
                    let bonus = metric_of(&t.info, "retrieval_bonus");
                    logged += bonus;
                    match action {
                        Action::Answer(_) => answer_reward = t.reward,
                        _ => paid += t.reward,
                    }
                    assert_eq!(metric_of(&t.info, "em") > 0.0, t.info.success);
                    last = Some(t);
                }
                if last.unwrap().terminated {
                    break;
                }
            }
            assert!(
                (paid - 0.4).abs() < 1e-6,
                "seed {seed}: both gold paragraphs, once: {paid}"
            );
            assert_eq!(paid, logged);
            assert_eq!(answer_reward, 1.0, "the answer is paid EM alone");
        }
        // No bonus: no metric, searches paid 0.
        let mut plain = HotpotQaEnv::new(HotpotQaConfig {
            retrieval_bonus: 0.0,
            ..cfg.clone()
        })
        .unwrap();
        plain.reset(3).unwrap();
        let t = plain.step(&plain.oracle_action().unwrap()).unwrap();
        assert_eq!(t.reward, 0.0);
        assert!(t.info.metrics.iter().all(|(k, _)| k != "retrieval_bonus"));
        for bad in [0.5, -0.1] {
            let err = HotpotQaEnv::new(HotpotQaConfig {
                retrieval_bonus: bad,
                ..cfg.clone()
            })
            .err()
            .unwrap()
            .to_string();
            assert!(
                err.contains("retrieval_bonus") && err.contains("[0, 0.5)"),
                "{err}"
            );
        }
    }

    fn metric_of(info: &EnvInfo, key: &str) -> f32 {
        info.metrics
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v)
            .sum()
    }

    #[test]
    fn fixture_splits_partition_the_records() {
        let cfg = |split: &str| HotpotQaConfig {
            world: WorldKind::Fixture,
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

    #[test]
    fn generated_worlds_are_train_or_val_and_bad_settings_are_named() {
        let cfg = HotpotQaConfig::default();
        let env = HotpotQaEnv::new(cfg.clone()).unwrap();
        assert_eq!(env.split_len(), cfg.world_questions);
        let bad = |cfg: HotpotQaConfig| HotpotQaEnv::new(cfg).err().unwrap().to_string();
        let err = bad(HotpotQaConfig {
            split: "all".into(),
            ..cfg.clone()
        });
        assert!(err.contains("`split`") && err.contains("fixture"), "{err}");
        let err = bad(HotpotQaConfig {
            world_size: 7,
            ..cfg.clone()
        });
        assert!(err.contains("`world_size`") && err.contains('7'), "{err}");
        let err = bad(HotpotQaConfig {
            world_questions: 0,
            ..cfg
        });
        assert!(err.contains("`world_questions`"), "{err}");
    }

    /// Normalized titles and answers (yes/no aside) of an env's split.
    fn names(env: &HotpotQaEnv) -> BTreeSet<String> {
        env.split_records()
            .flat_map(|r| r.context.iter().map(|(t, _)| t).chain([&r.answer]))
            .map(|s| metric::normalize_answer(s))
            .filter(|s| s != "yes" && s != "no")
            .collect()
    }

    #[test]
    fn the_train_and_val_envs_share_no_title_or_answer() {
        for corpus in [CorpusKind::Distractor, CorpusKind::World] {
            let cfg = |split: &str| HotpotQaConfig {
                split: split.into(),
                corpus,
                world_seed: 11,
                ..HotpotQaConfig::default()
            };
            let train = names(&HotpotQaEnv::new(cfg("train")).unwrap());
            let val = names(&HotpotQaEnv::new(cfg("val")).unwrap());
            assert!(train.len() > 300 && val.len() > 300);
            assert_eq!(train.intersection(&val).count(), 0);
        }
        let fixture = |split: &str| HotpotQaConfig {
            world: WorldKind::Fixture,
            split: split.into(),
            ..HotpotQaConfig::default()
        };
        let train = names(&HotpotQaEnv::new(fixture("train")).unwrap());
        let val = names(&HotpotQaEnv::new(fixture("val")).unwrap());
        assert!(
            train.intersection(&val).count() > 0,
            "the fixture's splits share its one knowledge base"
        );
    }

    #[test]
    fn envs_of_one_setting_share_their_data() {
        let cfg = HotpotQaConfig {
            world_seed: 77,
            corpus: CorpusKind::World,
            ..HotpotQaConfig::default()
        };
        let a = HotpotQaEnv::new(cfg.clone()).unwrap();
        let b = HotpotQaEnv::new(HotpotQaConfig {
            topk: 1,
            ..cfg.clone()
        })
        .unwrap();
        assert!(
            Arc::ptr_eq(&a.data, &b.data),
            "topk does not change the data"
        );
        let c = HotpotQaEnv::new(HotpotQaConfig {
            split: "val".into(),
            ..cfg
        })
        .unwrap();
        assert!(!Arc::ptr_eq(&a.data, &c.data));
    }

    #[test]
    fn the_world_corpus_reaches_beyond_the_record_context() {
        let cfg = HotpotQaConfig {
            corpus: CorpusKind::World,
            topk: 5,
            ..HotpotQaConfig::default()
        };
        let mut env = HotpotQaEnv::new(cfg.clone()).unwrap();
        assert_eq!(env.corpus().len(), cfg.world_size);
        let mut own = HotpotQaEnv::new(HotpotQaConfig {
            corpus: CorpusKind::Distractor,
            ..cfg
        })
        .unwrap();
        let outside = (0..20).any(|seed| {
            env.reset(seed).unwrap();
            own.reset(seed).unwrap();
            assert_eq!(own.corpus().len(), 2 + own.cfg.distractors);
            let context: Vec<&String> = env.record().context.iter().map(|(t, _)| t).collect();
            let query = env.record().question.clone();
            assert!(own
                .search_titles(&query)
                .iter()
                .all(|t| context.iter().any(|c| c == t)));
            env.search_titles(&query)
                .iter()
                .any(|t| !context.iter().any(|c| c == t))
        });
        assert!(
            outside,
            "a world search returns paragraphs of other records"
        );
    }

    #[test]
    fn the_oracle_searches_each_supporting_title_then_answers() {
        let mut env = HotpotQaEnv::new(HotpotQaConfig::default()).unwrap();
        env.reset(9).unwrap();
        let facts = env.record().supporting_facts.clone();
        for (title, _) in &facts {
            let action = env.oracle_action().unwrap();
            assert_eq!(action, Action::Search(title.clone()));
            assert_eq!(env.search_titles(title)[0], title);
            env.step(&action).unwrap();
        }
        assert_eq!(
            env.oracle_action().unwrap(),
            Action::Answer(env.record().answer.clone())
        );
    }
}
