//! `stepppo env serve`: stepppo's own environments served over HTTP/JSON to agents in another
//! process, so an outside agent (a Python tool loop on the official `openai` client, say) plays
//! exactly the episodes an in-process rollout plays, through the same agent protocol: the
//! system prompt, the first user message, the functions offered (in tool mode, `tools: true`),
//! the parsing of each reply and the next message. The agent asks its model through the gateway
//! and hands each reply here; rewards come back per turn, for it to close its gateway session
//! with. This is the *agent protocol*, under `/agent/` (the bodies are in
//! `docs/guides/env-server.md`):
//!
//! - `GET /agent/spec`: the env's name and, in tool mode, its functions;
//! - `POST /agent/reset {seed}`: a new episode: `env_id`, `system`, `user`, `tools`;
//! - `POST /agent/step {env_id, message}`: the assistant message as the model's API returned it
//!   (`content`, `tool_calls`): the reward, whether the episode ended, and what comes next (the
//!   tool results, one per call that ran, with the call's id, or a user message);
//! - `POST /agent/close {env_id}`.
//!
//! It is not the *env bridge protocol* (`/spec`, `/reset`, `/step`, `/close` with raw
//! observations and actions, which stepppo's `remote` env speaks as a client): those routes
//! answer 404 with an error saying which protocol this server speaks. Every refusal is a 4xx with
//! `{"error": …}` naming the field; the newest 4096 episodes are kept.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::env::{build_session, AgentSession, EnvError, TurnOutcome};
use crate::tokenizer::tool_calls::{ParsedCall, ParsedReply, ToolCallFormat};

/// Episodes kept at once; the oldest is dropped beyond it (an agent may die without closing).
const MAX_EPISODES: usize = 4096;

/// The env every episode is built from.
#[derive(Clone, Debug)]
pub struct EnvSpec {
    /// Environment name (`stepppo env list`).
    pub env: String,
    /// Env and protocol keys.
    pub config: Value,
}

struct Episodes {
    spec: EnvSpec,
    /// The `GET /spec` answer, made once from a probe session.
    described: Value,
    next_id: u64,
    /// Episode id → (creation order, session).
    open: HashMap<String, (u64, Arc<Mutex<AgentSession>>)>,
}

type Shared = Arc<Mutex<Episodes>>;

/// A refused request: status and message.
struct Refusal(StatusCode, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

fn bad(message: impl Into<String>) -> Refusal {
    Refusal(StatusCode::BAD_REQUEST, message.into())
}

fn env_failed(e: EnvError) -> Refusal {
    Refusal(StatusCode::BAD_GATEWAY, e.to_string())
}

/// Checks that `spec` builds, binds `addr` and serves until the process ends; `on_ready` gets
/// the bound address.
pub fn serve_env(
    spec: EnvSpec,
    addr: &str,
    on_ready: impl FnOnce(SocketAddr),
) -> anyhow::Result<()> {
    let probe = build_session(&spec.env, &spec.config)?;
    let described = json!({
        "name": spec.env,
        "tools": tools_json(&probe),
        "max_turns": probe.protocol().max_turns,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        on_ready(listener.local_addr()?);
        let shared = Arc::new(Mutex::new(Episodes {
            spec,
            described,
            next_id: 0,
            open: HashMap::new(),
        }));
        axum::serve(listener, router(shared)).await?;
        Ok(())
    })
}

fn router(shared: Shared) -> Router {
    Router::new()
        .route("/agent/spec", get(spec))
        .route("/agent/reset", post(reset))
        .route("/agent/step", post(step))
        .route("/agent/close", post(close))
        .route("/spec", get(bridge_route))
        .route("/reset", post(bridge_route))
        .route("/step", post(bridge_route))
        .route("/close", post(bridge_route))
        .with_state(shared)
}

/// The env bridge protocol's routes, which this server does not speak: a 404 saying so, which a
/// `remote` env pointed here reports.
async fn bridge_route() -> Response {
    let error = "this is `stepppo env serve`, which speaks the agent protocol (GET /agent/spec, \
                 POST /agent/reset, /agent/step, /agent/close: chat messages in and out), not \
                 the env bridge protocol an `env_type: remote` client expects (docs/guides/env-server.md)";
    (
        StatusCode::NOT_FOUND,
        [("content-type", "application/json")],
        json!({ "error": error }).to_string(),
    )
        .into_response()
}

/// The request body's fields `names`, in order; a body that is not a JSON object, holds another
/// key or lacks one is refused naming it.
fn fields<const N: usize>(body: &[u8], names: [&str; N]) -> Result<[Value; N], Refusal> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("request body: {e}")))?;
    let Value::Object(mut object) = value else {
        return Err(bad("request body: not a JSON object"));
    };
    if let Some(other) = object.keys().find(|k| !names.contains(&k.as_str())) {
        return Err(bad(format!(
            "`{other}`: unknown field (expected {})",
            names.join(", ")
        )));
    }
    Ok(names.map(|name| object.remove(name).unwrap_or(Value::Null)))
}

/// Field `name` read as a `T`; the refusal names it.
fn field<T: for<'de> Deserialize<'de>>(name: &str, value: Value) -> Result<T, Refusal> {
    if value.is_null() {
        return Err(bad(format!("`{name}` is missing")));
    }
    serde_json::from_value(value).map_err(|e| bad(format!("`{name}`: {e}")))
}

fn tools_json(session: &AgentSession) -> Vec<Value> {
    let schemas = session.tool_schemas();
    schemas
        .iter()
        .map(|t| serde_json::from_str(t).expect("the env's tool schemas are JSON"))
        .collect()
}

async fn spec(State(shared): State<Shared>) -> Json<Value> {
    Json(shared.lock().described.clone())
}

async fn reset(State(shared): State<Shared>, body: axum::body::Bytes) -> Response {
    let seed: u64 = match fields(&body, ["seed"]).and_then(|[seed]| field("seed", seed)) {
        Ok(seed) => seed,
        Err(e) => return e.into_response(),
    };
    let spec = shared.lock().spec.clone();
    let result = tokio::task::spawn_blocking(move || {
        let mut session = build_session(&spec.env, &spec.config)?;
        let user = session.reset(seed)?;
        Ok::<_, EnvError>((session, user))
    })
    .await
    .expect("the reset task does not panic");
    let (session, user) = match result {
        Ok(done) => done,
        Err(e) => return env_failed(e).into_response(),
    };
    let body = json!({
        "system": session.system_prompt(),
        "user": user,
        "tools": tools_json(&session),
    });
    let mut episodes = shared.lock();
    let id = format!("ep-{}", episodes.next_id);
    let order = episodes.next_id;
    episodes.next_id += 1;
    episodes
        .open
        .insert(id.clone(), (order, Arc::new(Mutex::new(session))));
    if episodes.open.len() > MAX_EPISODES {
        let oldest = episodes
            .open
            .iter()
            .min_by_key(|(_, (order, _))| *order)
            .map(|(id, _)| id.clone());
        if let Some(oldest) = oldest {
            episodes.open.remove(&oldest);
        }
    }
    let mut body = body;
    body["env_id"] = json!(id);
    Json(body).into_response()
}

/// An assistant message as the OpenAI API returns it (the fields read here).
#[derive(Deserialize)]
struct AssistantMessage {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<WireCall>,
}

#[derive(Deserialize)]
struct WireCall {
    #[serde(default)]
    id: Option<String>,
    function: WireFunction,
}

#[derive(Deserialize)]
struct WireFunction {
    name: String,
    arguments: String,
}

fn episode(shared: &Shared, id: &str) -> Result<Arc<Mutex<AgentSession>>, Refusal> {
    shared
        .lock()
        .open
        .get(id)
        .map(|(_, s)| s.clone())
        .ok_or_else(|| {
            Refusal(
                StatusCode::NOT_FOUND,
                format!("`env_id`: no open episode `{id}`"),
            )
        })
}

/// What the message says in tool mode: its calls, or its content read in the built-in Hermes
/// format (a call the gateway could not parse comes back as content, and is read as malformed
/// here too).
fn reply_of(message: &AssistantMessage, known: &[&str]) -> ParsedReply {
    if message.tool_calls.is_empty() {
        let content = message.content.as_deref().unwrap_or_default();
        return ToolCallFormat::Hermes.parse(content, known);
    }
    let calls = message
        .tool_calls
        .iter()
        .map(|c| ParsedCall {
            name: c.function.name.clone(),
            arguments: c.function.arguments.clone(),
        })
        .collect();
    ParsedReply::Calls {
        content: message.content.clone(),
        calls,
    }
}

async fn step(State(shared): State<Shared>, body: axum::body::Bytes) -> Response {
    let read = fields(&body, ["env_id", "message"]).and_then(|[id, message]| {
        Ok((
            field::<String>("env_id", id)?,
            field::<AssistantMessage>("message", message)?,
        ))
    });
    let (env_id, message) = match read {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let session = match episode(&shared, &env_id) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let result = tokio::task::spawn_blocking(move || {
        let mut session = session.lock();
        if session.is_done() {
            return Err(Refusal(
                StatusCode::CONFLICT,
                format!("`env_id`: episode `{env_id}` is over"),
            ));
        }
        let message = &message;
        let content = message.content.clone().unwrap_or_default();
        let outcome = match session.protocol().tools {
            true => {
                let reply = reply_of(message, &session.tool_names());
                session.act_reply(&content, &reply)
            }
            false => session.act(&content),
        };
        let ids: Vec<String> = message
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, c)| c.id.clone().unwrap_or_else(|| format!("call_{i}")))
            .collect();

        outcome.map(|o| (o, ids)).map_err(env_failed)
    })
    .await
    .expect("the step task does not panic");
    match result {
        Ok((outcome, ids)) => Json(step_body(&outcome, &ids)).into_response(),
        Err(e) => e.into_response(),
    }
}

fn step_body(outcome: &TurnOutcome, call_ids: &[String]) -> Value {
    let results: Vec<Value> = outcome
        .tool_results
        .iter()
        .enumerate()
        .map(|(i, content)| {
            let id = call_ids
                .get(i)
                .cloned()
                .unwrap_or_else(|| format!("call_{i}"));
            json!({ "tool_call_id": id, "content": content })
        })
        .collect();
    let metrics: BTreeMap<&str, Value> = outcome
        .metrics
        .iter()
        .map(|(k, v)| (k.as_str(), number(*v)))
        .collect();
    let info = &outcome.info;
    json!({
        "reward": number(outcome.reward),
        "terminated": outcome.terminated,
        "truncated": outcome.truncated,
        "done": outcome.followup().is_none(),
        "tool_results": results,
        "user": outcome.next_user_message,
        "info": {
            "success": info.success,
            "action_is_valid": info.action_is_valid,
            "tool_call_error": info.tool_call_error,
            "metrics": metrics,
        },
    })
}

/// `x` as JSON with its shortest f32 spelling (0.1, not 0.10000000149011612); `null` when not
/// finite.
fn number(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}

async fn close(State(shared): State<Shared>, body: axum::body::Bytes) -> Response {
    match fields(&body, ["env_id"]).and_then(|[id]| field::<String>("env_id", id)) {
        Ok(id) => {
            shared.lock().open.remove(&id);
            Json(json!({})).into_response()
        }
        Err(e) => e.into_response(),
    }
}
