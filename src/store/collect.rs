//! Collecting a step dataset with a model-free agent (`stepppo collect`): episodes are played
//! through the same text protocol as a model, tokenised in token space with the chat template,
//! and stored as [`StepRecord`]s.
//!
//! Episodes form groups of `group_size` same-seed trajectories: episode `e` has `traj_id = e`,
//! `group_id = e / group_size`, env seed `seed::derive(seed, &[group_id])` and agent seed
//! `seed::derive(env_seed, &[member])`. Tokens per step: `obs_ids` = chat-template tokens of the
//! user turn (the first step also carries the system prompt; later steps start with the `\n`
//! that closes the previous assistant turn), `response_ids` = tokens of the agent's response
//! text followed by the end-of-turn token, `response_logprobs` = 0.0 for every token (a
//! model-free agent has no token distribution; these records suit SFT and re-scoring, not
//! off-policy correction), `context_len` = running total, `policy_version` = 0.
//!
//! An env error (a remote server's) ends the collection with that error after flushing what was
//! appended: the episodes already written stay in the dataset, the failed one is not written.

use serde_json::{json, Value};

use super::dataset::DatasetWriter;
use super::error::StoreError;
use super::record::StepRecord;
use crate::env::{self, Agent, AgentKind, AgentSession};
use crate::seed;
use crate::tokenizer::tool_calls::ParsedReply;
use crate::tokenizer::{ChatTemplate, Followup, Tokenizer, ToolConversation};

/// What to collect.
#[derive(Clone, Debug)]
pub struct CollectConfig {
    /// Name of the env to play.
    pub env: String,
    /// Env and protocol overrides (`--set key=value`), as for `build_session`.
    pub env_config: Value,
    /// The model-free agent that plays every episode.
    pub agent: AgentKind,
    /// Trajectories in total; the last group is smaller when `group_size` does not divide it.
    pub episodes: u64,
    /// Same-seed trajectories per group (0 is taken as 1).
    pub group_size: u64,
    /// Base seed of every env and agent seed.
    pub seed: u64,
}

/// The key of the manifest's `tokenizer` entry listing the words the built-in tokenizer was
/// extended with ([`Tokenizer::builtin_with_words`]), so a reader decodes with the same ids.
pub const EXTRA_WORDS_KEY: &str = "extra_words";

/// The key of the manifest's `tokenizer` entry naming the checkpoint directory whose tokenizer
/// produced the ids (an imported chat log's), so a reader decodes with it.
pub const TOKENIZER_DIR_KEY: &str = "dir";

impl CollectConfig {
    /// The run description stored in the manifest's `metadata` map.
    pub fn metadata(&self, tokenizer: &Tokenizer) -> Vec<(String, Value)> {
        let agent = self.agent.name();
        vec![
            (
                "collect".into(),
                json!({
                    "env": self.env, "env_config": self.env_config, "agent": agent,
                    "episodes": self.episodes, "group_size": self.group_size, "seed": self.seed,
                    "response_logprobs": "0.0 (model-free agent)",
                }),
            ),
            (
                "tokenizer".into(),
                json!({
                    "kind": "builtin", "vocab_size": tokenizer.vocab_size(), "eos_id": tokenizer.eos_id(),
                    EXTRA_WORDS_KEY: env::builtin_words(&self.env, &self.env_config).unwrap_or_default(),
                }),
            ),
        ]
    }
}

/// Totals of a collection run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CollectSummary {
    /// Episodes written.
    pub trajectories: u64,
    /// Step records written.
    pub steps: u64,
    /// Episodes with a successful step.
    pub successes: u64,
}

/// Plays `cfg.episodes` episodes and appends every step to `writer`.
pub fn collect(
    cfg: &CollectConfig,
    tokenizer: &Tokenizer,
    writer: &mut DatasetWriter,
) -> Result<CollectSummary, StoreError> {
    let mut session =
        env::build_session(&cfg.env, &cfg.env_config).map_err(|e| StoreError::Invalid {
            path: writer.dir().to_path_buf(),
            reason: format!("collect: {e}"),
        })?;
    let group_size = cfg.group_size.max(1);
    let mut summary = CollectSummary::default();
    for traj_id in 0..cfg.episodes {
        let group_id = traj_id / group_size;
        let env_seed = seed::derive(cfg.seed, &[group_id]);
        let mut agent = Agent::new(cfg.agent, seed::derive(env_seed, &[traj_id % group_size]));
        let ids = EpisodeIds {
            traj_id,
            group_id,
            env_seed,
            env_tag: session.env().tag().to_string(),
        };
        let steps = match agent_episode(&mut session, &mut agent, &ids, tokenizer) {
            Ok(steps) => steps,
            Err(e) => {
                writer.flush()?;
                return Err(e);
            }
        };
        for step in &steps {
            writer.append(step)?;
        }
        summary.trajectories += 1;
        summary.steps += steps.len() as u64;
        summary.successes += u64::from(steps.iter().any(|s| s.info.success));
    }
    writer.flush()?;
    Ok(summary)
}

/// Ids and tag given to the records of one episode.
pub struct EpisodeIds {
    /// Trajectory id of the episode.
    pub traj_id: u64,
    /// Group the episode belongs to.
    pub group_id: u64,
    /// Seed the env is reset with.
    pub env_seed: u64,
    /// The env's tag, stored in every record.
    pub env_tag: String,
}

/// Plays one episode of a model-free `agent` through the agent protocol and returns its steps as
/// token-space records: the first step's `obs_ids` are the system prompt and first user turn, each
/// later step's are what closes the previous response and the next user turn; responses end with
/// the end-of-turn token; log-probs are 0 and `policy_version` 0 (no policy sampled them). The
/// last record always ends the trajectory (`is_last`). An env error ends the episode with it.
pub fn agent_episode(
    session: &mut AgentSession,
    agent: &mut Agent,
    ids: &EpisodeIds,
    tok: &Tokenizer,
) -> Result<Vec<StepRecord>, StoreError> {
    let template = ChatTemplate;
    let first_message = session.reset(ids.env_seed)?;
    let (mut conversation, mut obs_ids) = ToolConversation::open(
        tok,
        &session.system_prompt(),
        &first_message,
        session.tool_schemas(),
    )?;
    let mut context_len = 0u32;
    let mut steps: Vec<StepRecord> = Vec::new();
    for step_index in 0u32.. {
        let state_hash = session.state_hash();
        let turn = agent_turn(session, agent, conversation.as_ref(), tok)?;
        let outcome = match &turn.reply {
            Some(reply) => session.act_reply(&turn.text, reply)?,
            None => session.act(&turn.text)?,
        };
        let followup = outcome.followup();
        let record = StepRecord {
            traj_id: ids.traj_id,
            group_id: ids.group_id,
            step_index,
            env_tag: ids.env_tag.clone(),
            seed: ids.env_seed,
            policy_version: 0,
            context_len,
            response_logprobs: vec![0.0; turn.ids.len()],
            obs_ids: std::mem::take(&mut obs_ids),
            response_ids: turn.ids,
            reward: outcome.reward,
            terminated: outcome.terminated,
            truncated: outcome.truncated || (followup.is_none() && !outcome.terminated),
            state_hash,
            info: outcome.info.clone(),
            critic_state: Vec::new(),
            admissible_actions: Vec::new(),
        };
        context_len += (record.obs_ids.len() + record.response_ids.len()) as u32;
        let followup = followup.filter(|_| !record.is_last());
        let response = record.response_ids.clone();
        steps.push(record);
        let Some(followup) = followup else {
            break;
        };
        obs_ids = match (conversation.as_mut(), &turn.reply, followup) {
            (Some(c), Some(reply), _) => {
                c.after_reply(tok, &response, (&turn.text, reply), followup)?
            }
            (_, _, Followup::User(user)) => template.next_turn(tok, &response, user)?,
            (_, _, Followup::ToolResults(_)) => unreachable!("tool results come in tool mode only"),
        };
    }
    Ok(steps)
}

/// A model-free agent's turn: its response text and tokens, and in tool mode the call it makes.
struct AgentTurn {
    text: String,
    ids: Vec<u32>,
    reply: Option<ParsedReply>,
}

fn agent_turn(
    session: &AgentSession,
    agent: &mut Agent,
    conversation: Option<&ToolConversation>,
    tok: &Tokenizer,
) -> Result<AgentTurn, StoreError> {
    let Some(conversation) = conversation else {
        let text = agent.respond(session)?;
        let mut ids = tok.encode(&text);
        ids.push(tok.eos_id());
        return Ok(AgentTurn {
            text,
            ids,
            reply: None,
        });
    };
    let call = env::tools::action_call(&agent.action(session)?);
    let ids = conversation.reply_ids(tok, std::slice::from_ref(&call))?;
    Ok(AgentTurn {
        text: tok.decode(&ids),
        ids,
        reply: Some(ParsedReply::Calls {
            content: None,
            calls: vec![call],
        }),
    })
}
