//! The OpenAI-compatible gateway: agents we do not own talk to a stepppo policy through the
//! official OpenAI clients, and every turn they take is recorded as a step.
//!
//! `http` (axum on a tokio runtime of its own thread) speaks the wire format of `api` and hands
//! each request to the generation loop of `worker`, which runs on the thread that calls
//! [`Gateway::serve`] and owns the policy through a [`Backend`]: a fixed policy with an optional
//! dataset recorder (`backend`, what `stepppo serve` runs), or the trainer (gateway training
//! mode, in `train::gateway`). A completion that names a session (header `x-session-id`, or the
//! `user` field) is a step of that session's trajectory (`session`): its prompt extends the
//! session's context in token space, its sampled tokens and log-probs are kept exactly, and
//! `POST /v1/sessions/{id}/close` with the reward(s) turns the session into step records. The
//! protocol, with examples, is in `docs/guides/gateway.md`. Beside the gateway, [`env_server`]
//! serves stepppo's own environments to such agents (`stepppo env serve`).

mod api;
mod auth;
mod backend;
pub mod env_server;
mod http;
mod session;
mod worker;

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam::channel::Receiver;
use tokio::sync::oneshot;

pub use api::{
    check_messages, check_tools, ApiError, ChatMessage, Completion, ToolChoice, ToolSet,
    WireMessage,
};
pub use auth::{is_loopback, ApiKey, API_KEY_ENV};
pub use backend::{PolicyBackend, Recorder};
pub use http::{SESSION_HEADER, TASK_HEADER, VERSION_HEADER};
pub use session::{CloseRequest, ClosedTrajectory, DEFAULT_ENV_TAG};
pub use worker::{Backend, WorkerOptions};

/// Reward added to a recorded step whose tool call did not parse, unless configured (the envs'
/// default format penalty).
pub const DEFAULT_TOOL_CALL_PENALTY: f32 = -0.1;

/// Where and how the gateway serves.
#[derive(Clone, Debug)]
pub struct GatewayOptions {
    /// Address to bind (`127.0.0.1` by default; others need `api_key`).
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    /// The model id clients name (`GET /v1/models` lists it).
    pub model_name: String,
    /// Larger request bodies are refused with 413.
    pub max_body_bytes: usize,
    /// The key every request must send as `Authorization: Bearer <key>` (401 otherwise, nothing
    /// recorded). Required to bind an address other than loopback: the close route posts the
    /// rewards a training run learns from.
    pub api_key: Option<ApiKey>,
    /// Options of the generation loop: reply lengths, context limit, session TTL, seed.
    pub worker: WorkerOptions,
}

impl GatewayOptions {
    /// Defaults for a model with `max_context` positions: loopback, port 8000, 1 MiB bodies,
    /// 256 tokens per reply unless asked, sessions dropped after 10 idle minutes.
    pub fn new(model_name: &str, max_context: usize, seed: u64) -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            model_name: model_name.into(),
            max_body_bytes: 1 << 20,
            api_key: None,
            worker: WorkerOptions {
                default_max_tokens: 256,
                max_context,
                session_ttl: Duration::from_secs(600),
                seed,
                tool_call_penalty: DEFAULT_TOOL_CALL_PENALTY,
            },
        }
    }
}

/// A bound gateway: HTTP is served on a background thread; [`Gateway::serve`] runs the
/// generation loop on the calling thread.
pub struct Gateway {
    addr: SocketAddr,
    jobs: Receiver<worker::Job>,
    opts: WorkerOptions,
    shutdown: oneshot::Sender<()>,
    thread: JoinHandle<std::io::Result<()>>,
}

/// Binds the socket and starts serving HTTP (requests queue until [`Gateway::serve`] runs).
/// Refuses a non-loopback address without an API key.
pub fn start(opts: &GatewayOptions) -> std::io::Result<Gateway> {
    if opts.api_key.is_none() && !is_loopback(&opts.host) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "binding {}: an address other than loopback needs an API key (--api-key, or the \
                 {API_KEY_ENV} environment variable), or anyone who reaches it could post the \
                 rewards a run learns from",
                opts.host
            ),
        ));
    }
    let listener = TcpListener::bind((opts.host.as_str(), opts.port)).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("binding {}:{}: {e}", opts.host, opts.port),
        )
    })?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let (jobs_tx, jobs) = crossbeam::channel::unbounded();
    let gate = Arc::new(http::Gate {
        model_name: opts.model_name.clone(),
        api_key: opts.api_key.clone(),
        jobs: jobs_tx,
        completions: AtomicU64::new(0),
        started: worker::now_secs(),
    });
    let app = http::router(gate, opts.max_body_bytes);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (shutdown, stop) = oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stop.await;
                })
                .await
        })
    });
    Ok(Gateway {
        addr,
        jobs,
        opts: opts.worker.clone(),
        shutdown,
        thread,
    })
}

impl Gateway {
    /// The address actually bound (with the chosen port when `port` was 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// [`Gateway::serve`] on a thread of its own (for tests, benchmarks and embedding).
    pub fn spawn<B: Backend + Send + 'static>(
        self,
        mut backend: B,
    ) -> JoinHandle<anyhow::Result<()>> {
        std::thread::spawn(move || self.serve(&mut backend))
    }

    /// Runs the generation loop with `backend` until it says stop (or HTTP stops), then stops
    /// the HTTP server.
    pub fn serve(self, backend: &mut dyn Backend) -> anyhow::Result<()> {
        let result = worker::run(backend, &self.jobs, &self.opts);
        drop(self.jobs);
        let _ = self.shutdown.send(());
        let http = self
            .thread
            .join()
            .map_err(|_| anyhow::anyhow!("the HTTP thread panicked"))?;
        result?;
        Ok(http?)
    }
}
