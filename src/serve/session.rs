//! The gateway's conversations as trajectories. A session (keyed by the id the client sends) is
//! one trajectory; each completion in it is one step. The prompt of a step is built in token
//! space whenever the client's messages continue the session: the last request's messages, then
//! the assistant reply exactly as returned, then new messages. Then the step's context is the
//! last context plus the sampled response ids plus the template's rendering of what follows them
//! ([`ChatTemplate::after_reply`]), so a response is never re-tokenised, the radix cache sees
//! the context grow and the record stores only the new tokens (`context_len` > 0). A
//! conversation that does not continue (edited history, a new task in the same session) starts a
//! fresh context: the whole rendered prompt with `context_len` 0, which training reads as the
//! start of a new sequence, and its record says so (`context_rebuilt`). A request offering
//! different tools than the session's last one does not continue it either (the template renders
//! the tools at the start). A reply whose tool call did not parse is recorded with
//! `tool_call_error` and pays the tool-call penalty. Closing a session with its reward(s) yields
//! its step records; the caller assigns trajectory and group ids. Sessions idle past their time
//! to live are dropped.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde::Deserialize;

use super::api::{ApiError, ChatMessage, Completion};
use crate::env::stable_hash;
use crate::env::StepInfo;
use crate::store::StepRecord;
use crate::tokenizer::{ChatTemplate, Message, Tokenizer};

/// Env tag of records whose client named none.
pub const DEFAULT_ENV_TAG: &str = "gateway";

/// The context a completion generates from.
#[derive(Debug, Clone)]
pub struct Prompt {
    /// The whole context.
    pub tokens: Vec<u32>,
    /// Tokens before this step's new tokens (0 for a fresh context).
    pub context_len: usize,
    /// The new messages of this step, as text (the record's observation).
    pub observation_text: String,
    /// The session had turns but the client's messages did not continue them: the context was
    /// rendered afresh from the messages.
    pub rebuilt: bool,
}

impl Prompt {
    /// Tokens new at this step.
    pub fn new_tokens(&self) -> &[u32] {
        &self.tokens[self.context_len..]
    }
}

struct Turn {
    context_len: usize,
    obs_ids: Vec<u32>,
    response_ids: Vec<u32>,
    response_logprobs: Vec<f32>,
    policy_version: u64,
    observation_text: String,
    action_text: String,
    tool_call_error: bool,
    context_rebuilt: bool,
}

struct Session {
    task: Option<String>,
    env_tag: String,
    env_seed: u64,
    turns: Vec<Turn>,
    /// The messages and tools of the last request, and the reply returned to it.
    history: Vec<ChatMessage>,
    tools: Vec<String>,
    reply: ChatMessage,
    /// The last context followed by its sampled response.
    context: Vec<u32>,
    busy: bool,
    touched: Instant,
}

/// What a sampled turn adds to its session.
pub struct Sampled<'a> {
    pub response_ids: &'a [u32],
    pub response_logprobs: &'a [f32],
    /// The sampled text (the record's action text).
    pub text: String,
    /// The assistant message returned to the client (content and tool calls).
    pub reply: ChatMessage,
    /// The reply tried to call a tool and the call did not parse.
    pub tool_call_error: bool,
    pub policy_version: u64,
}

/// `POST /v1/sessions/{id}/close`: the reward of the whole trajectory (given to its last step) or
/// one reward per step, and how it ended.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloseRequest {
    /// The trajectory's reward, given to its last step (the others get 0); exclusive with
    /// `rewards`.
    pub reward: Option<f32>,
    /// One reward per step, in step order; exclusive with `reward`.
    pub rewards: Option<Vec<f32>>,
    /// The episode was solved (the last step's `success`).
    #[serde(default)]
    pub success: bool,
    /// The episode was cut (a limit), not finished: its last step is truncated, not terminated.
    #[serde(default)]
    pub truncated: bool,
}

/// A closed session's steps (ids 0: the caller assigns `traj_id` and `group_id`).
#[derive(Debug)]
pub struct ClosedTrajectory {
    /// The session id.
    pub session: String,
    /// The task the session belongs to, when the client named one.
    pub task: Option<String>,
    /// One record per completion, in step order.
    pub records: Vec<StepRecord>,
}

/// The open sessions.
pub struct Sessions {
    open: HashMap<String, Session>,
    ttl: Duration,
    tool_call_penalty: f32,
}

impl Sessions {
    /// Sessions dropped after `ttl` idle; a step whose tool call did not parse is paid
    /// `tool_call_penalty` (added to its reward).
    pub fn new(ttl: Duration, tool_call_penalty: f32) -> Self {
        Self {
            open: HashMap::new(),
            ttl,
            tool_call_penalty,
        }
    }

    /// Sessions open now.
    pub fn open_count(&self) -> usize {
        self.open.len()
    }

    /// The prompt of completion `c` in session `id` (created when new); marks the session busy
    /// until [`Sessions::finish`] or [`Sessions::release`].
    pub fn begin(&mut self, tok: &Tokenizer, id: &str, c: &Completion) -> Result<Prompt, ApiError> {
        let session = self.open.entry(id.to_string()).or_insert_with(|| Session {
            task: c.task.clone(),
            env_tag: c.env_tag.clone().unwrap_or_else(|| DEFAULT_ENV_TAG.into()),
            env_seed: c.env_seed.unwrap_or(0),
            turns: Vec::new(),
            history: Vec::new(),
            tools: Vec::new(),
            reply: ChatMessage::text("assistant", ""),
            context: Vec::new(),
            busy: false,
            touched: Instant::now(),
        });
        if session.busy {
            return Err(ApiError::invalid(
                None,
                format!("session `{id}` has a completion in flight; send its next turn after it"),
            )
            .with_code(StatusCode::CONFLICT, "session_busy"));
        }
        if c.task.is_some() && c.task != session.task {
            return Err(ApiError::invalid(
                Some("metadata.task"),
                format!(
                    "session `{id}` belongs to task {:?}, not {:?}",
                    session.task, c.task
                ),
            ));
        }
        let prompt = match continued(session, &c.messages, &c.tools.schemas) {
            Some(trailing) => {
                let history = as_messages(&session.history);
                let last_response = &session
                    .turns
                    .last()
                    .expect("a continued session has turns")
                    .response_ids;
                let after = ChatTemplate
                    .after_reply(
                        tok,
                        last_response,
                        &history,
                        &as_messages(trailing),
                        &c.tools.schemas,
                    )
                    .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
                let mut tokens = session.context.clone();
                tokens.extend(after);
                Prompt {
                    tokens,
                    context_len: session.context.len(),
                    observation_text: transcript(trailing),
                    rebuilt: false,
                }
            }
            None => Prompt {
                rebuilt: !session.turns.is_empty(),
                ..fresh_prompt(tok, &c.messages, &c.tools.schemas)?
            },
        };
        session.busy = true;
        session.touched = Instant::now();
        Ok(prompt)
    }

    /// Adds the sampled turn to session `id` (asked with `messages` offering `tools`) and frees
    /// it for its next turn.
    pub fn finish(
        &mut self,
        id: &str,
        messages: Vec<ChatMessage>,
        tools: Vec<String>,
        prompt: Prompt,
        s: Sampled,
    ) {
        let Some(session) = self.open.get_mut(id) else {
            return;
        };
        session.context = prompt.tokens.clone();
        session.context.extend_from_slice(s.response_ids);
        session.turns.push(Turn {
            context_len: prompt.context_len,
            obs_ids: prompt.new_tokens().to_vec(),
            response_ids: s.response_ids.to_vec(),
            response_logprobs: s.response_logprobs.to_vec(),
            policy_version: s.policy_version,
            observation_text: prompt.observation_text,
            action_text: s.text,
            tool_call_error: s.tool_call_error,
            context_rebuilt: prompt.rebuilt,
        });
        session.history = messages;
        session.tools = tools;
        session.reply = s.reply;
        session.busy = false;
        session.touched = Instant::now();
    }

    /// Frees session `id` after a failed completion; a session with no turn is forgotten.
    pub fn release(&mut self, id: &str) {
        if let Some(session) = self.open.get_mut(id) {
            session.busy = false;
            if session.turns.is_empty() {
                self.open.remove(id);
            }
        }
    }

    /// Closes session `id` with its reward(s) and returns its steps.
    pub fn close(&mut self, id: &str, req: &CloseRequest) -> Result<ClosedTrajectory, ApiError> {
        let Some(session) = self.open.get(id) else {
            return Err(ApiError::not_found(format!("no open session `{id}`")));
        };
        if session.busy {
            return Err(ApiError::invalid(
                None,
                format!("session `{id}` has a completion in flight; close it after the reply"),
            )
            .with_code(StatusCode::CONFLICT, "session_busy"));
        }
        let rewards = step_rewards(req, session.turns.len())?;
        let session = self.open.remove(id).expect("checked above");
        let penalty = self.tool_call_penalty;
        let last = session.turns.len() - 1;
        let records = session
            .turns
            .into_iter()
            .zip(rewards)
            .enumerate()
            .map(|(i, (turn, reward))| {
                let end = i == last;
                let format_penalty = if turn.tool_call_error { penalty } else { 0.0 };
                StepRecord {
                    step_index: i as u32,
                    env_tag: session.env_tag.clone(),
                    seed: session.env_seed,
                    policy_version: turn.policy_version,
                    context_len: turn.context_len as u32,
                    state_hash: stable_hash(turn.observation_text.as_bytes()),
                    obs_ids: turn.obs_ids,
                    response_ids: turn.response_ids,
                    response_logprobs: turn.response_logprobs,
                    reward: reward + format_penalty,
                    terminated: end && !req.truncated,
                    truncated: end && req.truncated,
                    info: StepInfo {
                        success: end && req.success,
                        action_is_valid: !turn.tool_call_error,
                        action_is_effective: true,
                        format_penalty,
                        num_actions: 1,
                        observation_text: turn.observation_text,
                        action_text: turn.action_text,
                        tool_call_error: turn.tool_call_error,
                        context_rebuilt: turn.context_rebuilt,
                    },
                    ..StepRecord::default()
                }
            })
            .collect();
        Ok(ClosedTrajectory {
            session: id.to_string(),
            task: session.task,
            records,
        })
    }

    /// Drops the sessions idle longer than the time to live; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let before = self.open.len();
        let ttl = self.ttl;
        self.open
            .retain(|_, s| s.busy || now.duration_since(s.touched) <= ttl);
        before - self.open.len()
    }
}

/// The messages after the last reply when `messages` continue `session` (its last request's
/// messages and tools, then that reply as an assistant message — the same text, the same
/// calls —, then at least one more message).
fn continued<'m>(
    session: &Session,
    messages: &'m [ChatMessage],
    tools: &[String],
) -> Option<&'m [ChatMessage]> {
    let n = session.history.len();
    if session.turns.is_empty()
        || messages.len() < n + 2
        || messages[..n] != session.history[..]
        || tools != session.tools
    {
        return None;
    }
    let (reply, sent) = (&messages[n], &session.reply);
    (reply.role == "assistant"
        && reply.content_text().trim() == sent.content_text().trim()
        && reply.tool_calls == sent.tool_calls)
        .then(|| &messages[n + 1..])
}

/// The prompt of `messages` offering `tools`, rendered whole (a fresh context).
pub fn fresh_prompt(
    tok: &Tokenizer,
    messages: &[ChatMessage],
    tools: &[String],
) -> Result<Prompt, ApiError> {
    let tokens = ChatTemplate
        .conversation_with_tools(tok, &as_messages(messages), tools)
        .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
    Ok(Prompt {
        tokens,
        context_len: 0,
        observation_text: transcript(messages),
        rebuilt: false,
    })
}

fn as_messages(messages: &[ChatMessage]) -> Vec<Message<'_>> {
    messages.iter().map(ChatMessage::as_message).collect()
}

/// The messages as one text: the content alone for a single plain message, `role: content`
/// lines otherwise, with each tool call as `name(arguments)` and each tool result under the id
/// of its call.
fn transcript(messages: &[ChatMessage]) -> String {
    let line = |m: &ChatMessage| {
        let mut text = match &m.tool_call_id {
            Some(id) => format!("{} ({id}): {}", m.role, m.content_text()),
            None => format!("{}: {}", m.role, m.content_text()),
        };
        for call in &m.tool_calls {
            text.push_str(&format!(" [{}({})]", call.name, call.arguments));
        }
        text
    };
    match messages {
        [one] if one.tool_calls.is_empty() && one.tool_call_id.is_none() => {
            one.content_text().to_string()
        }
        many => many.iter().map(line).collect::<Vec<_>>().join("\n"),
    }
}

fn step_rewards(req: &CloseRequest, steps: usize) -> Result<Vec<f32>, ApiError> {
    let rewards =
        match (req.reward, &req.rewards) {
            (Some(r), None) => {
                let mut v = vec![0.0; steps];
                v[steps - 1] = r;
                v
            }
            (None, Some(v)) if v.len() == steps => v.clone(),
            (None, Some(v)) => {
                return Err(ApiError::invalid(
                    Some("rewards"),
                    format!("{} rewards for a session of {steps} steps", v.len()),
                ))
            }
            _ => return Err(ApiError::invalid(
                Some("reward"),
                "give `reward` (the trajectory's, on its last step) or `rewards` (one per step)",
            )),
        };
    if let Some(bad) = rewards.iter().position(|r| !r.is_finite()) {
        return Err(ApiError::invalid(
            Some("rewards"),
            format!("reward {bad} is not finite"),
        ));
    }
    Ok(rewards)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::api::{ToolChoice, ToolSet};

    fn completion(messages: &[(&str, &str)]) -> Completion {
        Completion {
            messages: messages
                .iter()
                .map(|(r, c)| ChatMessage::text(r, c))
                .collect(),
            max_tokens: None,
            temperature: 1.0,
            top_p: 1.0,
            stop: Vec::new(),
            seed: None,
            n: 1,
            stream: false,
            include_usage: false,
            logprobs: false,
            session: Some("s".into()),
            task: Some("t".into()),
            env_tag: None,
            env_seed: None,
            tools: ToolSet {
                schemas: Vec::new(),
                names: Vec::new(),
                choice: ToolChoice::None,
                parallel: true,
            },
        }
    }

    fn sample(tok: &Tokenizer, text: &str) -> (Vec<u32>, Vec<f32>) {
        let mut ids = tok.encode(text);
        ids.push(tok.eos_id());
        let lps = vec![-0.5; ids.len()];
        (ids, lps)
    }

    /// Begins completion `c` in session `id`, replies `text` (ending with the end-of-turn
    /// token) under `version`; returns the prompt and the sampled ids.
    fn take_turn(
        sessions: &mut Sessions,
        tok: &Tokenizer,
        id: &str,
        c: &Completion,
        text: &str,
        version: u64,
    ) -> (Prompt, Vec<u32>) {
        let prompt = sessions.begin(tok, id, c).unwrap();
        let (ids, lps) = sample(tok, text);
        let sampled = Sampled {
            response_ids: &ids,
            response_logprobs: &lps,
            text: text.into(),
            reply: ChatMessage::text("assistant", text),
            tool_call_error: false,
            policy_version: version,
        };
        sessions.finish(id, c.messages.clone(), Vec::new(), prompt.clone(), sampled);
        (prompt, ids)
    }

    #[test]
    fn a_continued_conversation_extends_its_context_in_token_space() {
        let tok = Tokenizer::builtin();
        let mut sessions = Sessions::new(Duration::from_secs(60), -0.1);
        let first = completion(&[("system", "Play."), ("user", "Turn 1: go")]);
        let (p1, ids) = take_turn(&mut sessions, &tok, "s", &first, "<answer>Left</answer>", 3);
        assert_eq!(p1.context_len, 0);
        let second = completion(&[
            ("system", "Play."),
            ("user", "Turn 1: go"),
            ("assistant", "<answer>Left</answer>"),
            ("user", "Turn 2: go"),
        ]);
        let p2 = sessions.begin(&tok, "s", &second).unwrap();
        let mut expected = p1.tokens.clone();
        expected.extend(&ids);
        assert_eq!(&p2.tokens[..expected.len()], &expected[..]);
        assert_eq!(p2.context_len, expected.len());
        // The same conversation rendered whole gives the same tokens (the reply tokenises back).
        let whole = ChatTemplate
            .conversation(&tok, &as_messages(&second.messages))
            .unwrap();
        assert_eq!(p2.tokens, whole);
        assert_eq!(p2.observation_text, "Turn 2: go");
        // A second request while the first is in flight is refused.
        assert_eq!(
            sessions.begin(&tok, "s", &second).unwrap_err().status,
            StatusCode::CONFLICT
        );
    }

    #[test]
    fn idle_sessions_expire_but_not_busy_ones() {
        let tok = Tokenizer::builtin();
        let mut sessions = Sessions::new(Duration::from_millis(0), -0.1);
        let c = completion(&[("user", "Turn 1")]);
        sessions.begin(&tok, "busy", &c).unwrap();
        take_turn(&mut sessions, &tok, "idle", &c, "Up", 0);
        let later = Instant::now() + Duration::from_millis(5);
        assert_eq!(sessions.expire(later), 1);
        assert_eq!(sessions.open_count(), 1);
        assert_eq!(
            sessions.begin(&tok, "busy", &c).unwrap_err().status,
            StatusCode::CONFLICT
        );
    }

    #[test]
    fn an_edited_history_starts_a_fresh_context() {
        let tok = Tokenizer::builtin();
        let mut sessions = Sessions::new(Duration::from_secs(60), -0.1);
        let first = completion(&[("user", "Turn 1")]);
        take_turn(&mut sessions, &tok, "s", &first, "Up", 0);
        let edited = completion(&[
            ("user", "Turn 1"),
            ("assistant", "Down"),
            ("user", "Turn 2"),
        ]);
        let p2 = sessions.begin(&tok, "s", &edited).unwrap();
        assert_eq!(p2.context_len, 0);
        assert!(p2.rebuilt);
        assert!(p2.observation_text.contains("assistant: Down"));
    }

    #[test]
    fn closing_assigns_rewards_and_end_flags() {
        let tok = Tokenizer::builtin();
        let mut sessions = Sessions::new(Duration::from_secs(60), -0.1);
        let mut messages = vec![("user", "Turn 1")];
        for turn in 0..3 {
            let c = completion(&messages);
            take_turn(&mut sessions, &tok, "s", &c, "Left", turn);
            messages.push(("assistant", "Left"));
            messages.push(("user", "next"));
        }
        let bad = CloseRequest {
            reward: None,
            rewards: Some(vec![1.0]),
            success: true,
            truncated: false,
        };
        assert_eq!(
            sessions.close("s", &bad).unwrap_err().param.as_deref(),
            Some("rewards")
        );
        let ok = CloseRequest {
            reward: Some(1.0),
            rewards: None,
            ..bad
        };
        let closed = sessions.close("s", &ok).unwrap();
        let rewards: Vec<f32> = closed.records.iter().map(|r| r.reward).collect();
        assert_eq!(rewards, vec![0.0, 0.0, 1.0]);
        assert!(closed.records[2].terminated && closed.records[2].info.success);
        assert!(!closed.records[1].is_last());
        assert_eq!(closed.records[2].policy_version, 2);
        // Each context extends the last.
        let mut len = 0;
        for r in &closed.records {
            assert_eq!(r.context_len as usize, len);
            len += r.obs_ids.len() + r.response_ids.len();
        }
        assert_eq!(
            sessions.close("s", &ok).unwrap_err().status,
            StatusCode::NOT_FOUND
        );
    }
}
