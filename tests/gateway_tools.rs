//! Function calling through the gateway over real HTTP on loopback: a small model taught (by
//! behaviour cloning) to call `search` answers with `tool_calls` in plain and streamed replies,
//! its session continues in token space through the tool results, a call that does not parse
//! comes back as text and is recorded with `tool_call_error` and the penalty, bad tool requests
//! get named 400s, and the API key guards every route. The official `openai` client drives the
//! same model where Python has it.

mod examples_python;
mod http_client;
use examples_python::examples_python;
use http_client::{agent, get, sse_chunks};
use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};
use stepppo::model::{Model, ModelConfig};
use stepppo::rollout::engine::{Engine, EngineConfig};
use stepppo::serve::{self, ApiKey, GatewayOptions, PolicyBackend, Recorder};
use stepppo::store::{self, Dataset, StepRecord, WriterOptions};
use stepppo::tokenizer::{ChatTemplate, Message, Tokenizer};
use stepppo::train::warm_start::sft::{behaviour_clone, CloneSettings};
use stepppo::train::BatchLayout;

const MODEL: &str = "tiny-tools";
const SYSTEM: &str = "Answer questions; search first.";
const QUESTION: &str = "What is the capital of France?";
const CALL: &str =
    "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"capital of France\"}}\n</tool_call>";

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "search", "description": "Search Wikipedia.",
         "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
        {"type": "function", "function": {"name": "answer", "description": "Give the final answer.",
         "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    ])
}

fn tool_schemas() -> Vec<String> {
    tools()
        .as_array()
        .unwrap()
        .iter()
        .map(Value::to_string)
        .collect()
}

fn opening_messages() -> Value {
    json!([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
}

/// The tiny built-in model, untrained.
fn untrained_model() -> (Model, Tokenizer) {
    let tok = Tokenizer::builtin();
    let model = Model::new(
        &ModelConfig::tiny(tok.vocab_size()),
        7,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    (model, tok)
}

/// The tiny built-in model taught to answer the opening prompt with [`CALL`].
fn tool_calling_model() -> (Model, Tokenizer) {
    let tok = Tokenizer::builtin();
    let model = Model::new(
        &ModelConfig::tiny(tok.vocab_size()),
        11,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let prompt = ChatTemplate
        .conversation_with_tools(
            &tok,
            &[
                Message::text("system", SYSTEM),
                Message::text("user", QUESTION),
            ],
            &tool_schemas(),
        )
        .unwrap();
    let mut response = tok.encode(CALL);
    response.push(tok.eos_id());
    let record = StepRecord {
        obs_ids: prompt,
        response_logprobs: vec![0.0; response.len()],
        response_ids: response,
        terminated: true,
        ..StepRecord::default()
    };
    let settings = CloneSettings {
        steps: 120,
        batch_size: 1,
        lr: 3e-3,
        observation_loss_coef: 0.0,
        seed: 0,
        layout: BatchLayout {
            pad_id: tok.pad_id(),
            tree: false,
        },
    };
    behaviour_clone(&model, &[record], settings, None).unwrap();
    (model, tok)
}

fn start(model: Model, tokenizer: Tokenizer, record: Option<&Path>, key: Option<&str>) -> String {
    let device = candle_core::Device::Cpu;
    let engine = Engine::new(model.config(), EngineConfig::default(), &device).unwrap();
    let recorder = record.map(|d| Recorder::open(d, WriterOptions::default()).unwrap());
    let mut opts = GatewayOptions::new(MODEL, 1024, 0);
    opts.port = 0;
    opts.api_key = key.map(|k| ApiKey::new(k).unwrap());
    opts.worker.default_max_tokens = 128;
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

fn post(url: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
    http_client::post(url, &body.to_string(), headers)
}

fn request(messages: Value, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": messages, "tools": tools(),
                          "temperature": 0, "max_tokens": 128});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// Every record of the dataset at `dir`, trajectory by trajectory (none when it has none yet).
fn recorded(dir: &Path) -> Vec<StepRecord> {
    let Ok(dataset) = Dataset::open(dir) else {
        return Vec::new();
    };
    dataset
        .trajectories()
        .iter()
        .flat_map(|t| store::decode_trajectory(t).unwrap())
        .collect()
}

#[test]
fn a_model_that_calls_tools_is_served_and_recorded_as_steps() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("tools-data");
    let (model, tok) = tool_calling_model();
    let url = start(model, tok.clone(), Some(&data), None);
    let chat = format!("{url}/v1/chat/completions");
    let session = [("x-session-id", "agent-1")];

    let (status, reply) = post(&chat, &request(opening_messages(), json!({})), &session);
    assert_eq!(status, 200, "{reply}");
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{reply}");
    let message = &choice["message"];
    assert!(message["content"].is_null(), "{message}");
    let call = &message["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "search");
    assert_eq!(
        call["function"]["arguments"],
        r#"{"query":"capital of France"}"#
    );
    assert!(call["id"].as_str().unwrap().starts_with("call_"));

    // The stream carries the same call as deltas the official client assembles.
    let mut resp = agent()
        .post(&chat)
        .header("content-type", "application/json")
        .send(request(opening_messages(), json!({"stream": true})).to_string())
        .unwrap();
    let chunks = sse_chunks(&resp.body_mut().read_to_string().unwrap());
    let streamed_text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed_text, "", "the call is never streamed as text");
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(deltas.len(), 1);
    assert_eq!(deltas[0][0]["index"], 0);
    assert_eq!(deltas[0][0]["function"], call["function"]);
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("tool_calls")]);

    // The agent runs the call and sends the result: the session continues in token space.
    let mut messages = opening_messages().as_array().unwrap().clone();
    messages.push(message.clone());
    messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "Paris is the capital of France."}));
    let (status, second) = post(
        &chat,
        &request(Value::Array(messages), json!({"max_tokens": 4})),
        &session,
    );
    assert_eq!(status, 200, "{second}");
    let (status, closed) = post(
        &format!("{url}/v1/sessions/agent-1/close"),
        &json!({"reward": 1.0, "success": true}),
        &[],
    );
    assert_eq!(status, 200, "{closed}");

    let records = recorded(&data);
    assert_eq!(records.len(), 2);
    let (first, next) = (&records[0], &records[1]);
    assert_eq!(
        tok.decode(&first.response_ids)
            .trim_end_matches("<|im_end|>"),
        CALL
    );
    assert!(!first.info.tool_call_error && first.info.action_is_valid);
    assert_eq!(
        next.context_len as usize,
        first.obs_ids.len() + first.response_ids.len(),
        "the tool result extends the sampled call"
    );
    assert!(!next.info.context_rebuilt);
    let observed = tok.decode(&next.obs_ids);
    assert!(
        observed.contains("<tool_response>\nParis is the capital of France.\n</tool_response>"),
        "{observed:?}"
    );
    assert!(
        next.info.observation_text.contains("tool ("),
        "{}",
        next.info.observation_text
    );
    assert_eq!(next.reward, 1.0);
}

#[test]
fn a_call_that_does_not_parse_comes_back_as_text_and_costs_the_penalty() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("bad-calls");
    let (model, tok) = tool_calling_model();
    let url = start(model, tok, Some(&data), None);
    let chat = format!("{url}/v1/chat/completions");
    // Cut before its closing tag by a stop string, the model's call does not parse.
    let (status, reply) = post(
        &chat,
        &request(opening_messages(), json!({"stop": ["</tool_call>"]})),
        &[("x-session-id", "bad")],
    );
    assert_eq!(status, 200, "{reply}");
    let message = &reply["choices"][0]["message"];
    assert!(message.get("tool_calls").is_none(), "{message}");
    assert_eq!(reply["choices"][0]["finish_reason"], "stop");
    let text = message["content"].as_str().unwrap();
    assert_eq!(
        text,
        CALL.trim_end_matches("</tool_call>"),
        "returned as text"
    );
    let (status, _) = post(
        &format!("{url}/v1/sessions/bad/close"),
        &json!({"reward": 0.5}),
        &[],
    );
    assert_eq!(status, 200);
    let records = recorded(&data);
    let info = &records[0].info;
    assert!(info.tool_call_error && !info.action_is_valid);
    assert_eq!(info.format_penalty, serve::DEFAULT_TOOL_CALL_PENALTY);
    assert_eq!(records[0].reward, 0.5 + serve::DEFAULT_TOOL_CALL_PENALTY);

    // A recording gateway refuses a forced call: the constrained log-probs would be stored as if
    // sampled freely.
    let named = json!({"type": "function", "function": {"name": "answer"}});
    let (status, v) = post(
        &chat,
        &request(opening_messages(), json!({"tool_choice": named})),
        &[],
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "tool_choice");
}

#[test]
fn bad_tool_requests_are_refused_naming_the_parameter() {
    let (model, tok) = untrained_model();
    let url = start(model, tok, None, None);
    let chat = format!("{url}/v1/chat/completions");
    let user = json!({"role": "user", "content": "hi"});
    let call =
        json!({"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}});
    let cases = [
        (
            request(json!([user]), json!({"tools": [{"type": "retrieval"}]})),
            "tools[0]",
        ),
        (
            request(
                json!([user]),
                json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}),
            ),
            "tools[0].function.name",
        ),
        (
            request(
                json!([user]),
                json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            ),
            "tool_choice",
        ),
        (
            json!({"model": MODEL, "messages": [user], "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            request(
                json!([user, {"role": "tool", "tool_call_id": "c9", "content": "x"}]),
                json!({}),
            ),
            "messages[1].tool_call_id",
        ),
        (
            request(
                json!([{"role": "user", "content": "hi", "tool_calls": [call]}]),
                json!({}),
            ),
            "messages[0].tool_calls",
        ),
        (
            request(
                json!([user, {"role": "assistant", "content": null}]),
                json!({}),
            ),
            "messages[1].content",
        ),
        (
            request(
                json!([user, {"role": "assistant", "content": "no", "refusal": "I refuse"}]),
                json!({}),
            ),
            "messages[1].refusal",
        ),
    ];
    for (body, param) in cases {
        let (status, v) = post(&chat, &body, &[]);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    // A history echoed back as clients append response messages is accepted.
    let echoed = json!([user, {"role": "assistant", "content": null, "refusal": null,
                               "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "c1", "content": "result"}]);
    let (status, v) = post(&chat, &request(echoed, json!({"max_tokens": 2})), &[]);
    assert_eq!(status, 200, "{v}");

    // Forced to open a call of `answer`, the untrained model writes no valid JSON after it.
    let named = json!({"type": "function", "function": {"name": "answer"}});
    let (status, reply) = post(
        &chat,
        &request(
            json!([user]),
            json!({"tool_choice": named, "max_tokens": 40, "temperature": 1.0, "seed": 2}),
        ),
        &[],
    );
    assert_eq!(status, 200, "{reply}");
    let message = &reply["choices"][0]["message"];
    assert!(message.get("tool_calls").is_none(), "{message}");
    let text = message["content"].as_str().unwrap();
    assert!(
        text.starts_with("<tool_call>\n{\"name\": \"answer\", \"arguments\":"),
        "the forced opening: {text:?}"
    );
}

#[test]
fn the_api_key_guards_every_route() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("guarded");
    let (model, tok) = untrained_model();
    let url = start(model, tok, Some(&data), Some("sk-local-test"));
    let chat = format!("{url}/v1/chat/completions");
    let body =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let good = [
        ("authorization", "Bearer sk-local-test"),
        ("x-session-id", "s"),
    ];
    let (status, _) = post(&chat, &body, &good);
    assert_eq!(status, 200);
    for headers in [&[][..], &[("authorization", "Bearer sk-wrong")][..]] {
        for route in [
            "/v1/chat/completions",
            "/v1/sessions/s/close",
            "/v1/nowhere",
        ] {
            let (status, v) = post(&format!("{url}{route}"), &json!({"reward": 1.0}), headers);
            assert_eq!(status, 401, "{route}: {v}");
            assert_eq!(v["error"]["code"], "invalid_api_key");
        }
        let (status, v) = get(&format!("{url}/v1/stats"));
        assert_eq!(status, 401);
        assert!(!v.to_string().contains("sk-local-test"), "{v}");
    }
    assert!(
        recorded(&data).is_empty(),
        "a refused close records nothing"
    );
    let (status, v) = post(
        &format!("{url}/v1/sessions/s/close"),
        &json!({"reward": 1.0}),
        &good,
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(recorded(&data).len(), 1);

    // Without a key, only loopback may be bound.
    let mut opts = GatewayOptions::new(MODEL, 64, 0);
    opts.host = "0.0.0.0".into();
    opts.port = 0;
    let err = serve::start(&opts).err().expect("refused").to_string();
    assert!(
        err.contains("API key") && err.contains("STEPPPO_API_KEY"),
        "{err}"
    );
}

#[test]
fn the_official_openai_client_calls_tools_through_the_gateway() {
    let Some(python) =
        examples_python("the_official_openai_client_calls_tools_through_the_gateway")
    else {
        return;
    };
    let (model, tok) = tool_calling_model();
    let url = start(model, tok, None, Some("sk-py"));
    let script = r#"
import json, sys, openai
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="sk-py")
tools = json.loads(sys.argv[2])
msgs = [{"role": "system", "content": sys.argv[3]}, {"role": "user", "content": sys.argv[4]}]
plain = client.chat.completions.create(model="tiny-tools", messages=msgs, tools=tools,
                                       temperature=0, max_tokens=128)
message = plain.choices[0].message
with client.chat.completions.stream(model="tiny-tools", messages=msgs, tools=tools,
                                    temperature=0, max_tokens=128) as stream:
    final = stream.get_final_completion()
streamed = final.choices[0].message
msgs.append(message)
msgs.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Paris."})
after = client.chat.completions.create(model="tiny-tools", messages=msgs, tools=tools,
                                       temperature=0, max_tokens=4)
try:
    openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="wrong").models.list()
    denied = None
except openai.AuthenticationError as e:
    denied = e.status_code
call = message.tool_calls[0]
print(json.dumps({"finish": plain.choices[0].finish_reason, "name": call.function.name,
                  "arguments": json.loads(call.function.arguments),
                  "streamed": [streamed.tool_calls[0].function.name, streamed.tool_calls[0].function.arguments],
                  "after": after.choices[0].finish_reason is not None, "denied": denied}))
"#;
    let out = Command::new(python)
        .args(["-c", script, &url, &tools().to_string(), SYSTEM, QUESTION])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["finish"], "tool_calls");
    assert_eq!(v["name"], "search");
    assert_eq!(v["arguments"], json!({"query": "capital of France"}));
    assert_eq!(
        v["streamed"],
        json!(["search", r#"{"query":"capital of France"}"#])
    );
    assert_eq!(v["after"], true);
    assert_eq!(v["denied"], 401);
}

/// `stepppo env serve` on a free port, killed when dropped.
struct EnvServer {
    child: std::process::Child,
    url: String,
}

impl EnvServer {
    fn start(sets: &[&str]) -> Self {
        use std::io::BufRead;
        let mut args = vec!["env", "serve", "hotpotqa", "--port", "0"];
        for s in sets {
            args.extend(["--set", s]);
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_stepppo"))
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_string();
        Self { child, url }
    }
}

impl Drop for EnvServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const SEARCH_ENV: [&str; 5] = [
    "world=generated",
    "world_size=60",
    "episode_worlds=true",
    "corpus=distractor",
    "tools=true",
];

/// The env server plays an episode of the protocol's tool mode over HTTP: the functions, a
/// search call answered by a tool result with the call's id, a reply that calls nothing answered
/// by a user message, an answer that ends the episode; bad requests are refused naming the field.
#[test]
fn the_env_server_plays_tool_mode_episodes_over_http_and_refuses_bad_requests() {
    let server = EnvServer::start(&SEARCH_ENV);
    let url = &server.url;
    let (status, spec) = get(&format!("{url}/agent/spec"));
    assert_eq!(status, 200, "{spec}");
    assert_eq!(spec["tools"][0]["function"]["name"], "search");
    assert_eq!(spec["tools"][1]["function"]["name"], "answer");
    let (status, episode) = post(&format!("{url}/agent/reset"), &json!({"seed": 3}), &[]);
    assert_eq!(status, 200, "{episode}");
    assert!(episode["user"].as_str().unwrap().contains("Question: "));
    assert_eq!(episode["tools"], spec["tools"]);
    let id = episode["env_id"].clone();
    let step = |message: Value| {
        post(
            &format!("{url}/agent/step"),
            &json!({"env_id": id, "message": message}),
            &[],
        )
    };

    let call = |name: &str, arguments: Value| {
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_x", "type": "function",
               "function": {"name": name, "arguments": arguments.to_string()}}]})
    };
    let (status, out) = step(call("search", json!({"query": "Studios"})));
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["tool_results"][0]["tool_call_id"], "call_x");
    assert!(out["tool_results"][0]["content"]
        .as_str()
        .unwrap()
        .starts_with("<information>"));
    assert_eq!(
        (out["done"].clone(), out["user"].clone()),
        (json!(false), Value::Null)
    );

    let (_, out) = step(json!({"role": "assistant", "content": "I think so."}));
    assert_eq!(out["reward"].as_f64().unwrap(), -0.1, "{out}");
    assert!(out["user"].as_str().unwrap().contains("search, answer"));
    assert_eq!(out["info"]["tool_call_error"], false);

    let (_, out) = step(json!({"role": "assistant", "content": "<tool_call>{\"name\": "}));
    assert_eq!(out["info"]["tool_call_error"], true, "{out}");

    let (_, out) = step(call("answer", json!({"answer": "nobody"})));
    assert_eq!(
        (out["done"].clone(), out["terminated"].clone()),
        (json!(true), json!(true))
    );
    assert_eq!(out["info"]["success"], false);

    let (status, out) = step(call("answer", json!({"answer": "again"})));
    assert_eq!(status, 409, "{out}");
    let (status, out) = post(
        &format!("{url}/agent/step"),
        &json!({"env_id": "ep-99", "message": {}}),
        &[],
    );
    assert_eq!(status, 404);
    assert!(out["error"].as_str().unwrap().contains("env_id"), "{out}");
    let (status, out) = post(&format!("{url}/agent/reset"), &json!({"seed": "x"}), &[]);
    assert_eq!(status, 400);
    assert!(out["error"].as_str().unwrap().contains("seed"), "{out}");
    let (status, _) = post(&format!("{url}/agent/close"), &json!({"env_id": id}), &[]);
    assert_eq!(status, 200);
    // The env bridge's routes are another protocol's: a 404 that says which this server speaks.
    let (status, out) = get(&format!("{url}/spec"));
    assert_eq!(status, 404);
    let error = out["error"].as_str().unwrap();
    assert!(
        error.contains("agent protocol") && error.contains("/agent/reset"),
        "{out}"
    );
}

/// `examples/openai_search_agent.py` (the official `openai` client) plays the env server's
/// episodes through a recording gateway: each episode's first step holds the env's functions and
/// question as the template renders them, and its turns are recorded as steps.
#[test]
fn the_python_search_agent_plays_the_env_servers_episodes_through_the_gateway() {
    let test = "the_python_search_agent_plays_the_env_servers_episodes_through_the_gateway";
    let Some(python) = examples_python(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (model, tok) = untrained_model();
    let gateway = start(model, tok.clone(), Some(dir.path()), None);
    let server = EnvServer::start(&SEARCH_ENV);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/openai_search_agent.py");
    let out = Command::new(python)
        .arg(&script)
        .args([
            "--base-url",
            &format!("{gateway}/v1"),
            "--env-url",
            &server.url,
        ])
        .args([
            "--model",
            MODEL,
            "--questions",
            "1",
            "--group",
            "2",
            "--report-every",
            "2",
        ])
        .args(["--max-tokens", "16"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(report, json!({"episodes": 2, "em": 0.0}));
    let records = recorded(dir.path());
    let firsts: Vec<&StepRecord> = records.iter().filter(|r| r.step_index == 0).collect();
    assert_eq!(firsts.len(), 2, "two episodes recorded");
    let prompt = tok.decode(&firsts[0].obs_ids);
    assert!(
        prompt.contains("<tools>") && prompt.contains("\"name\":\"search\""),
        "{prompt}"
    );
    assert!(prompt.contains("Question: "), "{prompt}");
    assert_eq!(
        firsts[0].obs_ids, firsts[1].obs_ids,
        "one question, one prompt"
    );
    assert!(
        records.len() > 2,
        "the episodes went on after a reply that called nothing"
    );
}
