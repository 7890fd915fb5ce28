//! OpenAI chat-format JSONL into a step dataset ([`import_chat_jsonl`]): one conversation per
//! line, one step per assistant message, tokenised with a checkpoint's chat template exactly as
//! the gateway renders a request (the same message and tool checks, the same template).
//!
//! A line is `{"messages": [...], "tools": [...], "reward": R | "rewards": [R per assistant
//! message], "group": G, "seed": S, "success": B, "truncated": B, "env": TAG}`; only `messages`
//! is required, other keys are ignored. `reward` goes to the last step, `rewards` one per step;
//! without either every reward is 0. Conversations with the same `group` (any JSON value) share
//! a group id (ids in order of first appearance); one without is a group of its own. Trajectory
//! ids count the imported conversations from 0.
//!
//! Step k's prompt is the template's rendering of the messages before its assistant message
//! with the generation prompt (as `apply_chat_template(..., add_generation_prompt=True)`), its
//! response the template's rendering of that message through the end-of-turn token
//! ([`ChatTemplate::reply_ids`]). When the prompt extends the previous step's prompt and
//! response token for token, the step stores only the new tokens (`context_len` > 0); when the
//! template re-renders earlier turns differently (Qwen3 drops past reasoning, say), the step
//! starts a fresh context and is flagged `context_rebuilt`, as the gateway records it.
//! Behaviour log-probs are unknown and stored as 0.0; messages after the last assistant message
//! are not part of any step.

use std::collections::{BTreeMap, HashMap};
use std::io::BufRead;
use std::path::Path;

use anyhow::Context;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::parquet_file::ImportSummary;
use super::staging::StagedDataset;
use crate::env::{stable_hash, StepInfo};
use crate::serve::{check_messages, check_tools, ApiError, WireMessage};
use crate::store::{StepRecord, WriterOptions};
use crate::tokenizer::{ChatTemplate, Message, Tokenizer};

/// Env tag of imported records whose line names none.
pub const DEFAULT_CHAT_ENV_TAG: &str = "chat";

/// How to import chat logs.
pub struct ChatImportOptions<'a> {
    /// Tokenises the conversations with its chat template (built in: the Qwen-style template).
    pub tokenizer: &'a Tokenizer,
    /// Env tag of lines without `env`.
    pub env_tag: String,
    /// Fail on the first conversation that cannot be imported instead of skipping it.
    pub strict: bool,
    /// Segment size of the new dataset (`None`: the store's default).
    pub roll_bytes: Option<u64>,
    /// Entries for the new dataset's manifest `metadata` (the tokenizer's description, say).
    pub metadata: BTreeMap<String, Value>,
}

#[derive(Deserialize)]
struct ChatLine {
    messages: Vec<WireMessage>,
    tools: Option<Vec<Box<RawValue>>>,
    reward: Option<f32>,
    rewards: Option<Vec<f32>>,
    group: Option<Value>,
    seed: Option<u64>,
    success: Option<bool>,
    truncated: Option<bool>,
    env: Option<String>,
}

/// Imports the conversations of the JSONL file `path` into a new dataset at `out`. A line that
/// is not a conversation, or one the template cannot render, is skipped and listed in the
/// summary (with `strict`, it fails the import, which leaves no dataset behind).
pub fn import_chat_jsonl(
    path: &Path,
    out: &Path,
    opts: &ChatImportOptions<'_>,
) -> anyhow::Result<ImportSummary> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut writer_opts = WriterOptions {
        metadata: opts.metadata.clone(),
        ..WriterOptions::default()
    };
    if let Some(roll) = opts.roll_bytes {
        writer_opts.roll_bytes = roll;
    }
    writer_opts.metadata.insert(
        "import".into(),
        serde_json::json!({
            "format": "chat-jsonl", "from": path.display().to_string(),
            "response_logprobs": "0.0 (chat logs carry none)",
        }),
    );
    let mut staged = StagedDataset::create(out, writer_opts)?;
    let mut groups: HashMap<String, u64> = HashMap::new();
    let mut next_group = 0u64;
    let mut summary = ImportSummary::default();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("{}: line {}", path.display(), n + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let steps = conversation(&line, opts).map(|(conv, group)| {
            let fresh = |next: &mut u64| {
                *next += 1;
                *next - 1
            };
            let group_id = match group {
                Some(key) => *groups.entry(key).or_insert_with(|| fresh(&mut next_group)),
                None => fresh(&mut next_group),
            };
            conv.records(summary.trajectories, group_id)
        });
        match steps {
            Ok(records) => {
                for record in &records {
                    staged.append(record)?;
                }
                summary.records += records.len() as u64;
                summary.trajectories += 1;
            }
            Err(why) if opts.strict => {
                anyhow::bail!("{}: line {}: {why}", path.display(), n + 1)
            }
            Err(why) => summary.skipped.push(format!("line {}: {why}", n + 1)),
        }
    }
    staged.commit()?;
    Ok(summary)
}

/// A conversation's steps before trajectory and group ids are given.
struct Conversation {
    steps: Vec<StepRecord>,
}

impl Conversation {
    fn records(mut self, traj_id: u64, group_id: u64) -> Vec<StepRecord> {
        for step in &mut self.steps {
            step.traj_id = traj_id;
            step.group_id = group_id;
        }
        self.steps
    }
}

fn api_error(e: ApiError) -> String {
    match e.param {
        Some(param) => format!("{param}: {}", e.message),
        None => e.message,
    }
}

/// Parses and tokenises one line; also returns its group key (the JSON text of `group`).
fn conversation(
    line: &str,
    opts: &ChatImportOptions<'_>,
) -> Result<(Conversation, Option<String>), String> {
    let line: ChatLine =
        serde_json::from_str(line).map_err(|e| format!("not a conversation: {e}"))?;
    let messages = check_messages(line.messages).map_err(api_error)?;
    let tools = check_tools(line.tools, None, None).map_err(api_error)?;
    let replies: Vec<usize> = (0..messages.len())
        .filter(|&i| messages[i].role == "assistant")
        .collect();
    if replies.is_empty() {
        return Err("no assistant message: nothing to import as a step".into());
    }
    let rewards = step_rewards(line.reward, line.rewards, replies.len())?;
    let views: Vec<Message> = messages.iter().map(|m| m.as_message()).collect();
    let tok = opts.tokenizer;
    let template_error = |i: usize, e: crate::tokenizer::TokenizerError| {
        format!("messages[{i}]: the chat template cannot render the conversation: {e}")
    };
    let truncated = line.truncated.unwrap_or(false);
    let mut context: Vec<u32> = Vec::new();
    let mut steps = Vec::with_capacity(replies.len());
    let mut after_last_reply = 0;
    for (k, &i) in replies.iter().enumerate() {
        let prompt = ChatTemplate
            .conversation_with_tools(tok, &views[..i], &tools.schemas)
            .map_err(|e| template_error(i, e))?;
        let response = ChatTemplate
            .reply_ids(tok, &views[..i], &views[i], &tools.schemas)
            .map_err(|e| template_error(i, e))?;
        let continues = k > 0 && prompt.starts_with(&context);
        let context_len = if continues { context.len() } else { 0 };
        let obs_ids = prompt[context_len..].to_vec();
        let observation_text = messages[after_last_reply..i]
            .iter()
            .map(|m| m.content_text())
            .collect::<Vec<_>>()
            .join("\n\n");
        let action_end = response.len() - usize::from(response.last() == Some(&tok.eos_id()));
        let last = k + 1 == replies.len();
        steps.push(StepRecord {
            step_index: k as u32,
            env_tag: line.env.clone().unwrap_or_else(|| opts.env_tag.clone()),
            seed: line.seed.unwrap_or(0),
            context_len: context_len as u32,
            response_logprobs: vec![0.0; response.len()],
            reward: rewards[k],
            terminated: last && !truncated,
            truncated: last && truncated,
            state_hash: stable_hash(observation_text.as_bytes()),
            info: StepInfo {
                success: last && line.success.unwrap_or(false),
                action_is_valid: true,
                action_is_effective: true,
                num_actions: 1,
                action_text: tok.decode(&response[..action_end]),
                observation_text,
                context_rebuilt: k > 0 && !continues,
                ..StepInfo::default()
            },
            obs_ids,
            ..StepRecord::default()
        });
        context = prompt;
        context.extend_from_slice(&response);
        steps.last_mut().expect("pushed").response_ids = response;
        after_last_reply = i + 1;
    }
    let group = line.group.map(|g| g.to_string());
    Ok((Conversation { steps }, group))
}

/// Each step's reward: `reward` on the last step, or `rewards` one per assistant message.
fn step_rewards(
    reward: Option<f32>,
    rewards: Option<Vec<f32>>,
    steps: usize,
) -> Result<Vec<f32>, String> {
    match (reward, rewards) {
        (Some(_), Some(_)) => Err("both `reward` and `rewards`: give one".into()),
        (Some(r), None) => {
            let mut out = vec![0.0; steps];
            out[steps - 1] = r;
            Ok(out)
        }
        (None, Some(v)) if v.len() != steps => Err(format!(
            "`rewards` has {} entries for {steps} assistant messages",
            v.len()
        )),
        (None, Some(v)) => Ok(v),
        (None, None) => Ok(vec![0.0; steps]),
    }
}
