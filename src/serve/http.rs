//! The gateway's HTTP side (axum): the routes, the body limit, the request parsing that names
//! the field at fault, and the answers: JSON bodies, server-sent events for `stream: true`, and
//! OpenAI-style error bodies for every failure (unknown routes included). Each handler hands its
//! work to the generation thread as a [`Job`] and awaits the reply; nothing here touches a model.
//!
//! Every route answers 401 first when the gateway has an API key and the request lacks it.
//! Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`,
//! `POST /v1/sessions/{id}/close`, `GET /v1/stats`, `GET /health`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use crossbeam::channel::Sender;
use futures_util::stream::{self, Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use super::api::{logprob_entries, ApiError, ChatRequest};
use super::auth::ApiKey;
use super::session::CloseRequest;
use super::worker::{Finished, Job, Reply};
use crate::tokenizer::ToolCall;

/// Header naming the session (trajectory) of a completion; the `user` field is the fallback.
pub const SESSION_HEADER: &str = "x-session-id";
/// Header naming the task (group) of a session; `metadata.task` is the fallback.
pub const TASK_HEADER: &str = "x-task-id";
/// Response header: the policy version that generated the reply.
pub const VERSION_HEADER: &str = "x-policy-version";

/// What every handler reads.
pub struct Gate {
    pub model_name: String,
    /// Requests without this key are answered 401 (none: every request is served).
    pub api_key: Option<ApiKey>,
    pub jobs: Sender<Job>,
    /// Completions answered so far (their ids count up from the server's start time).
    pub completions: AtomicU64,
    pub started: u64,
}

impl Gate {
    fn next_id(&self) -> String {
        let n = self.completions.fetch_add(1, Ordering::Relaxed);
        format!("chatcmpl-{:x}-{n}", self.started)
    }
}

type Shared = Arc<Gate>;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

pub fn router(gate: Shared, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/sessions/{id}/close", post(close))
        .route("/v1/stats", get(stats))
        .fallback(|| async { ApiError::not_found("no such route (the gateway serves /v1/models, /v1/chat/completions, /v1/sessions/{id}/close, /v1/stats)") })
        .method_not_allowed_fallback(|| async {
            ApiError::invalid(None, "method not allowed on this route")
                .with_code(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed")
        })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(middleware::from_fn_with_state(gate.clone(), authorize))
        .with_state(gate)
}

/// Answers 401 before any route (unknown ones and `/health` included) when the gateway has an
/// API key and the request does not carry it.
async fn authorize(State(g): State<Shared>, request: Request, next: Next) -> Response {
    if let Some(key) = &g.api_key {
        let sent = request
            .headers()
            .get(AUTHORIZATION)
            .map(HeaderValue::as_bytes);
        if !key.admits(sent) {
            let message = if sent.is_none() {
                "no API key: send `Authorization: Bearer <key>` (the OpenAI clients' api_key)"
            } else {
                "incorrect API key"
            };
            return ApiError::invalid(None, message)
                .with_code(StatusCode::UNAUTHORIZED, "invalid_api_key")
                .into_response();
        }
    }
    next.run(request).await
}

fn model_object(name: &str) -> Value {
    json!({"id": name, "object": "model", "created": 0, "owned_by": "stepppo"})
}

async fn models(State(g): State<Shared>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&g.model_name)]}))
}

async fn model(State(g): State<Shared>, Path(id): Path<String>) -> Response {
    if id != g.model_name {
        return ApiError::not_found(format!("model `{id}` is not served here")).into_response();
    }
    Json(model_object(&g.model_name)).into_response()
}

/// Parses a JSON body, naming the field at fault.
fn parse<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|e| {
        let status = e.status();
        let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "request_too_large"
        } else {
            "invalid_body"
        };
        ApiError::invalid(None, e.body_text()).with_code(status, code)
    })?;
    let de = &mut serde_json::Deserializer::from_slice(&bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let param = (path != ".").then_some(path.as_str());
        ApiError::invalid(param, format!("malformed request body: {}", e.inner()))
    })
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

fn send(g: &Gate, job: Job) -> Result<(), ApiError> {
    g.jobs.send(job).map_err(|_| {
        ApiError::internal("the generation thread has stopped")
            .with_code(StatusCode::SERVICE_UNAVAILABLE, "unavailable")
    })
}

async fn chat(
    State(g): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let request: ChatRequest = parse(body)?;
    let completion = request.check(
        &g.model_name,
        header(&headers, SESSION_HEADER),
        header(&headers, TASK_HEADER),
    )?;
    let stream = completion.stream;
    let include_usage = completion.include_usage;
    let n = completion.n;
    let id = g.next_id();
    let (tx, mut rx) = mpsc::unbounded_channel();
    send(
        &g,
        Job::Complete {
            completion: Box::new(completion),
            reply: tx,
        },
    )?;
    if !stream {
        loop {
            match rx.recv().await {
                Some(Reply::Delta { .. }) => continue,
                Some(Reply::Done(done)) => {
                    return Ok(completion_response(&g.model_name, id, done?))
                }
                None => {
                    return Err(ApiError::internal(
                        "the generation thread dropped the request",
                    ))
                }
            }
        }
    }
    // Wait for the first word: a request refused by the generation thread answers with its
    // status, not with an event stream.
    let first = match rx.recv().await {
        Some(Reply::Done(Err(e))) => return Err(e),
        Some(first) => first,
        None => {
            return Err(ApiError::internal(
                "the generation thread dropped the request",
            ))
        }
    };
    let chunks = ChunkWriter {
        id,
        model: g.model_name.clone(),
        include_usage,
    };
    let opening: Vec<Value> = (0..n).map(|c| chunks.role(c)).collect();
    let rest = stream::unfold((Some(first), rx), |(pending, mut rx)| async move {
        let next = match pending {
            Some(reply) => reply,
            None => rx.recv().await?,
        };
        Some((next, (None, rx)))
    });
    let events = stream::iter(opening)
        .chain(rest.flat_map(move |reply| stream::iter(chunks.of(reply))))
        .map(|v| Event::default().data(v.to_string()))
        .chain(stream::once(async { Event::default().data("[DONE]") }))
        .map(Ok::<_, Infallible>);
    Ok(sse(events))
}

fn sse(events: impl Stream<Item = Result<Event, Infallible>> + Send + 'static) -> Response {
    Sse::new(events).into_response()
}

fn completion_response(model: &str, id: String, f: Finished) -> Response {
    let choices: Vec<Value> = f
        .choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut message = json!({"role": "assistant", "content": c.content});
            if !c.tool_calls.is_empty() {
                message["tool_calls"] = tool_calls_json(&c.tool_calls, false);
            }
            json!({
                "index": i,
                "message": message,
                "logprobs": if c.logprobs.is_empty() { Value::Null } else { logprob_entries(&c.logprobs) },
                "finish_reason": c.finish_reason,
            })
        })
        .collect();
    let body = json!({
        "id": id, "object": "chat.completion", "created": f.created, "model": model,
        "system_fingerprint": format!("stepppo-v{}", f.policy_version),
        "choices": choices, "usage": f.usage,
    });
    let mut response = Json(body).into_response();
    response
        .headers_mut()
        .insert(VERSION_HEADER, HeaderValue::from(f.policy_version));
    response
}

/// Builds the `chat.completion.chunk` bodies of one stream.
struct ChunkWriter {
    id: String,
    model: String,
    include_usage: bool,
}

impl ChunkWriter {
    fn chunk(&self, choices: Value, usage: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id, "object": "chat.completion.chunk", "created": 0, "model": self.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }

    fn role(&self, choice: usize) -> Value {
        self.chunk(
            json!([{"index": choice, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
            None,
        )
    }

    /// The chunks of one reply: a content delta, or the finish chunks (and usage) at the end.
    fn of(&self, reply: Reply) -> Vec<Value> {
        match reply {
            Reply::Delta {
                choice,
                text,
                logprobs,
            } => {
                let lp = if logprobs.is_empty() {
                    Value::Null
                } else {
                    logprob_entries(&logprobs)
                };
                vec![self.chunk(
                    json!([{"index": choice, "delta": {"content": text}, "logprobs": lp, "finish_reason": null}]),
                    None,
                )]
            }
            Reply::Done(Ok(f)) => {
                let calls = f
                    .choices
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| !c.tool_calls.is_empty())
                    .map(|(i, c)| {
                        let delta = json!({"tool_calls": tool_calls_json(&c.tool_calls, true)});
                        self.chunk(
                            json!([{"index": i, "delta": delta, "logprobs": null, "finish_reason": null}]),
                            None,
                        )
                    });
                let ends = f.choices.iter().enumerate().map(|(i, c)| {
                    self.chunk(
                        json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": c.finish_reason}]),
                        None,
                    )
                });
                let mut out: Vec<Value> = calls.chain(ends).collect();
                if self.include_usage {
                    out.push(self.chunk(json!([]), Some(json!(f.usage))));
                }
                out
            }
            Reply::Done(Err(e)) => vec![e.body()],
        }
    }
}

/// `tool_calls` of a message, or of a stream delta (which numbers each call with `index`).
fn tool_calls_json(calls: &[ToolCall], indexed: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let mut call = json!({
                "id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            });
            if indexed {
                call["index"] = json!(k);
            }
            call
        })
        .collect()
}

async fn close(
    State(g): State<Shared>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let request: CloseRequest = parse(body)?;
    let (tx, rx) = oneshot::channel();
    send(
        &g,
        Job::Close {
            session: id,
            request,
            reply: tx,
        },
    )?;
    let answer = rx
        .await
        .map_err(|_| ApiError::internal("the generation thread dropped the request"))?;
    Ok(Json(answer?))
}

async fn stats(State(g): State<Shared>) -> Result<Json<Value>, ApiError> {
    let (tx, rx) = oneshot::channel();
    send(&g, Job::Stats { reply: tx })?;
    rx.await
        .map(Json)
        .map_err(|_| ApiError::internal("the generation thread dropped the request"))
}
