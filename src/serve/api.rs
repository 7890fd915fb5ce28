//! The OpenAI wire format of the gateway: the chat-completion request as clients send it (every
//! field named, unknown ones rejected), its checks, the response and stream-chunk bodies, and the
//! OpenAI-style error body every failure answers with. Function calling: `tools`, `tool_choice`,
//! `parallel_tool_calls`, assistant `tool_calls` and `tool` messages in the history, each checked
//! and named when refused. It knows nothing of models or sessions:
//! [`ChatRequest::check`] turns a request into the [`Completion`] the worker runs.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::tokenizer::{Message, ToolCall};

use axum::http::StatusCode;

/// One failed request: an HTTP status and the OpenAI error body (`message`, `type`, `param`,
/// `code`).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status of the response.
    pub status: StatusCode,
    /// Human-readable description (`error.message`).
    pub message: String,
    /// The request field at fault, e.g. `messages[2].role` (`error.param`); `None` when no one
    /// field is.
    pub param: Option<String>,
    /// Machine-readable code (`error.code`), e.g. `invalid_request`.
    pub code: &'static str,
}

impl ApiError {
    /// A 400 `invalid_request` error about `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.map(str::to_string),
            code: "invalid_request",
        }
    }

    /// The same error with another HTTP status and code.
    pub fn with_code(mut self, status: StatusCode, code: &'static str) -> Self {
        self.status = status;
        self.code = code;
        self
    }

    /// A 404 `not_found` error.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::invalid(None, message).with_code(StatusCode::NOT_FOUND, "not_found")
    }

    /// A 500 `internal` error: the server failed, not the request.
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

/// A message as the client sent it: `content` a string or a list of text parts; an assistant
/// message's `tool_calls`, a tool message's `tool_call_id`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool` (others are refused).
    pub role: String,
    /// The text, or a list of text parts; may be absent on an assistant message with tool calls.
    pub content: Option<Content>,
    /// Optional participant name, passed on to the chat template.
    pub name: Option<String>,
    /// An assistant message's calls (refused on other roles).
    pub tool_calls: Option<Vec<WireToolCall>>,
    /// The id of the earlier call a `tool` message answers (refused on other roles).
    pub tool_call_id: Option<String>,
    /// Fields of a response message that clients echo back when they append it as it came:
    /// accepted when null (there is nothing to render), refused otherwise.
    pub refusal: Option<Value>,
    /// Legacy function call of a response message: accepted when null, refused otherwise.
    pub function_call: Option<Value>,
    /// Audio of a response message: accepted when null, refused otherwise.
    pub audio: Option<Value>,
    /// Output metadata of a response message (e.g. URL citations); not rendered.
    #[serde(rename = "annotations")]
    pub _annotations: Option<Vec<Value>>,
    /// The official client's parsed-output field (`chat.completions.parse`/`stream`); not
    /// rendered.
    #[serde(rename = "parsed")]
    pub _parsed: Option<Value>,
}

/// A call in an assistant message of the history.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: WireFunctionCall,
    /// Present when a client rebuilt the message from streamed deltas; not rendered.
    #[serde(rename = "index")]
    pub _index: Option<u32>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireFunctionCall {
    pub name: String,
    /// The arguments as JSON text (as OpenAI's API sends them).
    pub arguments: String,
    /// The official client's parsed copy of the arguments; not rendered.
    #[serde(rename = "parsed_arguments")]
    pub _parsed_arguments: Option<Value>,
}

/// One entry of `tools`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireTool {
    #[serde(rename = "type")]
    kind: String,
    function: WireFunction,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireFunction {
    name: String,
    // Checked for type only: the template reads them from the tool's JSON as sent.
    #[serde(rename = "description")]
    _description: Option<String>,
    parameters: Option<Value>,
    #[serde(rename = "strict")]
    _strict: Option<bool>,
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
    /// Functions the model may call, kept as sent (their JSON reaches the chat template).
    pub tools: Option<Vec<Box<RawValue>>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
}

/// A checked chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool` (`developer` arrives as `system`).
    pub role: String,
    /// `None`: sent as null (an assistant turn that only calls tools).
    pub content: Option<String>,
    /// An assistant message's calls (empty for other roles).
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` message answers; `None` for other roles.
    pub tool_call_id: Option<String>,
    /// The participant name the client sent, if any.
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message of `role` with text `content` only.
    pub fn text(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: Some(content.into()),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    /// The text content (empty when null).
    pub fn content_text(&self) -> &str {
        self.content.as_deref().unwrap_or_default()
    }

    /// The message as the chat template sees it.
    pub fn as_message(&self) -> Message<'_> {
        Message {
            role: &self.role,
            content: self.content.as_deref(),
            tool_calls: &self.tool_calls,
            tool_call_id: self.tool_call_id.as_deref(),
            name: self.name.as_deref(),
        }
    }
}

/// `tool_choice`: whether and which function the reply must call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No calls are read from the reply (the default without tools).
    None,
    /// The model decides (the default with tools).
    Auto,
    /// The reply must call one of the tools.
    Required,
    /// The reply must call this function.
    Function(String),
}

/// The functions a request offers and how the reply may use them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolSet {
    /// Each tool's JSON as sent, for the chat template.
    pub schemas: Vec<String>,
    /// The function names, in order.
    pub names: Vec<String>,
    /// Whether and which function the reply must call.
    pub choice: ToolChoice,
    /// `false`: a reply with more than one call is a malformed call.
    pub parallel: bool,
}

impl ToolSet {
    /// Whether calls are read from the reply.
    pub fn parses_calls(&self) -> bool {
        !self.names.is_empty() && self.choice != ToolChoice::None
    }
}

/// A checked request: what the worker needs to render, generate and record it.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The checked conversation, in order.
    pub messages: Vec<ChatMessage>,
    /// `None`: as many as the context leaves (capped by the server's default).
    pub max_tokens: Option<usize>,
    /// Sampling temperature in [0, 2] (default 1).
    pub temperature: f32,
    /// Nucleus-sampling mass in (0, 1] (default 1).
    pub top_p: f32,
    /// Up to four non-empty stop strings.
    pub stop: Vec<String>,
    /// Sampling seed; `None`: the worker derives one from its own seed.
    pub seed: Option<u64>,
    /// Choices to sample, in 1..=16 (1 when the request continues a session).
    pub n: usize,
    /// Answer with server-sent stream chunks.
    pub stream: bool,
    /// With `stream`, end with a chunk of token usage (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Return the log-probability of each sampled token.
    pub logprobs: bool,
    /// The session it continues (the client's id), `None` for a one-off completion.
    pub session: Option<String>,
    /// The task (group of sessions) it belongs to: the `x-task-id` header, else
    /// `metadata.task`.
    pub task: Option<String>,
    /// The env tag its records carry (`metadata.env`); `None`: the gateway's default tag.
    pub env_tag: Option<String>,
    /// The env seed its records carry (`metadata.seed`); `None`: 0.
    pub env_seed: Option<u64>,
    /// The functions offered and how the reply may call them.
    pub tools: ToolSet,
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
        let tools = check_tools(self.tools, self.tool_choice, self.parallel_tool_calls)?;
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
            tools,
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

/// The messages of a request (or of a logged conversation) checked in order: roles, contents,
/// each tool message answering an earlier call.
pub fn check_messages(wire: Vec<WireMessage>) -> Result<Vec<ChatMessage>, ApiError> {
    if wire.is_empty() {
        return Err(ApiError::invalid(Some("messages"), "at least one message"));
    }
    let mut call_ids: Vec<String> = Vec::new();
    let mut out = Vec::with_capacity(wire.len());
    for (i, m) in wire.into_iter().enumerate() {
        let message = check_message(i, m, &call_ids)?;
        call_ids.extend(message.tool_calls.iter().map(|c| c.id.clone()));
        out.push(message);
    }
    Ok(out)
}

/// Checks message `i`; `call_ids` are the ids of the calls before it.
fn check_message(i: usize, m: WireMessage, call_ids: &[String]) -> Result<ChatMessage, ApiError> {
    let param = |field: &str| format!("messages[{i}].{field}");
    let invalid = |field: &str, message: String| ApiError::invalid(Some(&param(field)), message);
    if !ROLES.contains(&m.role.as_str()) {
        return Err(invalid(
            "role",
            format!("unknown role `{}` (known: {})", m.role, ROLES.join(", ")),
        ));
    }
    for (field, value) in [
        ("refusal", &m.refusal),
        ("function_call", &m.function_call),
        ("audio", &m.audio),
    ] {
        if value.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(invalid(
                field,
                format!("`{field}` is not supported in the history (send null or leave it out)"),
            ));
        }
    }
    let content = match m.content {
        None => None,
        Some(Content::Text(t)) => Some(t),
        Some(Content::Parts(parts)) => Some(text_parts(&format!("messages[{i}]"), parts)?),
    };
    let tool_calls = match m.tool_calls {
        Some(_) if m.role != "assistant" => {
            return Err(invalid(
                "tool_calls",
                format!("only assistant messages carry tool calls, not {}", m.role),
            ))
        }
        Some(calls) if calls.is_empty() => {
            return Err(invalid(
                "tool_calls",
                "an empty list: leave `tool_calls` out instead".into(),
            ))
        }
        Some(calls) => check_calls(i, calls)?,
        None => Vec::new(),
    };
    if content.is_none() && tool_calls.is_empty() {
        return Err(invalid(
            "content",
            format!("a {} message needs content", m.role),
        ));
    }
    match (&m.tool_call_id, m.role.as_str()) {
        (None, "tool") => {
            return Err(invalid(
                "tool_call_id",
                "a tool message names the call it answers".into(),
            ))
        }
        (Some(id), "tool") if !call_ids.contains(id) => {
            return Err(invalid(
                "tool_call_id",
                format!("no earlier assistant message made a call with id `{id}`"),
            ))
        }
        (Some(_), role) if role != "tool" => {
            return Err(invalid(
                "tool_call_id",
                format!("only tool messages answer calls, not {role}"),
            ))
        }
        _ => {}
    }
    let role = if m.role == "developer" {
        "system".into()
    } else {
        m.role
    };
    Ok(ChatMessage {
        role,
        content,
        tool_calls,
        tool_call_id: m.tool_call_id,
        name: m.name,
    })
}

fn check_calls(i: usize, calls: Vec<WireToolCall>) -> Result<Vec<ToolCall>, ApiError> {
    let mut out: Vec<ToolCall> = Vec::with_capacity(calls.len());
    for (k, c) in calls.into_iter().enumerate() {
        let param = format!("messages[{i}].tool_calls[{k}]");
        if c.kind != "function" {
            return Err(ApiError::invalid(
                Some(&format!("{param}.type")),
                format!("`{}`: only `function` calls exist", c.kind),
            ));
        }
        if c.id.is_empty() || out.iter().any(|o| o.id == c.id) {
            return Err(ApiError::invalid(
                Some(&format!("{param}.id")),
                "call ids are non-empty and unique in a message",
            ));
        }
        if c.function.name.is_empty() {
            return Err(ApiError::invalid(
                Some(&format!("{param}.function.name")),
                "empty function name",
            ));
        }
        out.push(ToolCall {
            id: c.id,
            name: c.function.name,
            arguments: c.function.arguments,
        });
    }
    Ok(out)
}

/// OpenAI's rule for function names.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `tools`, `tool_choice` and `parallel_tool_calls` checked into the request's [`ToolSet`].
pub fn check_tools(
    tools: Option<Vec<Box<RawValue>>>,
    choice: Option<Value>,
    parallel: Option<bool>,
) -> Result<ToolSet, ApiError> {
    let tools = tools.unwrap_or_default();
    let mut schemas = Vec::with_capacity(tools.len());
    let mut names: Vec<String> = Vec::with_capacity(tools.len());
    for (i, raw) in tools.iter().enumerate() {
        let param = format!("tools[{i}]");
        let tool: WireTool = serde_json::from_str(raw.get())
            .map_err(|e| ApiError::invalid(Some(&param), format!("not a function tool: {e}")))?;
        if tool.kind != "function" {
            return Err(ApiError::invalid(
                Some(&format!("{param}.type")),
                format!("`{}`: only `function` tools are supported", tool.kind),
            ));
        }
        let name = tool.function.name;
        if !valid_function_name(&name) {
            return Err(ApiError::invalid(
                Some(&format!("{param}.function.name")),
                format!("`{name}`: 1 to 64 letters, digits, `_` or `-`"),
            ));
        }
        if names.contains(&name) {
            return Err(ApiError::invalid(
                Some(&format!("{param}.function.name")),
                format!("`{name}` is offered twice"),
            ));
        }
        if tool
            .function
            .parameters
            .as_ref()
            .is_some_and(|p| !p.is_object())
        {
            return Err(ApiError::invalid(
                Some(&format!("{param}.function.parameters")),
                "a JSON schema object",
            ));
        }
        schemas.push(raw.get().to_string());
        names.push(name);
    }
    let choice = match choice {
        None if names.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(c) => check_tool_choice(c, &names)?,
    };
    Ok(ToolSet {
        schemas,
        names,
        choice,
        parallel: parallel.unwrap_or(true),
    })
}

fn check_tool_choice(choice: Value, names: &[String]) -> Result<ToolChoice, ApiError> {
    let invalid = |m: String| ApiError::invalid(Some("tool_choice"), m);
    let choice = match &choice {
        Value::String(s) if s == "none" => return Ok(ToolChoice::None),
        Value::String(s) if s == "auto" => ToolChoice::Auto,
        Value::String(s) if s == "required" => ToolChoice::Required,
        Value::Object(o) => {
            let name = (o.get("type").and_then(Value::as_str) == Some("function"))
                .then(|| o.get("function")?.get("name")?.as_str())
                .flatten()
                .ok_or_else(|| {
                    invalid(
                        "a named choice is {\"type\": \"function\", \"function\": {\"name\": …}}"
                            .into(),
                    )
                })?;
            if !names.iter().any(|n| n == name) {
                return Err(invalid(format!("`{name}` is not among the tools")));
            }
            ToolChoice::Function(name.to_string())
        }
        other => {
            return Err(invalid(format!(
                "`{other}`: none, auto, required or a named function"
            )))
        }
    };
    if names.is_empty() && choice != ToolChoice::Auto {
        return Err(invalid("a tool choice needs `tools`".into()));
    }
    Ok(choice)
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
pub fn finish_reason_name(length_cut: bool, called_tools: bool) -> &'static str {
    if length_cut {
        "length"
    } else if called_tools {
        "tool_calls"
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
