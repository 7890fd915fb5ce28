//! The OpenAI-compatible gateway over real HTTP on loopback: a Rust client (ureq) always, the
//! official `openai` Python client where Python has it; recording into a step dataset, the
//! token-space continuation of a session, streaming, the error bodies, and a `kill -9` of a
//! recording server.

mod examples_python;
mod http_client;
use examples_python::examples_python;
use http_client::{agent, get, post, sse_chunks};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::{json, Value};
use stepppo::model::{Model, ModelConfig};
use stepppo::rollout::engine::{Engine, EngineConfig};
use stepppo::serve::{self, GatewayOptions, PolicyBackend, Recorder};
use stepppo::store::{self, Dataset, WriterOptions};
use stepppo::tokenizer::Tokenizer;

const MODEL: &str = "tiny-test";

/// A gateway over the tiny built-in model on a free port, serving on its own thread.
fn start_gateway(record: Option<&Path>) -> String {
    let tokenizer = Tokenizer::builtin();
    let cfg = ModelConfig::tiny(tokenizer.vocab_size());
    let model = Model::new(&cfg, 7, &candle_core::Device::Cpu).unwrap();
    start_gateway_with(model, tokenizer, record)
}

fn start_gateway_with(model: Model, tokenizer: Tokenizer, record: Option<&Path>) -> String {
    let device = candle_core::Device::Cpu;
    let engine = Engine::new(model.config(), EngineConfig::default(), &device).unwrap();
    let recorder = record.map(|d| Recorder::open(d, WriterOptions::default()).unwrap());
    let mut opts = GatewayOptions::new(MODEL, 512, 0);
    opts.port = 0;
    opts.max_body_bytes = 4096;
    opts.worker.default_max_tokens = 12;
    let gateway = serve::start(&opts).unwrap();
    let url = format!("http://{}", gateway.addr());
    gateway.spawn(PolicyBackend {
        model,
        tokenizer,
        engine,
        recorder,
    });
    url
}

fn chat_body<S: AsRef<str>>(messages: &[(&str, S)], extra: Value) -> String {
    let msgs: Vec<Value> = messages
        .iter()
        .map(|(r, c)| json!({"role": r, "content": c.as_ref()}))
        .collect();
    let mut body = json!({"model": MODEL, "messages": msgs, "max_tokens": 8, "seed": 3});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body.to_string()
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn sessions_are_recorded_as_steps_that_extend_their_context() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("gateway-data");
    let url = start_gateway(Some(&data));
    let (status, models) = get(&format!("{url}/v1/models"));
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], MODEL);

    let chat = format!("{url}/v1/chat/completions");
    let session = [("x-session-id", "ep-1"), ("x-task-id", "map-9")];
    let mut messages: Vec<(&str, String)> = vec![
        ("system", "Play FrozenLake.".into()),
        ("user", "Turn 1: P_G".into()),
    ];
    let mut replies = Vec::new();
    for _ in 0..3 {
        let (status, reply) = post(
            &chat,
            &chat_body(&messages, json!({"logprobs": true})),
            &session,
        );
        assert_eq!(status, 200, "{reply}");
        let n_logprobs = reply["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .len();
        assert_eq!(
            n_logprobs,
            reply["usage"]["completion_tokens"].as_u64().unwrap() as usize
        );
        replies.push(content(&reply));
        messages.push(("assistant", content(&reply)));
        messages.push(("user", "Turn 2: _P".into()));
    }
    let (_, stats) = get(&format!("{url}/v1/stats"));
    assert!(stats["tokens_from_cache"].as_u64().unwrap() > 0, "{stats}");
    assert_eq!(stats["open_sessions"], 1);

    let close = format!("{url}/v1/sessions/ep-1/close");
    let (status, closed) = post(&close, r#"{"reward": 1.0, "success": true}"#, &[]);
    assert_eq!(status, 200, "{closed}");
    assert_eq!(closed["steps"], 3);
    let (status, again) = post(&close, r#"{"reward": 1.0}"#, &[]);
    assert_eq!(status, 404, "{again}");
    assert_eq!(again["error"]["type"], "invalid_request_error");

    let dataset = Dataset::open(&data).unwrap();
    let trajs = dataset.trajectories();
    assert_eq!(trajs.len(), 1);
    let records = store::decode_trajectory(&trajs[0]).unwrap();
    assert_eq!(records.len(), 3);
    let mut context = 0;
    for (r, reply) in records.iter().zip(&replies) {
        assert_eq!(
            r.context_len as usize, context,
            "each step extends the last"
        );
        context += r.obs_ids.len() + r.response_ids.len();
        assert_eq!(r.response_ids.len(), r.response_logprobs.len());
        assert_eq!(&r.info.action_text, reply);
    }
    assert_eq!(records[2].reward, 1.0);
    assert!(records[2].terminated && records[2].info.success);
    assert!(store::verify(&data).unwrap().problems.is_empty());
}

/// A Qwen-style template that trims assistant content and drops its `<think>` part when it
/// re-renders a conversation (the checkpoint-template path of the token-space continuation).
const TEMPLATE: &str = "{%- for message in messages %}{%- set content = message.content | trim if message.role == 'assistant' else message.content %}{%- if message.role == 'assistant' and '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{{- '<|im_start|>' + message.role + '\\n' + content.strip() + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

#[test]
fn a_checkpoint_template_continues_sessions_with_the_sampled_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("model");
    let tok = Tokenizer::builtin();
    let model = Model::new(
        &ModelConfig::tiny(tok.vocab_size()),
        3,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    model.save(&model_dir, Some(&tok)).unwrap();
    let config = json!({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"});
    std::fs::write(model_dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let (model, tokenizer) = stepppo::model::checkpoint::load_policy(
        model_dir.to_str().unwrap(),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert!(tokenizer.chat_template().is_some());
    let data = dir.path().join("data");
    let url = start_gateway_with(model, tokenizer, Some(&data));
    let chat = format!("{url}/v1/chat/completions");
    let session = [("x-session-id", "t")];
    let mut messages: Vec<(&str, String)> = vec![("user", "Turn 1".into())];
    for _ in 0..2 {
        let (status, reply) = post(&chat, &chat_body(&messages, json!({})), &session);
        assert_eq!(status, 200, "{reply}");
        messages.push(("assistant", content(&reply)));
        messages.push(("user", "Turn 2".into()));
    }
    assert_eq!(
        post(
            &format!("{url}/v1/sessions/t/close"),
            r#"{"reward": 1}"#,
            &[]
        )
        .0,
        200
    );
    let dataset = Dataset::open(&data).unwrap();
    let records = store::decode_trajectory(&dataset.trajectories()[0]).unwrap();
    let first = &records[0];
    assert_eq!(
        records[1].context_len as usize,
        first.obs_ids.len() + first.response_ids.len()
    );
    let tok = Tokenizer::builtin();
    let added = tok.decode(&records[1].obs_ids);
    assert!(
        added.ends_with("<|im_start|>user\nTurn 2<|im_end|>\n<|im_start|>assistant\n"),
        "{added:?}"
    );
}

/// Parses a server-sent event stream into its JSON chunks (without the final `[DONE]`).
#[test]
fn a_stream_carries_the_same_text_as_the_plain_reply() {
    let url = start_gateway(None);
    let chat = format!("{url}/v1/chat/completions");
    let messages = [("user", "Say something")];
    let (_, plain) = post(&chat, &chat_body(&messages, json!({})), &[]);
    let body = chat_body(
        &messages,
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    );
    let mut resp = agent()
        .post(&chat)
        .header("content-type", "application/json")
        .send(&body)
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let chunks = sse_chunks(&resp.body_mut().read_to_string().unwrap());
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content(&plain));
    let usage = &chunks.last().unwrap()["usage"];
    for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(usage[key], plain["usage"][key], "{key}");
    }
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["prompt_tokens"].as_u64().unwrap() - 1,
        "the second request's prompt comes from the cache (all but its last token)"
    );
    let finish: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter(|c| !c["finish_reason"].is_null())
        .collect();
    assert_eq!(finish.len(), 1);
}

#[test]
fn bad_requests_get_openai_error_bodies_and_the_server_stays_up() {
    let url = start_gateway(None);
    let chat = format!("{url}/v1/chat/completions");
    let cases: Vec<(String, u16, &str)> = vec![
        ("{not json".into(), 400, "malformed"),
        (
            r#"{"model": "tiny-test", "messages": [], "max_tokens": 4}"#.into(),
            400,
            "at least one message",
        ),
        (
            r#"{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 1}"#.into(),
            400,
            "frequency_penalty",
        ),
        (
            r#"{"model": "other", "messages": [{"role": "user", "content": "hi"}]}"#.into(),
            404,
            "not served",
        ),
        (
            r#"{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}"#.into(),
            400,
            "context holds",
        ),
        (
            r#"{"model": "tiny-test", "messages": [{"role": "wizard", "content": "hi"}]}"#.into(),
            400,
            "unknown role",
        ),
        (
            format!(
                r#"{{"model": "tiny-test", "messages": [{{"role": "user", "content": "{}"}}]}}"#,
                "x".repeat(10_000)
            ),
            413,
            "",
        ),
    ];
    for (body, status, needle) in cases {
        let (got, err) = post(&chat, &body, &[]);
        assert_eq!(got, status, "{body:.80}: {err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }
    let (status, err) = post(
        &format!("{url}/v1/sessions/nobody/close"),
        r#"{"reward": 0}"#,
        &[],
    );
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    let (status, _) = get(&format!("{url}/v1/nothing"));
    assert_eq!(status, 404);
    let (status, _) = post(&chat, &chat_body(&[("user", "still up?")], json!({})), &[]);
    assert_eq!(status, 200);
}

#[test]
fn a_killed_recording_server_leaves_every_closed_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("rec");
    let mut child = Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args([
            "serve",
            "--port",
            "0",
            "--default-max-tokens",
            "6",
            "--threads",
            "1",
        ])
        .arg("--record")
        .arg(&data)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split("/v1").next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    let url = format!("http://{addr}");
    for ep in 0..4 {
        let session = format!("s{ep}");
        let body = json!({"model": "builtin", "messages": [{"role": "user", "content": "go"}]});
        let (status, r) = post(
            &format!("{url}/v1/chat/completions"),
            &body.to_string(),
            &[("x-session-id", &session)],
        );
        assert_eq!(status, 200, "{r}");
        if ep < 3 {
            let close = format!("{url}/v1/sessions/{session}/close");
            assert_eq!(post(&close, r#"{"reward": 0.5}"#, &[]).0, 200);
        }
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let dataset = Dataset::open(&data).unwrap();
    let ids: Vec<u64> = dataset.trajectories().iter().map(|t| t.traj_id).collect();
    assert_eq!(
        ids,
        vec![0, 1, 2],
        "every closed session, nothing of the open one"
    );
    // An ordinary step dataset for the other commands, behaviour cloning included.
    let data_s = data.to_str().unwrap();
    let model = dir.path().join("bc");
    for args in [
        vec!["dataset", "verify", data_s],
        vec!["replay", "--advantages", "grpo", data_s],
        vec!["replay", "--stats", data_s],
        vec!["sft", "--dataset", data_s, "--out", model.to_str().unwrap()]
            .into_iter()
            .chain(["--set", "sft.steps=1", "--set", "builtin_size=tiny"])
            .collect(),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_stepppo"))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {err}");
    }
    assert!(model.join("model.safetensors").exists());
}

#[test]
fn the_official_openai_client_talks_to_the_gateway() {
    let Some(python) = examples_python("the_official_openai_client_talks_to_the_gateway") else {
        return;
    };
    let url = start_gateway(None);
    let script = r#"
import json, sys, openai
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
assert [m.id for m in client.models.list()] == ["tiny-test"]
msgs = [{"role": "user", "content": "Turn 1: go"}]
plain = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=6, seed=5,
                                       logprobs=True, extra_headers={"x-session-id": "py"})
text = plain.choices[0].message.content
stream = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=6, seed=5,
                                        stream=True)
streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
many = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=4, n=3)
try:
    client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=10**6)
    refused = None
except openai.BadRequestError as e:
    refused = e.code
print(json.dumps({"text": text, "streamed": streamed, "n": len(many.choices),
                  "logprobs": len(plain.choices[0].logprobs.content),
                  "tokens": plain.usage.completion_tokens, "refused": refused}))
"#;
    let out = Command::new(python)
        .args(["-c", script, &url])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["text"], v["streamed"]);
    assert_eq!(v["n"], 3);
    assert_eq!(v["logprobs"], v["tokens"]);
    assert_eq!(v["refused"], "context_length_exceeded");
}
