//! The environments and the agent text protocol.
//!
//! This module owns the [`Env`] trait (reset by seed, step by a parsed [`Action`], text
//! observations), the registry that builds an env plus its [`ProtocolConfig`] from a JSON config
//! (defaults merged with overrides, unknown keys rejected by name), the four in-process envs
//! (`frozen_lake`, `sokoban`, `bandit`, `hotpotqa`), the `remote` env that plays an env served by
//! another process over HTTP (`docs/guides/env-bridge.md`), the agent text protocol
//! ([`AgentSession`]: prompts, parsing of model text, format penalty) and the model-free agents
//! ([`Agent`]).
//! It does not tokenize, generate or store anything: rollout and store consume its text.
//!
//! Every in-process env owns its RNG, seeded only from the `reset` seed through [`crate::seed`],
//! so two envs built from the same config and reset with the same seed produce identical episodes
//! on any thread. `reset` and `step` are fallible: the in-process envs never fail, a remote one
//! fails when its server times out, disconnects or answers nonsense, and the error names the
//! server and the request. What a rollout then does is the env config's [`OnError`].

mod agents;
mod bandit;
mod frozen_lake;
pub mod hotpotqa;
mod protocol;
mod remote;
pub mod sokoban;
pub mod tools;

use serde::{de::DeserializeOwned, Serialize};
use serde_json::{Map, Value};

pub use agents::{play_episode, response_text, Agent, AgentKind, Episode, TurnLog};
pub use bandit::{BanditConfig, BanditEnv};
pub use frozen_lake::{FrozenLakeConfig, FrozenLakeEnv};
pub use hotpotqa::{HotpotQaConfig, HotpotQaEnv};
pub use protocol::{AgentSession, ProtocolConfig, StepInfo, TurnOutcome};
pub use remote::{RemoteConfig, RemoteEnv};
pub use sokoban::{SokobanConfig, SokobanEnv};

/// One parsed agent action.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// A grid move or bandit arm, in the env's canonical spelling.
    Move(String),
    /// A search query (QA envs).
    Search(String),
    /// A final answer (QA envs).
    Answer(String),
}

/// Per-step facts reported by an env.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EnvInfo {
    /// The episode is solved.
    pub success: bool,
    /// The env accepted the action.
    pub action_is_valid: bool,
    /// The action changed the env state (e.g. the player moved).
    pub action_is_effective: bool,
    /// Env-specific metrics (e.g. `f1` for QA), in a fixed order.
    pub metrics: Vec<(String, f32)>,
}

/// Result of one env step.
#[derive(Clone, Debug, PartialEq)]
pub struct Transition {
    /// Raw observation after the step (for QA: the `<information>` block or the verdict).
    pub observation: String,
    /// Reward earned by this step.
    pub reward: f32,
    /// The episode reached a terminal state.
    pub terminated: bool,
    /// The episode was cut by the env's step limit.
    pub truncated: bool,
    /// Per-step facts: success, validity, effect and env-specific metrics.
    pub info: EnvInfo,
}

/// What an agent may say to an env.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ActionSpace {
    /// `<answer>name</answer>` with one of these names (matched case-insensitively).
    Named(Vec<String>),
    /// `<search>query</search>` or `<answer>text</answer>`.
    SearchOrAnswer,
    /// `<answer>text</answer>` with any non-empty text (a remote env that lists no actions).
    FreeText,
}

/// What a rollout does when an env fails (a remote env's server timed out, disconnected or
/// answered nonsense): the `on_error` key of an env config that can fail.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// End the rollout (and the run) with the error; the steps already stored stay, and the
    /// dataset verifies.
    #[default]
    Fail,
    /// Drop the failed episode's whole group from the batch, count it in `rollout/env_errors`
    /// and go on.
    Skip,
}

/// What a config says about an env without building it: its action space when that is known
/// offline (`None` for a remote env: its server lists the actions) and its [`OnError`].
#[derive(Clone, Debug, PartialEq)]
pub struct EnvCheck {
    /// The action space; `None` for a remote env, whose server lists the actions.
    pub action_space: Option<ActionSpace>,
    /// What a rollout does when this env fails.
    pub on_error: OnError,
    /// The protocol's tool mode (`tools: true`).
    pub tools: bool,
    /// Episodes a rollout steps at once (a remote env's `concurrency`; 1 for the built-in envs,
    /// whose steps take microseconds).
    pub concurrency: usize,
}

/// A text environment. See the module doc for the determinism and failure contracts.
pub trait Env: Send {
    /// Registry name, e.g. `frozen_lake`.
    fn tag(&self) -> &str;
    /// Starts a new episode determined only by the config and `seed`; returns the raw state text.
    fn reset(&mut self, seed: u64) -> Result<String, EnvError>;
    /// Applies one action. Actions outside the action space are reported as invalid, never panic;
    /// an error means the env could not answer (a remote server failed), never a bad action.
    fn step(&mut self, action: &Action) -> Result<Transition, EnvError>;
    /// Task instruction for the first user message (symbols, actions, goal).
    fn instruction(&self) -> String;
    /// The task in words for the protocol's tool mode, where the functions are offered apart:
    /// the instruction without the text protocol's tag conventions (by default the instruction).
    fn tool_instruction(&self) -> String {
        self.instruction()
    }
    /// Raw current observation (the GiGPO anchor).
    fn state_text(&self) -> String;
    /// The actions this env understands.
    fn action_space(&self) -> ActionSpace;
    /// Env actions allowed per episode (`usize::MAX` when only the turn limit applies).
    fn max_steps(&self) -> usize;
    /// Best next action from the current state (what the oracle agent plays); an error when the
    /// env has none (a remote env whose server offers no `oracle_action`).
    fn oracle_action(&self) -> Result<Action, EnvError>;
    /// A uniformly random action (what the random agent plays); an error when the env cannot
    /// draw one (a remote env that lists no actions and offers no admissible ones).
    fn random_action(&self, rng: &mut rand_chacha::ChaCha8Rng) -> Result<Action, EnvError>;
    /// Numeric facts about the whole state, for a critic that may see more than the agent (an
    /// asymmetric critic, `critic.mode: state`): planning facts of the map that the render does
    /// not state (a one-hot of every cell does not carry over to freshly drawn maps), or what a
    /// search episode has found set against its gold. The same width for every state of one env
    /// config; `None` when the env has none (the bandit, remote envs).
    fn critic_state(&self) -> Option<Vec<f32>> {
        None
    }
    /// The actions the current state admits, where the env says so (a remote env whose last
    /// answer offered `admissible_actions`): what constrained decoding samples among, one per
    /// turn. `None` where it does not.
    fn admissible_actions(&self) -> Option<&[String]> {
        None
    }
    /// What the searcher agent plays: the oracle's searches, then an answer guessed without
    /// knowing it (the question's own options, or a name the searches returned). Only search
    /// envs have one.
    fn searcher_action(&self, _rng: &mut rand_chacha::ChaCha8Rng) -> Result<Action, EnvError> {
        Err(EnvError::NoAgent {
            env: self.tag().to_string(),
            agent: "searcher",
            reason: "only search envs (hotpotqa) have one".into(),
        })
    }
}

/// Errors of env construction and data loading.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// No registered env has this name.
    #[error("unknown environment `{0}` (known: {known})", known = registry().join(", "))]
    UnknownEnv(String),
    /// The env's config is neither a JSON object nor null.
    #[error("env `{env}`: the config must be a JSON object, got `{got}`")]
    NotAnObject {
        /// The env's name.
        env: String,
        /// The config as given, as JSON text.
        got: String,
    },
    /// A config key the env does not accept.
    #[error("env `{env}`: unknown config key `{key}` (known: {known})")]
    UnknownKey {
        /// The env's name.
        env: String,
        /// The offending key.
        key: String,
        /// Every key the env accepts (its own and the protocol's), comma-separated.
        known: String,
    },
    /// A config value of the wrong type or out of range.
    #[error("env `{env}`: bad value for key `{key}`: {reason}")]
    BadValue {
        /// The env's name.
        env: String,
        /// The offending key.
        key: String,
        /// What is wrong with the value.
        reason: String,
    },
    /// A HotpotQA data source that is neither a JSON list nor JSON Lines.
    #[error("hotpotqa data `{source_name}`: {reason}")]
    BadData {
        /// The file (or other source) the records came from.
        source_name: String,
        /// Why it could not be parsed (with the line, for JSON Lines).
        reason: String,
    },
    /// A HotpotQA record that parsed as JSON but is not a valid record.
    #[error("hotpotqa data `{source_name}`, record {index}: {reason}")]
    MalformedRecord {
        /// The file (or other source) the records came from.
        source_name: String,
        /// 0-based position of the record in the source.
        index: usize,
        /// What is wrong with the record.
        reason: String,
    },
    /// A file could not be read.
    #[error("reading `{path}`: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A remote env's request failed: `request` is the method, path and JSON body sent.
    #[error("remote env {url}: {request}: {reason}")]
    Remote {
        /// The server's URL, followed by the env's name once the server has described itself.
        url: String,
        /// The method, path and JSON body sent.
        request: String,
        /// Why the request failed (transport error, status or unreadable answer).
        reason: String,
    },
    /// Constrained decoding over a free-text env whose state offered no admissible actions.
    #[error("env `{env}` answers free text and its state offered no `admissible_actions` to choose among (constrained_decoding: true); serve the actions each state admits, or set constrained_decoding: false")]
    NoAdmissibleActions {
        /// The env's tag.
        env: String,
    },
    /// The env cannot play the moves of the named scripted agent.
    #[error("env `{env}` has no {agent} agent: {reason}")]
    NoAgent {
        /// The env's tag.
        env: String,
        /// The agent asked for, e.g. `searcher`.
        agent: &'static str,
        /// Why the env has none.
        reason: String,
    },
}

/// Names of the registered environments: the in-process ones, then `remote`.
pub fn registry() -> &'static [&'static str] {
    &["frozen_lake", "sokoban", "bandit", "hotpotqa", "remote"]
}

/// The JSON Schema of `custom_envs.<tag>.env_type`: the [`registry`] names, each described.
pub(crate) fn env_type_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let described: Vec<Value> = registry()
        .iter()
        .map(|&name| {
            let description = match name {
                "frozen_lake" => {
                    "FrozenLake: a random square map of ice and holes with a start→goal path, \
                     gymnasium dynamics (optionally slippery) and RAGEN's text render; reward 1 \
                     on the goal."
                }
                "sokoban" => {
                    "Sokoban: rooms generated by reverse play, gym-sokoban dynamics and rewards \
                     (−0.1 per step, +1 box onto a target, −1 box off a target, +10 when all \
                     boxes are placed) and RAGEN's text render."
                }
                "bandit" => {
                    "RAGEN's two-armed, single-turn bandit with named arms: a low-risk arm of \
                     fixed payout and a high-risk arm; success means pulling the high-risk arm \
                     (the higher mean)."
                }
                "hotpotqa" => {
                    "HotpotQA-style multi-hop search QA: `<search>query</search>` returns the \
                     BM25 top-k passages, `<answer>…</answer>` ends the episode."
                }
                "remote" => {
                    "An env served by another process over the HTTP/JSON env bridge \
                     (`docs/env-bridge.md`)."
                }
                _ => "",
            };
            serde_json::json!({ "const": name, "description": description })
        })
        .collect();
    schemars::json_schema!({ "type": "string", "oneOf": described })
}

/// The registered envs that run in this process: all but `remote`, which needs its server.
pub fn in_process() -> &'static [&'static str] {
    &registry()[..4]
}

/// Builds an env and its protocol from `config`: an object whose keys are env keys or protocol
/// keys (`max_turns`, `max_actions_per_turn`, `enable_think`, `format_penalty`); `null` means
/// all defaults.
pub fn build_env(
    env_name: &str,
    config: &Value,
) -> Result<(Box<dyn Env>, ProtocolConfig), EnvError> {
    let (protocol_overrides, env_overrides) = split_config(env_name, config)?;
    let mut protocol = protocol_config(env_name, &protocol_overrides)?;
    let env: Box<dyn Env> = match env_name {
        "frozen_lake" => Box::new(FrozenLakeEnv::new(merge_config(
            env_name,
            FrozenLakeConfig::default(),
            &env_overrides,
        )?)?),
        "sokoban" => Box::new(SokobanEnv::new(merge_config(
            env_name,
            SokobanConfig::default(),
            &env_overrides,
        )?)?),
        "bandit" => Box::new(BanditEnv::new(merge_config(
            env_name,
            BanditConfig::default(),
            &env_overrides,
        )?)?),
        "hotpotqa" => Box::new(HotpotQaEnv::new(merge_config(
            env_name,
            HotpotQaConfig::default(),
            &env_overrides,
        )?)?),
        "remote" => Box::new(RemoteEnv::connect(remote_config(&env_overrides)?)?),
        other => return Err(EnvError::UnknownEnv(other.to_string())),
    };
    if env_name == "sokoban" {
        let turns_given = protocol_overrides.contains_key("max_turns");
        fit_turns_to_action_cap(env_name, env.max_steps(), &mut protocol, turns_given)?;
    }
    Ok((env, protocol))
}

/// Words the env writes that the built-in tokenizer gives whole-word tokens in a run that plays
/// it ([`crate::tokenizer::Tokenizer::builtin_with_words`]): a generated QA world's vocabulary
/// (its names, template words and the instruction's words), and in tool mode the pieces of the
/// built-in template's tool text for the env's functions ([`tool_words`]); none otherwise.
pub fn builtin_words(env_name: &str, config: &Value) -> Result<Vec<String>, EnvError> {
    let (protocol_overrides, env_overrides) = split_config(env_name, config)?;
    let mut words = if env_name == "hotpotqa" {
        let cfg: HotpotQaConfig =
            merge_config(env_name, HotpotQaConfig::default(), &env_overrides)?;
        cfg.builtin_words()
    } else {
        Vec::new()
    };
    if protocol_config(env_name, &protocol_overrides)?.tools {
        words.extend(tool_words(env_name, config)?);
    }
    Ok(words)
}

/// The pieces of the built-in template's tool text ([`crate::tokenizer::tool_calls::builtin_tool_text`])
/// for the functions of the env `config` builds: its markup, JSON punctuation, function,
/// parameter and action names. A remote env's functions are known only from its server, so
/// they are taken as the free-text env's `answer(answer)`: its own names stay spelled in bytes.
fn tool_words(env_name: &str, config: &Value) -> Result<Vec<String>, EnvError> {
    let space = if env_name == "remote" {
        ActionSpace::FreeText
    } else {
        build_env(env_name, config)?.0.action_space()
    };
    let text = crate::tokenizer::tool_calls::builtin_tool_text(&tools::tool_schemas(&space));
    Ok(crate::tokenizer::builtin_pieces_of(&text))
}

/// For an env whose episodes are generated to be solvable within its action cap (Sokoban: a
/// room is accepted only when its optimum fits `max_steps`), the turns must leave room for that
/// many actions. Unset, `max_turns` follows the cap; set too low, it is an error naming both
/// keys (otherwise the longer rooms fail for lack of turns, with no sign of why).
fn fit_turns_to_action_cap(
    env_name: &str,
    action_cap: usize,
    protocol: &mut ProtocolConfig,
    turns_given: bool,
) -> Result<(), EnvError> {
    let per_turn = protocol.max_actions_per_turn;
    let needed = action_cap.div_ceil(per_turn);
    if !turns_given {
        protocol.max_turns = needed;
        return Ok(());
    }
    if protocol.max_turns < needed {
        return Err(bad_value(
            env_name,
            "max_turns",
            format!(
                "{} turns × {per_turn} actions per turn cannot reach `max_steps` {action_cap}: \
                 episodes are generated to need up to `max_steps` moves; set max_turns to at \
                 least {needed} (or leave it unset to follow max_steps)",
                protocol.max_turns
            ),
        ));
    }
    Ok(())
}

/// Checks `config` for `env_name` without contacting any server: a remote env's keys are only
/// parsed and validated, an in-process env is built. Config validation and the rollout's error
/// policy use this, so a config is valid whether or not its server is up yet.
pub fn check_config(env_name: &str, config: &Value) -> Result<EnvCheck, EnvError> {
    if env_name != "remote" {
        let (env, protocol) = build_env(env_name, config)?;
        return Ok(EnvCheck {
            action_space: Some(env.action_space()),
            on_error: OnError::Fail,
            tools: protocol.tools,
            concurrency: 1,
        });
    }
    let (protocol_overrides, env_overrides) = split_config(env_name, config)?;
    let remote = remote_config(&env_overrides)?;
    let protocol = protocol_config(env_name, &protocol_overrides)?;
    Ok(EnvCheck {
        action_space: None,
        on_error: remote.on_error,
        tools: protocol.tools,
        concurrency: remote.concurrency,
    })
}

/// Keys and values of an env config.
type ConfigMap = Map<String, Value>;

/// Splits an env config into its protocol keys and the env's own keys.
fn split_config(env_name: &str, config: &Value) -> Result<(ConfigMap, ConfigMap), EnvError> {
    Ok(config_object(env_name, config)?
        .into_iter()
        .partition(|(k, _)| ProtocolConfig::KEYS.contains(&k.as_str())))
}

/// The protocol keys merged over the env's protocol defaults and validated.
fn protocol_config(
    env_name: &str,
    overrides: &Map<String, Value>,
) -> Result<ProtocolConfig, EnvError> {
    let protocol = merge_config(env_name, ProtocolConfig::default_for(env_name), overrides)?;
    protocol.validate(env_name)?;
    Ok(protocol)
}

/// The remote env's own keys merged over its defaults and validated (no server contacted).
fn remote_config(overrides: &Map<String, Value>) -> Result<RemoteConfig, EnvError> {
    let cfg = merge_config("remote", RemoteConfig::default(), overrides)?;
    cfg.validate()?;
    Ok(cfg)
}

/// Builds the agent session (env + text protocol) for `env_name` from `config`.
pub fn build_session(env_name: &str, config: &Value) -> Result<AgentSession, EnvError> {
    let (env, protocol) = build_env(env_name, config)?;
    Ok(AgentSession::new(env, protocol))
}

/// Stable 64-bit FNV-1a hash of bytes (not std's randomized hasher): identical across runs.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A yes/no fact of an env's [`Env::critic_state`]: 1 for true, 0 for false.
pub(crate) fn flag(b: bool) -> f32 {
    f32::from(u8::from(b))
}

/// A fresh RNG owned by one env, determined by `seed` and a purpose tag.
pub(crate) fn env_rng(seed: u64, purpose: u64) -> rand_chacha::ChaCha8Rng {
    use rand::SeedableRng;
    rand_chacha::ChaCha8Rng::seed_from_u64(crate::seed::derive(seed, &[purpose]))
}

/// All keys an env accepts (its own and the protocol's), for error messages.
fn known_keys(env_keys: &Map<String, Value>) -> String {
    let mut keys: Vec<&str> = env_keys.keys().map(String::as_str).collect();
    keys.extend(ProtocolConfig::KEYS);
    keys.join(", ")
}

fn config_object(env_name: &str, config: &Value) -> Result<Map<String, Value>, EnvError> {
    match config {
        Value::Null => Ok(Map::new()),
        Value::Object(map) => Ok(map.clone()),
        other => Err(EnvError::NotAnObject {
            env: env_name.to_string(),
            got: other.to_string(),
        }),
    }
}

/// Merges `overrides` over the serialized `defaults`; each override is type-checked on its own
/// so that an error names the offending key.
fn merge_config<T: Serialize + DeserializeOwned>(
    env_name: &str,
    defaults: T,
    overrides: &Map<String, Value>,
) -> Result<T, EnvError> {
    let base = match serde_json::to_value(&defaults) {
        Ok(Value::Object(map)) => map,
        _ => unreachable!("env configs serialize to JSON objects"),
    };
    let bad_value = |key: &str, reason: String| EnvError::BadValue {
        env: env_name.to_string(),
        key: key.to_string(),
        reason,
    };
    for (key, value) in overrides {
        if !base.contains_key(key) {
            return Err(EnvError::UnknownKey {
                env: env_name.to_string(),
                key: key.clone(),
                known: known_keys(&base),
            });
        }
        let mut trial = base.clone();
        trial.insert(key.clone(), value.clone());
        serde_json::from_value::<T>(Value::Object(trial))
            .map_err(|e| bad_value(key, e.to_string()))?;
    }
    let mut merged = base;
    merged.extend(overrides.clone());
    serde_json::from_value(Value::Object(merged))
        .map_err(|e| bad_value("(combined)", e.to_string()))
}

/// Shorthand for a [`EnvError::BadValue`] raised by an env's semantic validation.
pub(crate) fn bad_value(env: &str, key: &str, reason: impl Into<String>) -> EnvError {
    EnvError::BadValue {
        env: env.to_string(),
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// Test check of a readable render: each action word is one built-in token, and every time the
/// word appears in `text` (move lines, offset lines) it is encoded as that very token, the one the
/// answer writes.
#[cfg(test)]
pub(crate) fn assert_action_words_are_answer_tokens(text: &str, actions: &[&str]) {
    let tok = crate::tokenizer::Tokenizer::builtin();
    let observed = tok.encode(text);
    for action in actions {
        let answer = tok.encode(action);
        assert_eq!(answer.len(), 1, "{action} is one token");
        let written = text
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| w.eq_ignore_ascii_case(action))
            .count();
        let as_answer = observed.iter().filter(|&&id| id == answer[0]).count();
        assert_eq!(as_answer, written, "{action} in {text:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn registry_builds_every_in_process_env_with_defaults() {
        for name in in_process() {
            let session = build_session(name, &Value::Null).unwrap();
            assert_eq!(session.env().tag(), *name);
        }
    }

    #[test]
    fn unknown_env_and_key_are_named() {
        let err = build_session("chess", &Value::Null)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("chess"), "{err}");
        let err = build_session("frozen_lake", &json!({"sizee": 5}))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("sizee") && err.contains("frozen_lake"),
            "{err}"
        );
        let err = build_session("sokoban", &json!({"num_boxes": "two"}))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("num_boxes"), "{err}");
        let err = build_session("bandit", &json!([1]))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("JSON object"), "{err}");
    }

    #[test]
    fn remote_configs_are_checked_without_a_server() {
        let check = check_config(
            "remote",
            &json!({"url": "http://127.0.0.1:1", "on_error": "skip"}),
        );
        assert_eq!(
            check.unwrap(),
            EnvCheck {
                action_space: None,
                on_error: OnError::Skip,
                tools: false,
                concurrency: 16,
            }
        );
        let err = |config: Value| check_config("remote", &config).unwrap_err().to_string();
        let e = err(json!({"max_turns": 3}));
        assert!(e.contains("url") && e.contains("required"), "{e}");
        let e = err(json!({"url": "http://h", "on_error": "retry"}));
        assert!(e.contains("on_error") && e.contains("remote"), "{e}");
        let e = err(json!({"url": "http://h", "adress": "x"}));
        assert!(e.contains("adress") && e.contains("timeout"), "{e}");
        let e = err(json!({"url": "http://h", "max_turns": 0}));
        assert!(e.contains("max_turns"), "{e}");
        let local = check_config("bandit", &Value::Null).unwrap();
        assert!(matches!(local.action_space, Some(ActionSpace::Named(_))));
    }

    #[test]
    fn overrides_reach_env_and_protocol() {
        let session = build_session(
            "frozen_lake",
            &json!({"size": 6, "max_turns": 3, "enable_think": true}),
        )
        .unwrap();
        assert_eq!(session.protocol().max_turns, 3);
        assert!(session.protocol().enable_think);
        let mut session = session;
        let first = session.reset(1).unwrap();
        assert!(first.contains("______") || first.lines().any(|l| l.chars().count() == 6));
    }

    #[test]
    fn sokoban_turns_follow_its_action_cap_and_may_not_undercut_it() {
        let session = build_session("sokoban", &json!({"max_steps": 24})).unwrap();
        assert_eq!(session.protocol().max_turns, 24);
        let two_per_turn = json!({"max_steps": 24, "max_actions_per_turn": 5});
        let session = build_session("sokoban", &two_per_turn).unwrap();
        assert_eq!(session.protocol().max_turns, 5);
        let err = build_session("sokoban", &json!({"max_steps": 24, "max_turns": 10}))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("max_turns") && err.contains("max_steps") && err.contains("24"),
            "{err}"
        );
        let enough = json!({"max_steps": 24, "max_turns": 12, "max_actions_per_turn": 2});
        assert_eq!(
            build_session("sokoban", &enough)
                .unwrap()
                .protocol()
                .max_turns,
            12
        );
    }

    #[test]
    fn stable_hash_is_fnv1a() {
        assert_eq!(stable_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
