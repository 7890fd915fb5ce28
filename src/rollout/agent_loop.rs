//! The agent loop: drives `num_groups × group_size` agent sessions turn by turn through the
//! engine and turns every interaction round into a [`StepRecord`]. Contexts are built in token
//! space only (reference.md §2.3): the first context is the system message plus the first user
//! turn; in the `concat` layout each later context is the previous context + the sampled
//! response ids + the observation fragment (closing `<|im_end|>` if the response did not end with
//! it, the template's after-response tokens, the next user turn), so a response is never
//! re-tokenised and the radix cache sees each context extend the last. The `window` layout
//! renders a fresh prompt with the last k rounds at every step (`context_len == 0`). The loop owns
//! neither the model nor the cache: it borrows an [`Engine`] whose counters it reports.
//!
//! An env that fails (a remote server: `EnvError::Remote`) follows its config's `on_error`:
//! `fail` ends the rollout with [`RolloutError::Env`]; `skip` drops the failed episode's whole
//! group (group-relative estimators only ever see whole groups), counts it in
//! [`RolloutStats::env_errors`] and goes on; when every group fails the first error is returned.
//! Records reach the sink once the rollout is over, so a dropped group's never do.
//!
//! A remote env's groups are reset, and its episodes stepped, `concurrency` at a time, on scoped
//! threads over contiguous runs of the batch, their results taken in the batch's order: the
//! records and the errors reported are those of one episode after another, and an episode whose
//! group failed, or any once an error ends the rollout, is not stepped.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::env::{build_session, check_config, AgentSession, EnvError, OnError};
use crate::model::Model;
use crate::rollout::engine::{
    CacheCounters, Engine, EngineError, FinishReason, GenRequest, Generation,
};
use crate::rollout::grammar::{GrammarError, ResponseGrammar};
use crate::rollout::sampling::SamplingParams;
use crate::seed;
use crate::store::StepRecord;
use crate::tokenizer::tool_calls::ParsedReply;
use crate::tokenizer::{ChatTemplate, Followup, Tokenizer, ToolConversation};

/// Errors of a rollout.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    /// Generation failed in the engine.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// An env failed to build, reset or step (and its `on_error` did not skip it).
    #[error("env `{env}`: {source}")]
    Env {
        /// The env's name (`env_name`).
        env: String,
        /// The env's error.
        source: EnvError,
    },
    /// The sink refused a record.
    #[error("writing step {step} of trajectory {traj_id}: {message}")]
    Sink {
        /// Trajectory of the record.
        traj_id: u64,
        /// Step index of the record in its trajectory.
        step: u32,
        /// The sink's message.
        message: String,
    },
    /// The rollout config is invalid or does not suit the env.
    #[error("rollout config: {0}")]
    Config(String),
    /// The env's answer grammar could not be built for constrained decoding.
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    /// Tokenizing or rendering a context failed.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
}

/// Result of a rollout operation.
pub type Result<T> = std::result::Result<T, RolloutError>;

/// How a step's context is built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "layout")]
pub enum ContextLayout {
    /// The whole trajectory in context, each step appending to the last (the default).
    #[default]
    Concat,
    /// A fresh prompt per step holding the last `k` rounds (StepPO's HotpotQA flow); `k` 0 holds
    /// the current state only.
    Window {
        /// Number of past rounds shown in each prompt.
        k: usize,
    },
}

/// What one rollout runs.
#[derive(Clone, Debug)]
pub struct RolloutConfig {
    /// Name of the env to run (as `env::build_session` takes it).
    pub env_name: String,
    /// Env + protocol overrides over the env's defaults (see `env::build_session`).
    pub env_config: serde_json::Value,
    /// Number of groups (distinct env seeds) in the rollout; at least 1.
    pub num_groups: usize,
    /// Trajectories per group, all from the same env seed; at least 1.
    pub group_size: usize,
    /// Seed from which every env seed and sampling seed is derived.
    pub base_seed: u64,
    /// Id of the first group; group g gets `first_group_id + g`, its member m the trajectory id
    /// `group_id * group_size + m`. Advance it between rollouts to keep ids unique.
    pub first_group_id: u64,
    /// With `Some(n)`, the env of group `g` is seeded from level `g mod n` instead of `g`: the
    /// rollouts cycle through a finite set of `n` levels (Procgen's `num_levels`). Sampling
    /// stays seeded by the group id, so a level's visits differ.
    pub num_levels: Option<u64>,
    /// Sampling parameters of every response.
    pub sampling: SamplingParams,
    /// Most tokens per response; at least 1.
    pub max_new_tokens: usize,
    /// Hard cap on rounds per trajectory on top of the protocol's own `max_turns` (the round
    /// reaching it is marked truncated).
    pub max_turns: usize,
    /// A trajectory whose next context would exceed this is truncated.
    pub max_context_tokens: usize,
    /// How each step's context is built.
    pub layout: ContextLayout,
    /// Constrained decoding: responses follow the env's answer grammar ([`ResponseGrammar`]).
    pub constrained_decoding: bool,
    /// Each record carries the env's critic state at its step's start (what a `state` critic
    /// reads); off, none is computed.
    pub critic_state: bool,
}

impl Default for RolloutConfig {
    /// FrozenLake with its default protocol, 4 groups of 4, the concat layout.
    fn default() -> Self {
        Self {
            env_name: "frozen_lake".into(),
            env_config: serde_json::Value::Null,
            num_groups: 4,
            group_size: 4,
            base_seed: 0,
            first_group_id: 0,
            num_levels: None,
            sampling: SamplingParams::default(),
            max_new_tokens: 64,
            max_turns: 64,
            max_context_tokens: 2048,
            layout: ContextLayout::Concat,
            constrained_decoding: false,
            critic_state: false,
        }
    }
}

/// Per-rollout statistics for the trainer's metrics.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RolloutStats {
    /// Name of the env that ran (the config's `env_name`).
    pub env_tag: String,
    /// Trajectories kept (those of dropped groups excluded).
    pub trajectories: usize,
    /// Step records kept.
    pub steps: usize,
    /// Share of kept trajectories whose last step succeeded, in [0, 1].
    pub success_rate: f64,
    /// Mean over kept trajectories of the sum of their step rewards.
    pub mean_return: f64,
    /// Mean number of steps per kept trajectory.
    pub mean_turns: f64,
    /// Mean response length per step, in tokens.
    pub mean_response_tokens: f64,
    /// Longest response, in tokens.
    pub max_response_tokens: usize,
    /// Responses cut at `max_new_tokens`.
    pub length_cut_responses: usize,
    /// The engine's cache counters over this rollout.
    pub cache: CacheCounters,
    /// Wall-clock seconds of the whole rollout.
    pub wall_s: f64,
    /// Seconds spent in the engine's generate calls.
    pub generate_s: f64,
    /// Seconds building, resetting and stepping sessions and building the next contexts.
    pub env_s: f64,
    /// The env errors that each dropped a group under `on_error: skip`.
    pub env_errors: Vec<String>,
    /// Each env metric (`EnvInfo::metrics`, e.g. QA's `em`, `f1`, `searches`) summed over every
    /// turn of every kept trajectory: divided by `trajectories`, a per-episode mean.
    #[serde(default)]
    pub env_metric_sums: BTreeMap<String, f64>,
}

/// The records of one rollout (trajectory by trajectory, steps in order) and its statistics.
pub struct Rollout {
    /// Every kept step record, trajectory by trajectory, steps in order.
    pub records: Vec<StepRecord>,
    /// Statistics of the kept trajectories.
    pub stats: RolloutStats,
}

/// Where the records go once the rollout is over (e.g. a store writer), trajectory by trajectory
/// in order; `|_| Ok(())` keeps them in memory only.
pub type StepSink<'a> = dyn FnMut(&StepRecord) -> std::result::Result<(), String> + 'a;

struct Trajectory {
    session: AgentSession,
    traj_id: u64,
    group_id: u64,
    member: u64,
    env_seed: u64,
    /// Token context of the coming step (concat: the whole trajectory so far).
    context: Vec<u32>,
    /// Tokens before this step's observation fragment.
    context_len: usize,
    observation_text: String,
    records: Vec<StepRecord>,
    /// The env's metrics of every turn so far, summed by name.
    metric_sums: BTreeMap<String, f64>,
    done: bool,
    /// Tool mode (`tools: true`): the conversation the context renders.
    conversation: Option<ToolConversation>,
    /// The admissible actions the coming step's response is sampled among (constrained
    /// decoding over a state's actions), stored with its record; empty otherwise.
    admissible_actions: Vec<String>,
}

/// Runs one rollout: builds and resets every session (group g's members share the env seed
/// `seed::derive(base_seed, &[group_id])`, hence the prompt), then per turn generates for all
/// active trajectories in one engine call, steps their sessions and emits one record per round.
/// The engine's counters are taken (reset) into the returned stats.
pub fn run_rollout(
    engine: &mut Engine,
    model: &Model,
    tok: &Tokenizer,
    template: &ChatTemplate,
    cfg: &RolloutConfig,
    sink: &mut StepSink,
) -> Result<Rollout> {
    validate(cfg)?;
    let start = Instant::now();
    engine.take_counters();
    let check =
        check_config(&cfg.env_name, &cfg.env_config).map_err(|source| env_error(cfg, source))?;
    let mut dropped = DroppedGroups::new(check.on_error);
    let threads = check.concurrency;
    let t_start = Instant::now();
    let mut trajs = start_trajectories(tok, cfg, &mut dropped, threads)?;
    let mut env_s = t_start.elapsed().as_secs_f64();
    if trajs.first().is_some_and(|t| t.session.protocol().tools) {
        check_tool_mode(cfg)?;
    }
    let fixed_grammar = match trajs.first() {
        Some(t) if cfg.constrained_decoding => {
            ResponseGrammar::for_env(tok, &t.session)?.map(Arc::new)
        }
        _ => None,
    };
    let mut generate_s = 0.0;
    let mut length_cut = 0;
    for turn in 0..cfg.max_turns {
        let active: Vec<usize> = (0..trajs.len())
            .filter(|&i| !trajs[i].done && !dropped.contains(trajs[i].group_id))
            .collect();
        if active.is_empty() {
            break;
        }
        let mut grammars = Vec::with_capacity(active.len());
        for &i in &active {
            let grammar = match cfg.constrained_decoding {
                true => match turn_grammar(&mut trajs[i], tok, fixed_grammar.as_ref(), cfg) {
                    Ok(grammar) => Some(grammar),
                    Err(e) => {
                        dropped.absorb(trajs[i].group_id, e)?;
                        None
                    }
                },
                false => None,
            };
            grammars.push(grammar);
        }
        // A member whose state offered nothing to choose among drops its group.
        let (active, grammars): (Vec<usize>, Vec<_>) = (active.into_iter().zip(grammars))
            .filter(|(i, _)| !dropped.contains(trajs[*i].group_id))
            .unzip();
        if active.is_empty() {
            break;
        }
        let requests: Vec<GenRequest> = (active.iter().zip(grammars))
            .map(|(&i, grammar)| request(&trajs[i], turn as u32, tok, cfg, grammar))
            .collect();
        let t0 = Instant::now();
        let gens = engine.generate(model, tok, &requests)?;
        generate_s += t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let last_turn = turn + 1 == cfg.max_turns;
        let version = engine.policy_version();
        let mut gens = gens.into_iter();
        let work: Vec<(&mut Trajectory, Generation)> = trajs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| active.binary_search(i).is_ok())
            .filter_map(|(_, t)| gens.next().map(|g| (t, g)))
            .collect();
        let failures = Failures::new(check.on_error);
        let advanced = map_concurrently(work, threads, |(t, g)| {
            let cut = g.finish == FinishReason::Length;
            let step = (turn as u32, last_turn, version);
            let record = failures.unless_failed(t.group_id, || {
                advance(t, step, (g.tokens, g.logprobs), (tok, template, cfg))
            });
            (t.group_id, cut, record)
        });
        for ((group_id, cut, record), &i) in advanced.into_iter().zip(&active) {
            if dropped.contains(group_id) {
                continue; // another member failed this turn
            }
            length_cut += usize::from(cut);
            match record {
                Some(Ok(record)) => trajs[i].records.push(record),
                Some(Err(e)) => dropped.absorb(group_id, e)?,
                // Not stepped: a later member of its group failed, or a later error ends the
                // rollout, as the loop finds below.
                None => {}
            }
        }
        env_s += t1.elapsed().as_secs_f64();
    }
    let mut env_metric_sums = BTreeMap::new();
    for t in trajs.iter().filter(|t| !dropped.contains(t.group_id)) {
        for (name, v) in &t.metric_sums {
            *env_metric_sums.entry(name.clone()).or_insert(0.0) += v;
        }
    }
    let (records, trajectories) = dropped.keep_whole_groups(trajs)?;
    for record in &records {
        sink(record).map_err(|message| RolloutError::Sink {
            traj_id: record.traj_id,
            step: record.step_index,
            message,
        })?;
    }
    let mut stats = summarize(&cfg.env_name, &records, trajectories);
    stats.length_cut_responses = length_cut;
    stats.env_metric_sums = env_metric_sums;
    stats.cache = engine.take_counters();
    stats.wall_s = start.elapsed().as_secs_f64();
    stats.generate_s = generate_s;
    stats.env_s = env_s;
    stats.env_errors = dropped.messages;
    Ok(Rollout { records, stats })
}

fn validate(cfg: &RolloutConfig) -> Result<()> {
    let bad = |m: &str| Err(RolloutError::Config(m.to_string()));
    if cfg.num_groups == 0 || cfg.group_size == 0 {
        return bad("num_groups and group_size must be at least 1");
    }
    if cfg.max_turns == 0 || cfg.max_new_tokens == 0 {
        return bad("max_turns and max_new_tokens must be at least 1");
    }
    Ok(())
}

/// Tool mode renders a conversation that grows turn by turn, and its replies are calls, which
/// the env's answer grammar does not describe.
fn check_tool_mode(cfg: &RolloutConfig) -> Result<()> {
    if cfg.layout != ContextLayout::Concat {
        return Err(RolloutError::Config(format!(
            "env `{}` has tools: true, which needs context: concat",
            cfg.env_name
        )));
    }
    if cfg.constrained_decoding {
        return Err(RolloutError::Config(format!(
            "env `{}` has tools: true, whose replies are function calls, not the answers \
             constrained_decoding describes: set constrained_decoding: false",
            cfg.env_name
        )));
    }
    Ok(())
}

fn env_error(cfg: &RolloutConfig, source: EnvError) -> RolloutError {
    RolloutError::Env {
        env: cfg.env_name.clone(),
        source,
    }
}

/// The groups an env error dropped under `on_error: skip`.
struct DroppedGroups {
    on_error: OnError,
    groups: BTreeSet<u64>,
    messages: Vec<String>,
    first: Option<RolloutError>,
}

impl DroppedGroups {
    fn new(on_error: OnError) -> Self {
        DroppedGroups {
            on_error,
            groups: BTreeSet::new(),
            messages: Vec::new(),
            first: None,
        }
    }

    fn contains(&self, group_id: u64) -> bool {
        self.groups.contains(&group_id)
    }

    /// Takes an error met by a member of `group_id`: under `skip` an env error drops the group;
    /// any other error (and every error under `fail`) is returned.
    fn absorb(&mut self, group_id: u64, err: RolloutError) -> Result<()> {
        if ends_rollout(self.on_error, &err) {
            return Err(err);
        }
        self.groups.insert(group_id);
        self.messages.push(err.to_string());
        self.first.get_or_insert(err);
        Ok(())
    }

    /// The records of the groups no error dropped, trajectory by trajectory, and how many
    /// trajectories that is; the first error when every group was dropped.
    fn keep_whole_groups(&mut self, trajs: Vec<Trajectory>) -> Result<(Vec<StepRecord>, usize)> {
        let kept: Vec<Trajectory> = trajs
            .into_iter()
            .filter(|t| !self.contains(t.group_id))
            .collect();
        if let (true, Some(err)) = (kept.is_empty(), self.first.take()) {
            return Err(err);
        }
        let trajectories = kept.len();
        Ok((
            kept.into_iter().flat_map(|t| t.records).collect(),
            trajectories,
        ))
    }
}

/// Starts every group's trajectories; a group whose env fails is handed to `dropped`.
fn start_trajectories(
    tok: &Tokenizer,
    cfg: &RolloutConfig,
    dropped: &mut DroppedGroups,
    threads: usize,
) -> Result<Vec<Trajectory>> {
    let mut trajs = Vec::with_capacity(cfg.num_groups * cfg.group_size);
    let groups: Vec<u64> = (0..cfg.num_groups as u64)
        .map(|g| cfg.first_group_id + g)
        .collect();
    let failures = Failures::new(dropped.on_error);
    let started = map_concurrently(groups, threads, |group_id| {
        let members = failures.unless_failed(group_id, || start_group(tok, cfg, group_id));
        (group_id, members)
    });
    for (group_id, members) in started {
        match members {
            Some(Ok(members)) => trajs.extend(members),
            Some(Err(e)) => dropped.absorb(group_id, e)?,
            None => {} // a later group's error ends the rollout, as the loop finds
        }
    }
    Ok(trajs)
}

/// Whether `err` ends the rollout under `on_error` (else it drops its group).
fn ends_rollout(on_error: OnError, err: &RolloutError) -> bool {
    on_error != OnError::Skip || !matches!(err, RolloutError::Env { .. })
}

/// What the episodes stepped at once know of each other's failures: the groups that failed so
/// far, and whether an error ended the rollout. An episode of either is not stepped (as one
/// after another would not have reached it).
struct Failures {
    on_error: OnError,
    groups: std::sync::Mutex<BTreeSet<u64>>,
    stop: std::sync::atomic::AtomicBool,
}

impl Failures {
    fn new(on_error: OnError) -> Self {
        Self {
            on_error,
            groups: Default::default(),
            stop: Default::default(),
        }
    }

    /// `f`'s result for an episode of `group`, or `None` when it is not to be stepped.
    fn unless_failed<T>(&self, group: u64, f: impl FnOnce() -> Result<T>) -> Option<Result<T>> {
        use std::sync::atomic::Ordering::Relaxed;
        let groups = || self.groups.lock().unwrap_or_else(|e| e.into_inner());
        if self.stop.load(Relaxed) || groups().contains(&group) {
            return None;
        }
        let out = f();
        if let Err(e) = &out {
            groups().insert(group);
            if ends_rollout(self.on_error, e) {
                self.stop.store(true, Relaxed);
            }
        }
        Some(out)
    }
}

/// `f` of every item, in the items' order: on up to `threads` scoped threads, each taking a
/// contiguous run of the items, or on this thread alone when `threads` is 1.
fn map_concurrently<T: Send, R: Send>(
    items: Vec<T>,
    threads: usize,
    f: impl Fn(T) -> R + Sync,
) -> Vec<R> {
    if threads <= 1 || items.len() <= 1 {
        return items.into_iter().map(f).collect();
    }
    let run = items.len().div_ceil(threads);
    let mut runs: Vec<Vec<T>> = Vec::new();
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        runs.push(items.by_ref().take(run).collect());
    }
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .into_iter()
            .map(|run| scope.spawn(move || run.into_iter().map(f).collect::<Vec<R>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// Builds and resets the sessions of one group (one env seed, hence one first prompt).
fn start_group(tok: &Tokenizer, cfg: &RolloutConfig, group_id: u64) -> Result<Vec<Trajectory>> {
    let level = cfg.num_levels.map_or(group_id, |n| group_id % n);
    let env_seed = seed::derive(cfg.base_seed, &[level]);
    let mut members = Vec::with_capacity(cfg.group_size);
    for member in 0..cfg.group_size as u64 {
        let mut session = build_session(&cfg.env_name, &cfg.env_config)
            .map_err(|source| env_error(cfg, source))?;
        let first = session
            .reset(env_seed)
            .map_err(|source| env_error(cfg, source))?;
        let (conversation, context) = ToolConversation::open(
            tok,
            &session.system_prompt(),
            &first,
            session.tool_schemas(),
        )?;
        members.push(Trajectory {
            conversation,
            session,
            traj_id: group_id * cfg.group_size as u64 + member,
            group_id,
            member,
            env_seed,
            context,
            context_len: 0,
            observation_text: first,
            records: Vec::new(),
            metric_sums: BTreeMap::new(),
            done: false,
            admissible_actions: Vec::new(),
        });
    }
    Ok(members)
}

/// The grammar `t`'s coming response samples under: one of the actions its state admits where
/// the env offers them (kept in `t` for the step's record), else the env's `fixed` grammar; an
/// env error (which `on_error: skip` turns into a dropped group) when there is neither.
fn turn_grammar(
    t: &mut Trajectory,
    tok: &Tokenizer,
    fixed: Option<&Arc<ResponseGrammar>>,
    cfg: &RolloutConfig,
) -> Result<Arc<ResponseGrammar>> {
    let env = t.session.env();
    t.admissible_actions = env.admissible_actions().unwrap_or_default().to_vec();
    if !t.admissible_actions.is_empty() {
        let protocol = t.session.protocol();
        let grammar =
            ResponseGrammar::for_actions(tok, (env.tag(), protocol), &t.admissible_actions)?;
        return Ok(Arc::new(grammar));
    }
    let tag = env.tag().to_string();
    fixed
        .cloned()
        .ok_or_else(|| env_error(cfg, EnvError::NoAdmissibleActions { env: tag }))
}

fn request(
    t: &Trajectory,
    turn: u32,
    tok: &Tokenizer,
    cfg: &RolloutConfig,
    grammar: Option<Arc<ResponseGrammar>>,
) -> GenRequest {
    GenRequest {
        tokens: t.context.clone(),
        traj: t.traj_id,
        group: t.group_id,
        turn,
        params: cfg.sampling,
        seed: seed::derive(cfg.base_seed, &[t.group_id, t.member, turn as u64, 0x5A]),
        max_new_tokens: cfg.max_new_tokens,
        stop_token_ids: vec![tok.eos_id()],
        stop_strings: t.session.stop_strings(),
        grammar,
    }
}

/// Applies one response (with its log-probs) to its trajectory at `(turn, last turn, policy
/// version)`: steps the session, builds the round's record and the next context.
fn advance(
    t: &mut Trajectory,
    (turn, last_turn, policy_version): (u32, bool, u64),
    (response, logprobs): (Vec<u32>, Vec<f32>),
    (tok, template, cfg): (&Tokenizer, &ChatTemplate, &RolloutConfig),
) -> Result<StepRecord> {
    let state_hash = t.session.state_hash();
    let critic_state = if cfg.critic_state {
        t.session.env().critic_state().unwrap_or_default()
    } else {
        Vec::new()
    };
    let response_text = tok.decode(&response);
    let reply = match &t.conversation {
        Some(_) => Some(found_calls(tok, &t.session, &response)?),
        None => None,
    };
    let mut outcome = match &reply {
        Some(reply) => t.session.act_reply(&response_text, reply),
        None => t.session.act(&response_text),
    }
    .map_err(|source| env_error(cfg, source))?;
    for (name, v) in &outcome.metrics {
        *t.metric_sums.entry(name.clone()).or_insert(0.0) += f64::from(*v);
    }
    let mut info = std::mem::take(&mut outcome.info);
    if info.observation_text.is_empty() {
        info.observation_text = std::mem::take(&mut t.observation_text);
    }
    if info.action_text.is_empty() {
        info.action_text = response_text.clone();
    }
    let obs_ids = t.context[t.context_len..].to_vec();
    let mut record = StepRecord {
        traj_id: t.traj_id,
        group_id: t.group_id,
        step_index: turn,
        env_tag: t.session.env().tag().to_string(),
        seed: t.env_seed,
        policy_version,
        context_len: t.context_len as u32,
        obs_ids,
        response_ids: response,
        response_logprobs: logprobs,
        reward: outcome.reward,
        terminated: outcome.terminated,
        truncated: outcome.truncated,
        state_hash,
        info,
        critic_state,
        admissible_actions: std::mem::take(&mut t.admissible_actions),
    };
    match outcome.followup().filter(|_| !record.is_last()) {
        Some(followup) => {
            let said = (response_text.as_str(), reply.as_ref());
            next_context(t, &record, said, followup, (tok, template, cfg))?;
            if last_turn || t.context.len() + cfg.max_new_tokens > cfg.max_context_tokens {
                record.truncated = true;
            }
        }
        None => record.truncated |= !record.terminated,
    }
    t.done = record.is_last();
    Ok(record)
}

/// What a tool-mode reply says, read in the tokenizer's tool-call format up to its end of turn
/// (a template without a call format is an error naming it).
fn found_calls(tok: &Tokenizer, session: &AgentSession, response: &[u32]) -> Result<ParsedReply> {
    let format = tok
        .tool_call_format()
        .map_err(|e| RolloutError::Config(format!("tools: true: {e}")))?;
    let body = response.strip_suffix(&[tok.eos_id()]).unwrap_or(response);
    Ok(format.parse(&tok.decode(body), &session.tool_names()))
}

/// Builds the context of the next step in token space.
fn next_context(
    t: &mut Trajectory,
    record: &StepRecord,
    (text, reply): (&str, Option<&ParsedReply>),
    followup: Followup<'_>,
    (tok, template, cfg): (&Tokenizer, &ChatTemplate, &RolloutConfig),
) -> Result<()> {
    let message = match followup {
        Followup::User(user) => user.to_string(),
        Followup::ToolResults(results) => results.join("\n"),
    };
    let message = message.as_str();
    t.observation_text = message.to_string();
    if let (Some(conversation), Some(reply)) = (t.conversation.as_mut(), reply) {
        t.context.extend_from_slice(&record.response_ids);
        t.context_len = t.context.len();
        let next = conversation.after_reply(tok, &record.response_ids, (text, reply), followup)?;
        t.context.extend(next);
        return Ok(());
    }
    match cfg.layout {
        ContextLayout::Concat => {
            t.context.extend_from_slice(&record.response_ids);
            t.context_len = t.context.len();
            t.context
                .extend(template.next_turn(tok, &record.response_ids, message)?);
        }
        ContextLayout::Window { k } => {
            t.context = template.first_prompt(
                tok,
                &t.session.system_prompt(),
                &t.session.window_user_message(k),
            )?;
            t.context_len = 0;
        }
    }
    Ok(())
}

fn summarize(env_tag: &str, records: &[StepRecord], trajectories: usize) -> RolloutStats {
    let lasts: Vec<&StepRecord> = records.iter().filter(|r| r.is_last()).collect();
    let total_return: f64 = records.iter().map(|r| r.reward as f64).sum();
    let response_lens: Vec<usize> = records.iter().map(|r| r.response_ids.len()).collect();
    let per = |x: f64, n: usize| if n == 0 { 0.0 } else { x / n as f64 };
    RolloutStats {
        env_tag: env_tag.to_string(),
        trajectories,
        steps: records.len(),
        success_rate: per(
            lasts.iter().filter(|r| r.info.success).count() as f64,
            trajectories,
        ),
        mean_return: per(total_return, trajectories),
        mean_turns: per(records.len() as f64, trajectories),
        mean_response_tokens: per(response_lens.iter().sum::<usize>() as f64, records.len()),
        max_response_tokens: response_lens.iter().copied().max().unwrap_or(0),
        ..RolloutStats::default()
    }
}
