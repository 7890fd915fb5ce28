//! The OpenAI wire format of the gateway: the chat-completion request as clients send it (every
//! field named, unknown ones rejected), its checks, the response and stream-chunk bodies, and the
//! OpenAI-style error body every failure answers with. It knows nothing of models or sessions:
//! [`ChatRequest::check`] turns a request into the [`Completion`] the worker runs.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use axum::http::StatusCode;

/// One failed request: an HTTP status and the OpenAI error body (`message`, `type`, `param`,
/// `code`).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub code: &'static str,
}

impl ApiError {
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.map(str::to_string),
            code: "invalid_request",
        }
    }

    pub fn with_code(mut self, status: StatusCode, code: &'static str) -> Self {
        self.status = status;
        self.code = code;
        self
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::invalid(None, message).with_code(StatusCode::NOT_FOUND, "not_found")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::invalid(None, message).with_code(StatusCode::INTERNAL_SERVER_ERROR, "internal")
    }

    /// The body OpenAI's clients parse into their `APIError`.
    pub fn body(&self) -> Value {
        let kind = if self.status.is_server_error() {
            "server_error"
        } else {
            "invalid_request_error"
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}})
    }
}

/// A message as the client sent it: `content` a string or a list of text parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireMessage {
    pub role: String,
    pub content: Option<Content>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// `stop`: one string or up to four.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `POST /v1/chat/completions` as the official clients send it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<WireMessage>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub stop: Option<Stop>,
    pub seed: Option<u64>,
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u32>,
    /// The session (trajectory) this turn belongs to, when no `x-session-id` header names it.
    pub user: Option<String>,
    /// `task` (the group of sessions), `env` (the env tag of its records), `seed`.
    pub metadata: Option<serde_json::Map<String, Value>>,
}

/// A checked chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// A checked request: what the worker needs to render, generate and record it.
#[derive(Debug, Clone)]
pub struct Completion {
    pub messages: Vec<ChatMessage>,
    /// `None`: as many as the context leaves (capped by the server's default).
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_p: f32,
    pub stop: Vec<String>,
    pub seed: Option<u64>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: bool,
    /// The session it continues (the client's id), `None` for a one-off completion.
    pub session: Option<String>,
    pub task: Option<String>,
    pub env_tag: Option<String>,
    pub env_seed: Option<u64>,
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];
const MAX_STOP: usize = 4;
const MAX_N: u32 = 16;

impl ChatRequest {
    /// Checks every field against what the gateway computes exactly; `session_header` is the
    /// `x-session-id` header and `task_header` the `x-task-id` header, when sent.
    pub fn check(
        self,
        served_model: &str,
        session_header: Option<String>,
        task_header: Option<String>,
    ) -> Result<Completion, ApiError> {
        if self.model != served_model {
            return Err(ApiError::invalid(
                Some("model"),
                format!(
                    "model `{}` is not served here (this gateway serves `{served_model}`)",
                    self.model
                ),
            )
            .with_code(StatusCode::NOT_FOUND, "model_not_found"));
        }
        let messages = check_messages(self.messages)?;
        let max_tokens = match (self.max_tokens, self.max_completion_tokens) {
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    Some("max_tokens"),
                    "give `max_tokens` or `max_completion_tokens`, not both",
                ))
            }
            (a, b) => a.or(b),
        };
        if max_tokens == Some(0) {
            return Err(ApiError::invalid(Some("max_tokens"), "must be at least 1"));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                Some("temperature"),
                format!("must be in [0, 2], got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                Some("top_p"),
                format!("must be in (0, 1], got {top_p}"),
            ));
        }
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_N).contains(&n) {
            return Err(ApiError::invalid(
                Some("n"),
                format!("must be in [1, {MAX_N}], got {n}"),
            ));
        }
        if self.top_logprobs.is_some_and(|k| k > 0) {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                "not supported: the gateway returns the log-probability of each sampled token only",
            ));
        }
        let stop = match self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if stop.len() > MAX_STOP || stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                Some("stop"),
                format!("up to {MAX_STOP} non-empty strings"),
            ));
        }
        let metadata = Metadata::parse(self.metadata)?;
        let session = session_header.or(self.user);
        if session.as_deref() == Some("") {
            return Err(ApiError::invalid(Some("user"), "an empty session id"));
        }
        if session.is_some() && n > 1 {
            return Err(ApiError::invalid(
                Some("n"),
                "a recorded session continues one conversation: ask n = 1 per session and group \
                 sessions by task id instead",
            ));
        }
        Ok(Completion {
            messages,
            max_tokens: max_tokens.map(|m| m as usize),
            temperature,
            top_p,
            stop,
            seed: self.seed,
            n: n as usize,
            stream: self.stream,
            include_usage: self.stream_options.is_some_and(|o| o.include_usage),
            logprobs: self.logprobs,
            session,
            task: task_header.or(metadata.task),
            env_tag: metadata.env,
            env_seed: metadata.seed,
        })
    }
}

/// The `metadata` keys the gateway reads (all strings, as OpenAI's API requires).
#[derive(Default)]
struct Metadata {
    task: Option<String>,
    env: Option<String>,
    seed: Option<u64>,
}

impl Metadata {
    fn parse(map: Option<serde_json::Map<String, Value>>) -> Result<Self, ApiError> {
        let mut out = Metadata::default();
        for (key, value) in map.unwrap_or_default() {
            let param = format!("metadata.{key}");
            let Value::String(text) = value else {
                return Err(ApiError::invalid(
                    Some(&param),
                    "metadata values are strings",
                ));
            };
            match key.as_str() {
                "task" => out.task = Some(text),
                "env" => out.env = Some(text),
                "seed" => {
                    out.seed = Some(text.parse().map_err(|_| {
                        ApiError::invalid(
                            Some(&param),
                            format!("`{text}` is not an unsigned integer"),
                        )
                    })?)
                }
                // Other keys are the client's own annotations (OpenAI allows up to 16).
                _ => {}
            }
        }
        Ok(out)
    }
}

fn check_messages(wire: Vec<WireMessage>) -> Result<Vec<ChatMessage>, ApiError> {
    if wire.is_empty() {
        return Err(ApiError::invalid(Some("messages"), "at least one message"));
    }
    wire.into_iter()
        .enumerate()
        .map(|(i, m)| {
            let param = format!("messages[{i}]");
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::invalid(
                    Some(&format!("{param}.role")),
                    format!("unknown role `{}` (known: {})", m.role, ROLES.join(", ")),
                ));
            }
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => text_parts(&param, parts)?,
            };
            let role = if m.role == "developer" {
                "system".into()
            } else {
                m.role
            };
            Ok(ChatMessage { role, content })
        })
        .collect()
}

fn text_parts(param: &str, parts: Vec<ContentPart>) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, part) in parts.into_iter().enumerate() {
        match (part.kind.as_str(), part.text) {
            ("text", Some(t)) => text.push_str(&t),
            (kind, _) => {
                return Err(ApiError::invalid(
                    Some(&format!("{param}.content[{j}]")),
                    format!("content part of type `{kind}` is not supported (text parts only)"),
                ))
            }
        }
    }
    Ok(text)
}

/// Why a choice ended, in OpenAI's words.
pub fn finish_reason_name(length_cut: bool) -> &'static str {
    if length_cut {
        "length"
    } else {
        "stop"
    }
}

/// Token usage of a response.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`: the prompt tokens the prefix cache served.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

/// The `logprobs.content` entries of sampled tokens.
pub fn logprob_entries(pieces: &[(String, f32)]) -> Value {
    let content: Vec<Value> = pieces
        .iter()
        .map(|(text, lp)| {
            json!({"token": text, "logprob": lp, "bytes": text.as_bytes(), "top_logprobs": []})
        })
        .collect();
    json!({ "content": content })
}
