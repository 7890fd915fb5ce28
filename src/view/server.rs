//! The HTTP side: routes (three pages, two JSON endpoints, two fixed assets; no route takes a
//! file path), the shared state (the current snapshot behind a lock, swapped whole when a live
//! dataset grew), a background task that compares segment sizes every second and re-opens the
//! dataset when they changed (pausing longer after a slow re-open), and the headers every
//! answer carries (a content security policy that allows only this server's own script and
//! stylesheet, `nosniff`, no caching).
//! Requests whose `Host` is not this machine's loopback name are refused while bound to a
//! loopback address (a web page cannot reach the viewer through DNS rebinding).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use parking_lot::RwLock;
use serde_json::{json, Map, Value};

use crate::algo::AdvantageConfig;
use crate::tokenizer::Tokenizer;
use crate::train::run::metrics::read_jsonl;

use super::error::ViewError;
use super::index::Snapshot;
use super::pages;
use super::query::{BadQuery, ListParams, TrajParams};
use super::source::Source;
use super::trajectory;

const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");
/// How often a live dataset's segment sizes are compared.
const RESCAN_EVERY: Duration = Duration::from_secs(1);
/// After a re-open, wait this many times as long as it took before the next look.
const RESCAN_PAUSE: u32 = 4;
/// Pause before reading `metrics.jsonl` again when a line did not parse.
const METRICS_RETRY: Duration = Duration::from_millis(100);
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

/// What every request reads.
pub struct AppState {
    pub source: Source,
    tokenizer: Tokenizer,
    advantage: AdvantageConfig,
    snapshot: RwLock<Arc<Snapshot>>,
    /// Port the server listens on, and whether only loopback `Host` names are accepted.
    port: u16,
    loopback: bool,
}

pub type Shared = Arc<AppState>;

impl AppState {
    /// Locates PATH, reads its tokenizer and advantage settings and opens the dataset.
    pub fn open(path: &std::path::Path, port: u16, loopback: bool) -> Result<Self, ViewError> {
        let source = Source::locate(path)?;
        let snapshot = Snapshot::open(&source, 0)?;
        Ok(Self {
            tokenizer: source.tokenizer()?,
            advantage: source.advantage_config(),
            snapshot: RwLock::new(Arc::new(snapshot)),
            source,
            port,
            loopback,
        })
    }

    /// The snapshot requests read now.
    pub fn current(&self) -> Arc<Snapshot> {
        self.snapshot.read().clone()
    }

    /// Re-opens the dataset when its segment files changed; how long that took, if it did.
    pub fn refresh(&self) -> Result<Option<Duration>, ViewError> {
        let current = self.current();
        if self.source.fingerprint()? == current.fingerprint {
            return Ok(None);
        }
        let started = Instant::now();
        let next = Snapshot::open(&self.source, current.generation + 1)?;
        *self.snapshot.write() = Arc::new(next);
        Ok(Some(started.elapsed()))
    }

    fn root(&self) -> String {
        self.source.root.display().to_string()
    }
}

/// The routes over `app`.
pub fn router(app: Shared) -> Router {
    Router::new()
        .route("/", get(run_page))
        .route("/trajectories", get(list_page))
        .route("/trajectory/{id}", get(trajectory_page))
        .route("/api/metrics", get(metrics))
        .route("/api/status", get(status))
        .route(
            "/assets/app.js",
            get(|| asset(APP_JS, "text/javascript; charset=utf-8")),
        )
        .route(
            "/assets/app.css",
            get(|| asset(APP_CSS, "text/css; charset=utf-8")),
        )
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app)
}

/// Re-reads a live dataset for as long as the runtime runs: a look every [`RESCAN_EVERY`],
/// and after a re-open a pause of [`RESCAN_PAUSE`] times as long as it took, so re-reading a
/// large dataset that keeps growing takes a bounded share of the machine.
pub async fn rescan_forever(app: Shared) {
    loop {
        let worker = app.clone();
        let pause = match tokio::task::spawn_blocking(move || worker.refresh()).await {
            Ok(Ok(took)) => took.map_or(Duration::ZERO, |t| t * RESCAN_PAUSE),
            Ok(Err(e)) => {
                eprintln!("warning: re-reading {}: {e}", app.root());
                Duration::ZERO
            }
            Err(e) => {
                eprintln!("warning: re-reading {}: {e}", app.root());
                Duration::ZERO
            }
        };
        tokio::time::sleep(RESCAN_EVERY.max(pause)).await;
    }
}

fn page(status: StatusCode, body: String) -> Response {
    (status, Html(body)).into_response()
}

fn error(app: &AppState, status: StatusCode, message: &str) -> Response {
    page(
        status,
        pages::error_page(&app.root(), status.as_u16(), message),
    )
}

fn bad(app: &AppState, BadQuery(message): BadQuery) -> Response {
    error(app, StatusCode::BAD_REQUEST, &message)
}

fn json_response(value: &Value) -> Response {
    let body = value.to_string();
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Runs `work` on the blocking pool (it reads mapped segments and decodes records).
async fn blocking(
    app: Shared,
    work: impl FnOnce(&AppState) -> Response + Send + 'static,
) -> Response {
    let worker = app.clone();
    match tokio::task::spawn_blocking(move || work(&worker)).await {
        Ok(response) => response,
        Err(e) => error(&app, StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    }
}

async fn run_page(State(app): State<Shared>) -> Response {
    blocking(app, |app| {
        page(StatusCode::OK, pages::run_page(&app.source, &app.current()))
    })
    .await
}

async fn list_page(
    State(app): State<Shared>,
    query: Result<Query<ListParams>, QueryRejection>,
) -> Response {
    let params = match query {
        Ok(Query(params)) => params,
        Err(e) => return bad(&app, BadQuery(e.body_text())),
    };
    let q = match params.validate() {
        Ok(q) => q,
        Err(e) => return bad(&app, e),
    };
    blocking(app, move |app| {
        let snap = app.current();
        let hits = snap.select(&q.filter, q.sort, q.desc);
        page(
            StatusCode::OK,
            pages::list_page(&app.source, &snap, &q, &hits),
        )
    })
    .await
}

async fn trajectory_page(
    State(app): State<Shared>,
    id: Result<Path<u64>, PathRejection>,
    query: Result<Query<TrajParams>, QueryRejection>,
) -> Response {
    let (Path(id), Query(params)) = match (id, query) {
        (Ok(id), Ok(query)) => (id, query),
        (Err(e), _) => return bad(&app, BadQuery(format!("trajectory id: {}", e.body_text()))),
        (_, Err(e)) => return bad(&app, BadQuery(e.body_text())),
    };
    let q = match params.validate(&app.advantage) {
        Ok(q) => q,
        Err(e) => return bad(&app, e),
    };
    blocking(app, move |app| {
        let snap = app.current();
        match trajectory::gather(&snap, id, &app.tokenizer, &q.advantage) {
            Ok(Some(detail)) => page(
                StatusCode::OK,
                pages::trajectory_page(&app.source, &snap, &detail, &q),
            ),
            Ok(None) => error(app, StatusCode::NOT_FOUND, &format!("no trajectory {id}")),
            Err(e) => error(app, StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
        }
    })
    .await
}

async fn metrics(State(app): State<Shared>) -> Response {
    blocking(app, |app| match metric_series(app) {
        Ok(series) => json_response(&json!({ "series": series })),
        Err(e) => {
            let body = json!({ "error": e.to_string() });
            (StatusCode::INTERNAL_SERVER_ERROR, json_response(&body)).into_response()
        }
    })
    .await
}

/// `metrics.jsonl` as `{name: [[step, value], ...]}` (empty for a bare dataset or a run
/// that has not logged yet).
fn metric_series(app: &AppState) -> Result<Map<String, Value>, ViewError> {
    let mut series = Map::new();
    let Some(path) = app.source.metrics.as_ref().filter(|p| p.is_file()) else {
        return Ok(series);
    };
    // A live run may be writing the last line at this moment: one more read after a pause.
    let rows = read_jsonl(path).or_else(|_| {
        std::thread::sleep(METRICS_RETRY);
        read_jsonl(path)
    })?;
    for (step, scalars) in rows {
        for (name, value) in scalars {
            let points = series
                .entry(name)
                .or_insert_with(|| Value::Array(Vec::new()));
            if let Value::Array(points) = points {
                points.push(json!([step, value]));
            }
        }
    }
    Ok(series)
}

async fn status(State(app): State<Shared>) -> Response {
    let snap = app.current();
    let open = snap.index.trajs.iter().filter(|t| t.open).count();
    json_response(&json!({
        "generation": snap.generation,
        "records": snap.index.records,
        "trajectories": snap.index.trajs.len(),
        "open": open,
    }))
}

async fn asset(body: &'static str, content_type: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

async fn not_found(State(app): State<Shared>) -> Response {
    error(&app, StatusCode::NOT_FOUND, "no such page")
}

/// Refuses foreign `Host` names on a loopback bind and adds the security headers.
async fn guard(State(app): State<Shared>, request: Request, next: Next) -> Response {
    let mut response = if app.loopback && !loopback_host(request.headers(), app.port) {
        error(
            &app,
            StatusCode::FORBIDDEN,
            "this viewer answers only to localhost names",
        )
    } else {
        next.run(request).await
    };
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

fn loopback_host(headers: &HeaderMap, port: u16) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else {
        return false;
    };
    let (name, given_port) = match host.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((name, after)) => (name, after.strip_prefix(':')),
            None => return false,
        },
        None => match host.rsplit_once(':') {
            Some((name, p)) => (name, Some(p)),
            None => (host, None),
        },
    };
    given_port.is_none_or(|p| p.parse::<u16>() == Ok(port))
        && matches!(name, "localhost" | "127.0.0.1" | "::1")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn only_loopback_names_on_our_port_pass() {
        for ok in [
            "127.0.0.1:8080",
            "localhost:8080",
            "[::1]:8080",
            "localhost",
        ] {
            assert!(loopback_host(&host(ok), 8080), "{ok}");
        }
        for refused in [
            "evil.example:8080",
            "127.0.0.1:9",
            "[::1",
            "localhost.evil:8080",
        ] {
            assert!(!loopback_host(&host(refused), 8080), "{refused}");
        }
        assert!(!loopback_host(&HeaderMap::new(), 8080));
    }
}
