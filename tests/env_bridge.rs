//! The env bridge end to end: the `remote` env against the reference gym server
//! (`examples/gym_env_server.py`, run by `$STEPPPO_PYTHON` or `target/examples-venv/bin/python`;
//! those tests print why and pass when neither exists) and against an axum server in this process
//! that injects faults (no answer in time, a cut connection, HTTP 500, malformed JSON, a missing
//! field): every fault is an error naming the server and the request, `on_error: skip` drops
//! whole groups and counts them, `fail` ends a run and keeps what it stored.

mod examples_python;
use examples_python::examples_python;
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use candle_core::Device;
use serde_json::{json, Value};
use stepppo::env::{build_session, play_episode, Agent, AgentKind};
use stepppo::model::{Model, ModelConfig};
use stepppo::rollout::agent_loop::{run_rollout, RolloutConfig};
use stepppo::rollout::engine::{Engine, EngineConfig};
use stepppo::store::StepRecord;
use stepppo::tokenizer::{ChatTemplate, Tokenizer};
use stepppo::train::run::metrics::read_jsonl;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

// ---------------------------------------------------------------- the reference gym server

/// `examples/gym_env_server.py` serving FrozenLake on a free port; killed when dropped.
struct GymServer {
    child: Child,
    url: String,
}

impl GymServer {
    fn start(python: &Path) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/gym_env_server.py");
        let mut child = Command::new(python)
            .arg(script)
            .args(["FrozenLake-v1", "--port", "0", "--random-maps"])
            .args(["--distance-reward", "0.1"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("the gym server starts");
        let mut line = String::new();
        let stdout = child.stdout.take().unwrap();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        let url = match line.trim().split_once(" at ") {
            Some((_, url)) => url.to_string(),
            None => panic!("the gym server did not say where it listens: {line:?}"),
        };
        GymServer { child, url }
    }
}

impl Drop for GymServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------- the fault server

/// What the fault server does instead of answering.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// Answers after 3 s (the clients here time out after 0.3 s).
    Hang,
    /// Drops the connection instead of answering.
    Cut,
    /// HTTP 500 with `{"error": "injected failure"}`.
    Status500,
    /// A 200 whose body is cut-off JSON.
    Malformed,
    /// A 200 without a field the protocol requires (`reward`, `env_id`, `instruction`).
    MissingField,
}

/// Which requests fail: the `from`-th to the `to`-th (1-based) request to `path`.
#[derive(Clone, Copy)]
struct FaultPlan {
    path: &'static str,
    fault: Fault,
    from: usize,
    to: usize,
}

#[derive(Clone)]
struct Shared {
    plan: Option<FaultPlan>,
    /// Requests served per path.
    counts: Arc<Mutex<HashMap<&'static str, usize>>>,
    /// Each live episode's position on the walk.
    episodes: Arc<Mutex<HashMap<String, u32>>>,
    /// Episodes started (ids `e1`, `e2`, …).
    started: Arc<AtomicU64>,
    /// Set by a handler: the connection fails its next write (the answer never leaves).
    cut: Arc<AtomicBool>,
}

impl Shared {
    /// Counts a request to `path` and returns the fault planned for it, if any.
    fn fault(&self, path: &'static str) -> Option<Fault> {
        let mut counts = self.counts.lock().unwrap();
        let n = counts.entry(path).or_default();
        *n += 1;
        let plan = self
            .plan
            .filter(|p| p.path == path && (p.from..=p.to).contains(n))?;
        Some(plan.fault)
    }

    /// The answer of a planned fault; `complete` is the answer's body without its required field.
    async fn inject(&self, fault: Fault, complete: Value) -> Response {
        match fault {
            Fault::Hang => {
                tokio::time::sleep(Duration::from_secs(3)).await;
                ok(complete)
            }
            Fault::Cut => {
                self.cut.store(true, Ordering::SeqCst);
                ok(complete)
            }
            Fault::Status500 => answer(
                StatusCode::INTERNAL_SERVER_ERROR,
                json!({"error": "injected failure"}),
            ),
            Fault::Malformed => (
                [("content-type", "application/json")],
                r#"{"observation": "pos"#,
            )
                .into_response(),
            Fault::MissingField => ok(complete),
        }
    }
}

/// A JSON answer (`axum::Json` needs a feature this crate leaves off).
fn answer(status: StatusCode, body: Value) -> Response {
    let headers = [("content-type", "application/json")];
    (status, headers, body.to_string()).into_response()
}

fn ok(body: Value) -> Response {
    answer(StatusCode::OK, body)
}

/// A walk from 0 to 3: `Right` steps forward, `Left` back; reaching 3 ends it with reward 1.
const WALK_END: u32 = 3;

fn walk_text(pos: u32) -> String {
    format!("pos {pos} of {WALK_END}")
}

async fn spec(State(s): State<Shared>) -> Response {
    let spec = json!({
        "name": "walk", "instruction": "Walk right to the end.",
        "actions": ["Left", "Right"], "max_steps": 8,
    });
    match s.fault("/spec") {
        Some(fault) => s.inject(fault, json!({"name": "walk"})).await,
        None => ok(spec),
    }
}

async fn reset(State(s): State<Shared>, body: String) -> Response {
    let body: Value = serde_json::from_str(&body).unwrap();
    assert!(body["seed"].is_u64(), "{body}");
    let env_id = format!("e{}", s.started.fetch_add(1, Ordering::SeqCst) + 1);
    s.episodes.lock().unwrap().insert(env_id.clone(), 0);
    match s.fault("/reset") {
        Some(fault) => s.inject(fault, json!({"observation": walk_text(0)})).await,
        None => ok(json!({"env_id": env_id, "observation": walk_text(0)})),
    }
}

async fn step(State(s): State<Shared>, body: String) -> Response {
    let body: Value = serde_json::from_str(&body).unwrap();
    let id = body["env_id"].as_str().unwrap_or_default().to_string();
    let moved = {
        let mut episodes = s.episodes.lock().unwrap();
        let Some(pos) = episodes.get_mut(&id) else {
            return answer(StatusCode::NOT_FOUND, json!({"error": "unknown env_id"}));
        };
        match body["action"].as_str() {
            Some("Right") => *pos += 1,
            Some("Left") => *pos = pos.saturating_sub(1),
            other => panic!("unlisted action {other:?}"),
        }
        *pos
    };
    let done = moved == WALK_END;
    let partial = json!({
        "observation": walk_text(moved), "terminated": done, "truncated": false,
        "info": {"success": done},
    });
    match s.fault("/step") {
        Some(fault) => s.inject(fault, partial).await,
        None => {
            let mut full = partial;
            full["reward"] = json!(if done { 1.0 } else { 0.0 });
            ok(full)
        }
    }
}

async fn close(State(s): State<Shared>, body: String) -> Response {
    let body: Value = serde_json::from_str(&body).unwrap();
    let id = body["env_id"].as_str().unwrap_or_default();
    s.episodes.lock().unwrap().remove(id);
    ok(json!({}))
}

/// A connection whose next write fails once a handler set `cut`: hyper then drops it, so the
/// client sees the connection close without an answer.
struct CutIo {
    inner: tokio::net::TcpStream,
    cut: Arc<AtomicBool>,
}

impl AsyncRead for CutIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for CutIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.cut.swap(false, Ordering::SeqCst) {
            let cut = std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "fault: cut");
            return Poll::Ready(Err(cut));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

struct CutListener {
    inner: tokio::net::TcpListener,
    cut: Arc<AtomicBool>,
}

impl axum::serve::Listener for CutListener {
    type Io = CutIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (CutIo, SocketAddr) {
        loop {
            if let Ok((inner, addr)) = self.inner.accept().await {
                let cut = self.cut.clone();
                return (CutIo { inner, cut }, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// The walk env behind the bridge protocol, failing as `plan` says; stopped when dropped.
struct FaultServer {
    runtime: Option<tokio::runtime::Runtime>,
    url: String,
}

impl FaultServer {
    fn start(plan: Option<FaultPlan>) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let shared = Shared {
            plan,
            counts: Arc::default(),
            episodes: Arc::default(),
            started: Arc::default(),
            cut: cut.clone(),
        };
        let app = Router::new()
            .route("/spec", get(spec))
            .route("/reset", post(reset))
            .route("/step", post(step))
            .route("/close", post(close))
            .with_state(shared);
        let inner = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let url = format!("http://{}", inner.local_addr().unwrap());
        runtime.spawn(async move { axum::serve(CutListener { inner, cut }, app).await });
        FaultServer {
            runtime: Some(runtime),
            url,
        }
    }

    fn failing(path: &'static str, fault: Fault, from: usize, to: usize) -> Self {
        Self::start(Some(FaultPlan {
            path,
            fault,
            from,
            to,
        }))
    }
}

impl Drop for FaultServer {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

// ---------------------------------------------------------------- helpers

fn stepppo(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(args)
        .output()
        .expect("the stepppo binary runs")
}

/// A `stepppo train` run of `configs/frozenlake_remote.yaml` on a tiny model: `steps` steps of
/// 2 groups of 2, validation of 2 episodes after each, one turn per episode, env at `url`.
fn train(run: &Path, url: &str, steps: usize, extra: &[&str]) -> std::process::Output {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/frozenlake_remote.yaml");
    let env = "custom_envs.RemoteFrozenLake.env_config";
    let mut sets = vec![
        "builtin_size=tiny".to_string(),
        format!("max_steps={steps}"),
        "eval_steps=1".into(),
        "sft.steps=2".into(),
        "sft.episodes=2".into(),
        "sft.batch_size=2".into(),
        "ppo_mini_batch_size=2".into(),
        "train_env_manager.group_size=2".into(),
        "train_env_manager.num_groups_partition=[2]".into(),
        "val_env_manager.num_groups_partition=[2]".into(),
        "generating_args.max_new_tokens=6".into(),
        "val_generating_args.max_new_tokens=6".into(),
        "cache.kv_slots=4096".into(),
        format!("{env}.max_turns=1"),
        format!("{env}.url={url}"),
    ];
    sets.extend(extra.iter().map(|s| format!("{env}.{s}")));
    let mut args = vec!["train", "--config", config.to_str().unwrap()];
    args.extend(["--out", run.to_str().unwrap()]);
    for set in &sets {
        args.extend(["--set", set.as_str()]);
    }
    stepppo(&args)
}

fn remote(url: &str, extra: Value) -> Value {
    let mut config = json!({"url": url, "timeout": 0.3, "max_turns": 8});
    config
        .as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    config
}

/// Plays one random-agent episode on the env at `url`; the error's text when it fails.
fn play_error(url: &str, seed: u64) -> String {
    let err = match build_session("remote", &remote(url, json!({}))) {
        Err(e) => e,
        Ok(mut session) => {
            let mut agent = Agent::new(AgentKind::Random, 1);
            play_episode(&mut session, seed, &mut |s| agent.respond(s))
                .expect_err("the fault surfaces as an error")
        }
    };
    err.to_string()
}

fn assert_names(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "`{part}` missing from: {text}");
    }
}

// ---------------------------------------------------------------- tests

#[test]
fn random_agent_plays_gym_frozenlake_through_the_bridge() {
    let Some(python) = examples_python("random_agent_plays_gym_frozenlake_through_the_bridge")
    else {
        return;
    };
    let server = GymServer::start(&python);
    let config = json!({"url": server.url, "max_turns": 8});
    let mut session = build_session("remote", &config).unwrap();
    let mut ends = (0, 0);
    for seed in 0..12 {
        let mut agent = Agent::new(AgentKind::Random, seed);
        let episode = play_episode(&mut session, seed, &mut |s| agent.respond(s)).unwrap();
        let first = &episode.turns[0].user_message;
        assert_names(
            first,
            &["Actions: Left, Down, Right, Up.", "\nGoal:\n", "P"],
        );
        assert!(episode.turns.iter().all(|t| t.outcome.info.action_is_valid));
        let last = &episode.turns.last().unwrap().outcome;
        ends.0 += usize::from(last.terminated);
        ends.1 += usize::from(episode.success());
        let again = build_session("remote", &config)
            .unwrap()
            .reset(seed)
            .unwrap();
        assert!(first.contains(&again), "seed {seed} draws the same map");
    }
    assert!(
        ends.0 > 0,
        "some random episodes end in a hole or on the goal"
    );
    let mut oracle = Agent::new(AgentKind::Oracle, 0);
    let err = play_episode(&mut session, 0, &mut |s| oracle.respond(s)).unwrap_err();
    assert_names(&err.to_string(), &["oracle", "FrozenLake-v1"]);
}

#[test]
fn train_runs_through_the_gym_server() {
    let Some(python) = examples_python("train_runs_through_the_gym_server") else {
        return;
    };
    let server = GymServer::start(&python);
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = train(&run, &server.url, 1, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = read_jsonl(&run.join("metrics.jsonl")).unwrap();
    let step1: Vec<_> = rows.iter().filter(|(s, _)| *s == 1).collect();
    let value = |name: &str| step1.iter().find_map(|(_, m)| m.get(name).copied());
    for name in [
        "env/RemoteFrozenLake/success",
        "val/RemoteFrozenLake/success",
        "time/rollout_env",
    ] {
        assert!(value(name).is_some(), "metrics.jsonl lacks {name}");
    }
    assert_eq!(value("rollout/env_errors"), Some(0.0));
}

#[test]
fn every_fault_is_an_error_naming_the_server_and_the_request() {
    let step_faults = [
        (Fault::Hang, "no answer in time"),
        (Fault::Cut, "connection"),
        (Fault::Status500, "HTTP 500: injected failure"),
        (Fault::Malformed, "malformed answer"),
        (Fault::MissingField, "missing field `reward`"),
    ];
    for (fault, why) in step_faults {
        let server = FaultServer::failing("/step", fault, 2, 2);
        let text = play_error(&server.url, 7);
        let request = ["POST /step", r#""env_id":"e1""#, r#""action":""#];
        assert_names(&text, &[&server.url, "(walk)", why]);
        assert_names(&text, &request);
    }
    let server = FaultServer::failing("/reset", Fault::Status500, 1, 1);
    let text = play_error(&server.url, 7);
    assert_names(
        &text,
        &[&server.url, r#"POST /reset {"seed":7}"#, "HTTP 500"],
    );
    let server = FaultServer::failing("/reset", Fault::MissingField, 1, 1);
    assert_names(&play_error(&server.url, 7), &["missing field `env_id`"]);
    let server = FaultServer::failing("/spec", Fault::MissingField, 1, 1);
    assert_names(&play_error(&server.url, 7), &["GET /spec", "`instruction`"]);
    assert_names(
        &play_error("http://127.0.0.1:1", 7),
        &["GET /spec", "connection"],
    );
}

/// A rollout of 3 groups of 2 over the walk env at `url` with a tiny model, with `on_error`
/// and the remote keys of `extra`.
fn walk_rollout(
    url: &str,
    on_error: &str,
    extra: Value,
) -> (
    stepppo::rollout::agent_loop::Result<stepppo::rollout::agent_loop::Rollout>,
    usize,
) {
    let tok = Tokenizer::builtin();
    let cfg = ModelConfig::tiny(tok.vocab_size());
    let model = Model::new(&cfg, 3, &Device::Cpu).unwrap();
    let mut engine = Engine::new(&cfg, EngineConfig::default(), &Device::Cpu).unwrap();
    let mut keys = json!({"on_error": on_error, "max_turns": 2});
    keys.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let rollout = RolloutConfig {
        env_name: "remote".into(),
        env_config: remote(url, keys),
        num_groups: 3,
        group_size: 2,
        max_new_tokens: 6,
        constrained_decoding: true,
        ..RolloutConfig::default()
    };
    let mut sunk = 0;
    let mut sink = |_: &StepRecord| {
        sunk += 1;
        Ok(())
    };
    let result = run_rollout(
        &mut engine,
        &model,
        &tok,
        &ChatTemplate,
        &rollout,
        &mut sink,
    );
    (result, sunk)
}

#[test]
fn episodes_stepped_at_once_give_the_records_of_one_after_another() {
    let server = FaultServer::start(None);
    let records = |concurrency: usize| {
        let (out, _) = walk_rollout(&server.url, "fail", json!({"concurrency": concurrency}));
        out.unwrap().records
    };
    let one_by_one = records(1);
    assert_eq!(one_by_one.len(), 12, "3 groups of 2, 2 turns");
    for concurrency in [2, 4, 16] {
        let at_once = records(concurrency);
        assert_eq!(at_once.len(), one_by_one.len(), "concurrency {concurrency}");
        for (a, b) in one_by_one.iter().zip(&at_once) {
            let at = (a.traj_id, a.step_index, concurrency);
            assert_eq!((b.traj_id, b.step_index), (a.traj_id, a.step_index));
            assert_eq!(a.obs_ids, b.obs_ids, "{at:?}");
            assert_eq!(a.response_ids, b.response_ids, "{at:?}");
            assert_eq!((a.reward, a.terminated), (b.reward, b.terminated), "{at:?}");
        }
    }
    let (err, _) = walk_rollout(&server.url, "fail", json!({"concurrency": 0}));
    assert_names(
        &err.err().unwrap().to_string(),
        &["concurrency", "at least 1"],
    );
}

#[test]
fn a_rollout_drops_the_failed_group_under_skip_and_stops_under_fail() {
    let server = FaultServer::failing("/step", Fault::Status500, 3, 3);
    let (out, sunk) = walk_rollout(&server.url, "skip", json!({}));
    let out = out.unwrap();
    let mut members: HashMap<u64, std::collections::BTreeSet<u64>> = HashMap::new();
    for r in &out.records {
        members.entry(r.group_id).or_default().insert(r.traj_id);
    }
    assert_eq!(members.len(), 2, "one of 3 groups dropped");
    assert!(members.values().all(|m| m.len() == 2), "whole groups kept");
    assert_eq!((out.stats.trajectories, sunk), (4, out.records.len()));
    assert_eq!(out.stats.env_errors.len(), 1);
    assert_names(
        &out.stats.env_errors[0],
        &["POST /step", "HTTP 500", "remote"],
    );
    for traj in out.records.chunk_by(|a, b| a.traj_id == b.traj_id) {
        assert!(
            traj.last().unwrap().is_last(),
            "kept trajectories are whole"
        );
    }

    let server = FaultServer::failing("/step", Fault::Status500, 3, 3);
    let err = walk_rollout(&server.url, "fail", json!({}))
        .0
        .err()
        .unwrap()
        .to_string();
    assert_names(&err, &["POST /step", "HTTP 500", &server.url]);

    let server = FaultServer::failing("/reset", Fault::Status500, 1, usize::MAX);
    let err = walk_rollout(&server.url, "skip", json!({}))
        .0
        .err()
        .unwrap()
        .to_string();
    assert_names(&err, &["POST /reset", "HTTP 500"]);
}

#[test]
fn a_failed_env_ends_a_run_keeping_its_steps_or_is_skipped_and_counted() {
    // Resets: warm start 2, validation 2, step 1 4, validation 2, then step 2's first: the 11th.
    let dir = tempfile::tempdir().unwrap();
    let server = FaultServer::failing("/reset", Fault::Status500, 11, 11);
    let run = dir.path().join("fail");
    let out = train(&run, &server.url, 2, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert_names(
        &stderr,
        &["custom_envs.RemoteFrozenLake", "POST /reset", "HTTP 500"],
    );
    let report = stepppo::store::verify(&run.join("dataset")).unwrap();
    assert!(report.is_sound(), "{:?}", report.problems);
    assert_eq!(report.records, 4, "step 1's four one-turn episodes stay");

    let server = FaultServer::failing("/reset", Fault::Status500, 11, 11);
    let run = dir.path().join("skip");
    let out = train(&run, &server.url, 2, &["on_error=skip"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_names(&stderr, &["step 2: 1 env error(s)", "POST /reset"]);
    let rows = read_jsonl(&run.join("metrics.jsonl")).unwrap();
    let errors = |step: u64| {
        rows.iter()
            .filter(|(s, _)| *s == step)
            .find_map(|(_, m)| m.get("rollout/env_errors").copied())
    };
    assert_eq!((errors(1), errors(2)), (Some(0.0), Some(1.0)));
    let report = stepppo::store::verify(&run.join("dataset")).unwrap();
    assert_eq!(report.records, 6, "step 2 keeps its other group");
}
