//! `stepppo view` over real HTTP on loopback: the run page, the metrics JSON, list pages,
//! trajectory pages with every estimator, escaping of hostile model and env text, malformed
//! and hostile parameters and paths answered 4xx while the server stays up, foreign `Host`
//! names refused, nothing written, a live run's new steps and metrics appearing without a
//! restart, and a trained run's steps showing what its trainer used.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use stepppo::env::StepInfo;
use stepppo::store::{DatasetWriter, StepRecord, WriterOptions};
use stepppo::tokenizer::Tokenizer;
use stepppo::train::run::credit_log::{read_credit, CREDIT_FILE};
use stepppo::train::Trainer;
use stepppo::view::{self, ViewOptions};

const HOSTILE_ACTION: &str = "<answer>Left</answer></pre><script>alert(1)</script>";
const HOSTILE_OBS: &str = "<img src=x onerror=alert(2)> grid </pre>";
const TOOL_CALL: &str =
    "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"<x>\"}}\n</tool_call>";

fn record(traj: u64, group: u64, step: u32, version: u64, last: bool, action: &str) -> StepRecord {
    let tok = Tokenizer::builtin();
    let response_ids = tok.encode(action);
    StepRecord {
        traj_id: traj,
        group_id: group,
        step_index: step,
        env_tag: "frozen_lake".into(),
        seed: group * 10,
        policy_version: version,
        context_len: 0,
        obs_ids: if traj == 1 {
            tok.encode(&format!("<|im_start|>user\n{HOSTILE_OBS}<|im_end|>\n"))
        } else {
            tok.encode("obs")
        },
        response_logprobs: (0..response_ids.len()).map(|i| -0.1 * i as f32).collect(),
        response_ids,
        reward: if last { traj as f32 } else { -0.1 },
        terminated: last,
        truncated: false,
        state_hash: u64::from(step),
        info: StepInfo {
            success: last && traj % 2 == 1,
            action_is_valid: true,
            action_is_effective: true,
            format_penalty: 0.0,
            num_actions: 1,
            observation_text: if traj == 1 {
                HOSTILE_OBS.into()
            } else {
                "F F\nF G".into()
            },
            action_text: action.into(),
            tool_call_error: false,
            context_rebuilt: false,
        },
        critic_state: Vec::new(),
        admissible_actions: match traj {
            1 => vec!["go east".into(), HOSTILE_OBS.into()],
            _ => Vec::new(),
        },
    }
}

fn opts() -> WriterOptions {
    WriterOptions {
        durable: false,
        ..WriterOptions::default()
    }
}

/// A run directory: two training steps of two groups of two two-step trajectories, and a
/// metrics.jsonl with the curves the run page draws.
fn make_run(dir: &Path) {
    let mut writer = DatasetWriter::create(&dir.join("dataset"), opts()).unwrap();
    for traj in 0..8u64 {
        let (group, version) = (traj / 2, traj / 4);
        let action = if traj == 1 {
            HOSTILE_ACTION
        } else {
            "<answer>Up</answer>"
        };
        writer
            .append(&record(traj, group, 0, version, false, action))
            .unwrap();
        writer
            .append(&record(
                traj,
                group,
                1,
                version,
                true,
                if traj == 1 {
                    TOOL_CALL
                } else {
                    "<answer>Right</answer>"
                },
            ))
            .unwrap();
    }
    writer.seal().unwrap();
    let metrics = [
        r#"{"step":0,"val/frozen_lake/success":0.0}"#,
        r#"{"step":1,"env/frozen_lake/success":0.25,"actor/entropy":1.5,"time/step":2.0}"#,
        r#"{"step":2,"env/frozen_lake/success":0.5,"actor/entropy":1.2,"time/step":2.1,"val/frozen_lake/success":0.5}"#,
    ];
    std::fs::write(dir.join("metrics.jsonl"), metrics.join("\n") + "\n").unwrap();
}

struct Client {
    agent: ureq::Agent,
    addr: SocketAddr,
}

impl Client {
    fn new(addr: SocketAddr) -> Self {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build();
        Self {
            agent: config.into(),
            addr,
        }
    }

    fn get(&self, path: &str) -> (u16, String) {
        let url = format!("http://{}{path}", self.addr);
        let mut resp = self
            .agent
            .get(&url)
            .call()
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let status = resp.status().as_u16();
        (status, resp.body_mut().read_to_string().unwrap())
    }

    fn ok(&self, path: &str) -> String {
        let (status, body) = self.get(path);
        assert_eq!(status, 200, "GET {path}: {body}");
        body
    }
}

/// One request written byte for byte (no client normalises the path): status and body.
fn raw_get(addr: SocketAddr, target: &str, host: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

fn files_and_sizes(dir: &Path) -> Vec<(String, u64)> {
    let mut out: Vec<_> = walk(dir);
    out.sort();
    out
}

fn walk(dir: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = entry.metadata().unwrap();
        if meta.is_dir() {
            out.extend(walk(&entry.path()));
        } else {
            out.push((entry.path().display().to_string(), meta.len()));
        }
    }
    out
}

fn start(path: &Path) -> SocketAddr {
    let viewer = view::start(&ViewOptions {
        path: path.to_path_buf(),
        host: "127.0.0.1".into(),
        port: 0,
    })
    .unwrap();
    let addr = viewer.addr();
    std::mem::forget(viewer);
    addr
}

#[test]
fn pages_lists_and_trajectories_are_served_escaped_and_read_only() {
    let dir = tempfile::tempdir().unwrap();
    make_run(dir.path());
    let before = files_and_sizes(dir.path());
    let client = Client::new(start(dir.path()));

    let index = client.ok("/");
    assert!(index.contains("id=\"charts\""), "{index}");
    assert!(index.contains("<span id=\"trajectories\">8</span>"));
    let metrics = client.ok("/api/metrics");
    let metrics: serde_json::Value = serde_json::from_str(&metrics).unwrap();
    assert_eq!(
        metrics["series"]["actor/entropy"][1],
        serde_json::json!([2, 1.2])
    );
    assert!(client.ok("/assets/app.js").contains("ready"));

    let list = client.ok("/trajectories?step=2&sort=return&order=desc&per_page=3");
    assert!(list.contains("4 match · page 1 of 2"), "{list}");
    let first = list
        .find("href=\"/trajectory/7\"")
        .expect("highest return first");
    assert!(first < list.find("href=\"/trajectory/6\"").unwrap());
    let blank_form =
        client.ok("/trajectories?env=&version=&group=&success=&open=&min_len=&page=2&per_page=5");
    assert!(blank_form.contains("8 match · page 2 of 2"));
    assert!(client
        .ok("/trajectories?success=true&env=frozen_lake")
        .contains("4 match"));
    assert!(client.ok("/trajectories?env=nowhere").contains("0 match"));

    let traj = client.ok("/trajectory/1");
    // The response is shown token by token, each token's text escaped on its own.
    let text: String = traj
        .split("<span class=\"tok\"")
        .skip(1)
        .map(|span| {
            span.split_once('>')
                .unwrap()
                .1
                .split("</span>")
                .next()
                .unwrap()
        })
        .collect();
    assert!(
        text.contains("&lt;/pre&gt;&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{text}"
    );
    assert!(
        traj.contains("title=\"id 1118 · &quot;&lt;/answer&gt;&quot;"),
        "{traj}"
    );
    assert!(traj.contains("&lt;img src=x onerror=alert(2)&gt;"));
    // What a constrained step was sampled among, escaped.
    assert!(
        traj.contains("sampled among 2 admissible actions</h3><ul class=\"choices\"><li><code>go east</code></li><li><code>&lt;img src=x"),
        "{traj}"
    );
    // Everything the model saw at a context's start, template markers included, shown open.
    assert!(
        traj.contains("<details class=\"context\" open><summary>the ")
            && traj.contains("<pre class=\"obs-raw\">&lt;|im_start|&gt;user\n&lt;img src=x"),
        "{traj}"
    );
    // The tool call of the last step, read in the built-in template's format.
    assert!(
        traj.contains("<ul class=\"calls\"><li><code>search(") && traj.contains("&lt;x&gt;"),
        "{traj}"
    );
    assert!(
        !traj.contains("<script>") && !traj.contains("<img"),
        "unescaped text: {traj}"
    );
    assert!(traj.contains("class=\"tok\"") && traj.contains("id=\"group\""));
    assert!(
        traj.contains("href=\"/trajectory/0\""),
        "its group mate is beside it"
    );
    for estimator in ["grpo", "step_gae", "rloo", "gigpo", "reinforce_plus_plus"] {
        let scored = client.ok(&format!(
            "/trajectory/1?estimator={estimator}&color=advantage"
        ));
        assert!(
            scored.contains("advantage <span class=\"adv\">"),
            "{estimator}: {scored}"
        );
    }
    assert_eq!(
        before,
        files_and_sizes(dir.path()),
        "the viewer wrote into the run"
    );
}

#[test]
fn hostile_requests_get_4xx_and_the_server_stays_up() {
    let dir = tempfile::tempdir().unwrap();
    make_run(dir.path());
    let addr = start(dir.path());
    let client = Client::new(addr);
    for (path, want) in [
        ("/trajectory/abc", 400),
        ("/trajectory/-1", 400),
        ("/trajectory/99999999999999999999999", 400),
        ("/trajectory/424242", 404),
        (
            "/trajectory/1?estimator=%3Cscript%3Ealert(1)%3C/script%3E",
            400,
        ),
        ("/trajectory/1?color=red", 400),
        ("/trajectory/1?x=1", 400),
        ("/trajectories?page=0", 400),
        ("/trajectories?per_page=100000000", 400),
        ("/trajectories?step=0", 400),
        ("/trajectories?step=%3Cscript%3E", 400),
        ("/trajectories?min_return=inf", 400),
        ("/trajectories?page=1&page=2", 400),
        ("/trajectories?bogus=%3Cscript%3E", 400),
        ("/trajectories?sort=%22%3E%3Cscript%3E", 400),
        ("/nowhere", 404),
    ] {
        let (status, body) = client.get(path);
        assert_eq!(status, want, "GET {path}: {body}");
        assert!(
            !body.contains("<script>"),
            "GET {path} echoed markup: {body}"
        );
    }
    for target in [
        "/assets/../Cargo.toml",
        "/assets/..%2f..%2fCargo.toml",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/assets/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "/trajectory/..%2f..%2f..%2fetc%2fpasswd",
        "/assets/app.js/../../../../etc/passwd",
        "//etc/passwd",
        "/dataset/manifest.json",
        "/metrics.jsonl",
    ] {
        let (status, text) = raw_get(addr, target, &addr.to_string());
        assert!((400..500).contains(&status), "GET {target}: {text}");
        assert!(
            !text.contains("root:") && !text.contains("[package]"),
            "GET {target}: {text}"
        );
    }
    let (status, _) = raw_get(addr, "/", "rebound.example:80");
    assert_eq!(status, 403, "a foreign Host is refused");
    assert!(client.ok("/").contains("id=\"charts\""), "still serving");
}

fn wait_for(client: &Client, what: &str, check: impl Fn(&serde_json::Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status: serde_json::Value = serde_json::from_str(&client.ok("/api/status")).unwrap();
        if check(&status) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: status stayed {status}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_live_dataset_shows_new_steps_and_marks_open_trajectories() {
    let dir = tempfile::tempdir().unwrap();
    make_run(dir.path());
    let client = Client::new(start(dir.path()));
    assert_eq!(client.get("/trajectory/100").0, 404);

    let mut writer = DatasetWriter::open_append(&dir.path().join("dataset"), opts()).unwrap();
    writer
        .append(&record(100, 50, 0, 2, false, "<answer>Down</answer>"))
        .unwrap();
    writer.flush().unwrap();
    wait_for(&client, "the first new step", |s| {
        s["records"] == 17 && s["open"] == 1
    });
    let open = client.ok("/trajectory/100");
    assert!(
        open.contains("id=\"open-badge\"") && open.contains("data-live=\"1\""),
        "{open}"
    );
    assert!(client
        .ok("/trajectories?open=true")
        .contains("href=\"/trajectory/100\""));

    writer
        .append(&record(100, 50, 1, 2, true, "<answer>Down</answer>"))
        .unwrap();
    writer.flush().unwrap();
    wait_for(&client, "the last step", |s| {
        s["records"] == 18 && s["open"] == 0
    });
    let done = client.ok("/trajectory/100");
    assert!(
        !done.contains("open-badge") && done.contains("id=\"step-1\""),
        "{done}"
    );
    writer.seal().unwrap();

    let metrics = dir.path().join("metrics.jsonl");
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&metrics)
        .unwrap();
    write!(file, r#"{{"step":3,"actor/entropy":0."#).unwrap();
    let (status, body) = client.get("/api/metrics");
    assert_eq!(
        status, 500,
        "a line being written is an error until it is whole: {body}"
    );
    assert!(body.contains("metrics.jsonl"), "{body}");
    writeln!(file, "9}}").unwrap();
    let series: serde_json::Value = serde_json::from_str(&client.ok("/api/metrics")).unwrap();
    assert_eq!(
        series["series"]["actor/entropy"][2],
        serde_json::json!([3, 0.9])
    );
}

#[test]
fn the_command_names_a_path_that_is_no_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(["view", "--port", "0"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("neither a dataset"), "{stderr}");
    assert!(
        stderr.contains(&dir.path().display().to_string()),
        "{stderr}"
    );
}

/// A run trained for real: each step's page shows what the trainer used for it (the credit log):
/// the critic's value from the rollout-time scoring (not the re-scoring's 0), the advantage, the
/// ratio and the sampling version.
#[test]
fn a_trained_runs_steps_show_the_trainers_credit() {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["critic.mode=separate", "critic.history_batches=1"];
    let mut trainer = Trainer::create(common::tiny_config(&sets), dir.path()).unwrap();
    trainer.run(2, &mut |_| {}).unwrap();
    drop(trainer);
    let credit = read_credit(&dir.path().join(CREDIT_FILE)).unwrap();
    let (&(traj, step), row) = credit
        .iter()
        .filter(|(_, c)| c.learner_version == 1)
        .min_by_key(|(k, _)| **k)
        .unwrap();
    let client = Client::new(start(dir.path()));
    let page = client.ok(&format!("/trajectory/{traj}"));
    let value = row.value.expect("a separate critic gives values");
    assert_ne!(value, 0.0);
    let line = format!(
        "id=\"trainer-{step}\">trainer, update of version 1: value <b>{value:.3}</b> · \
         advantage <b>{:.3}</b>",
        row.advantage
    );
    assert!(page.contains(&line), "{line} not in {page}");
    assert!(page.contains("sampled by version 1 (on-policy)"), "{page}");
    assert!(page.contains("the step's importance ratio"), "{page}");
}
