//! The gateway under load, over real HTTP on loopback, next to the same sessions run through the
//! trainer's own agent loop. A load generator plays FrozenLake episodes (8 turns, replies of at
//! most 8 tokens, each turn continuing its conversation so the gateway extends the session's
//! context in token space) with 1, 8 and 32 sessions at once, 32 sessions per level, against
//! `stepppo serve`'s backend with the built-in `small` model on one compute thread. Printed per
//! level: wall time, requests/s, completion tokens/s, request latency p50/p99, and the prefix hit
//! ratio (prompt tokens served from the radix cache / prompt tokens), overall and by turn. Then
//! `run_rollout` over 32 trajectories of the same env with the same engine settings. Last, the
//! latency of short requests while another client keeps a long generation running.
//!
//! ```text
//! cargo bench --bench gateway
//! ```

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use stepppo::env::build_session;
use stepppo::model::checkpoint::builtin_policy;
use stepppo::rollout::agent_loop::{run_rollout, ContextLayout, RolloutConfig};
use stepppo::rollout::engine::{Engine, EngineConfig};
use stepppo::seed;
use stepppo::serve::{self, GatewayOptions, PolicyBackend};
use stepppo::tokenizer::ChatTemplate;

const SESSIONS: usize = 32;
const TURNS: usize = 8;
const MAX_TOKENS: usize = 8;
const LEVELS: [usize; 3] = [1, 8, 32];

fn env_config() -> Value {
    json!({"max_turns": TURNS})
}

/// One turn's outcome as the load generator saw it.
struct TurnTiming {
    turn: usize,
    latency: Duration,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
}

/// Plays one FrozenLake episode as a gateway session.
fn play_session(url: &str, id: &str, env_seed: u64) -> Vec<TurnTiming> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(600)))
        .build()
        .into();
    let mut session = build_session("frozen_lake", &env_config()).expect("env");
    let mut messages = vec![
        json!({"role": "system", "content": session.system_prompt()}),
        json!({"role": "user", "content": session.reset(env_seed).expect("reset")}),
    ];
    let mut out = Vec::new();
    for turn in 0.. {
        let body = json!({"model": "builtin", "messages": messages, "max_tokens": MAX_TOKENS});
        let t = Instant::now();
        let mut resp = agent
            .post(&format!("{url}/v1/chat/completions"))
            .header("x-session-id", id)
            .send_json(&body)
            .expect("completion");
        let reply: Value = resp.body_mut().read_json().expect("json");
        let latency = t.elapsed();
        let usage = &reply["usage"];
        out.push(TurnTiming {
            turn,
            latency,
            prompt_tokens: usage["prompt_tokens"].as_u64().unwrap(),
            cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
            completion_tokens: usage["completion_tokens"].as_u64().unwrap(),
        });
        let text = reply["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let Some(next) = session.act(&text).expect("act").next_user_message else {
            break;
        };
        messages.push(json!({"role": "assistant", "content": text}));
        messages.push(json!({"role": "user", "content": next}));
    }
    agent
        .post(&format!("{url}/v1/sessions/{id}/close"))
        .send_json(json!({"reward": 0.0}))
        .expect("close");
    out
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

fn ratio(cached: u64, prompt: u64) -> f64 {
    cached as f64 / prompt.max(1) as f64
}

fn run_level(url: &str, concurrent: usize) {
    let per_client = SESSIONS / concurrent;
    let start = Instant::now();
    let handles: Vec<_> = (0..concurrent)
        .map(|c| {
            let url = url.to_string();
            std::thread::spawn(move || {
                (0..per_client)
                    .flat_map(|k| {
                        let i = (c * per_client + k) as u64;
                        let id = format!("c{concurrent}-s{i}");
                        play_session(&url, &id, seed::derive(100 + concurrent as u64, &[i]))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let turns: Vec<TurnTiming> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("client"))
        .collect();
    let wall = start.elapsed().as_secs_f64();
    let mut latencies: Vec<Duration> = turns.iter().map(|t| t.latency).collect();
    latencies.sort();
    let completion: u64 = turns.iter().map(|t| t.completion_tokens).sum();
    let prompt: u64 = turns.iter().map(|t| t.prompt_tokens).sum();
    let cached: u64 = turns.iter().map(|t| t.cached_tokens).sum();
    let by_turn: Vec<String> = (0..TURNS)
        .map(|k| {
            let at: Vec<&TurnTiming> = turns.iter().filter(|t| t.turn == k).collect();
            let (c, p) = at.iter().fold((0, 0), |(c, p), t| {
                (c + t.cached_tokens, p + t.prompt_tokens)
            });
            format!("{:.2}", ratio(c, p))
        })
        .collect();
    println!(
        "| gateway, {concurrent:>2} concurrent | {wall:6.2} | {:6.1} | {:7.1} | {:7.1} | {:7.1} | {:.3} | {} |",
        turns.len() as f64 / wall,
        completion as f64 / wall,
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        ratio(cached, prompt),
        by_turn.join(" ")
    );
}

/// Latency of short requests (8 tokens) sent one after another while another client keeps a
/// long generation (256 tokens) running: with continuous batching a short request joins the
/// running call and returns after its own tokens, not after the long one's.
fn run_short_beside_long(url: &str) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(600)))
        .build()
        .into();
    let long_url = format!("{url}/v1/chat/completions");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let long = {
        let (agent, stop) = (agent.clone(), stop.clone());
        std::thread::spawn(move || {
            let body = json!({"model": "builtin", "max_tokens": 256, "seed": 1,
                              "messages": [{"role": "user", "content": "Tell a long story."}]});
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                agent
                    .post(&long_url)
                    .send_json(&body)
                    .expect("long request");
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let mut latencies = Vec::new();
    for i in 0..20 {
        let body = json!({"model": "builtin", "max_tokens": MAX_TOKENS, "seed": i,
                          "messages": [{"role": "user", "content": format!("Short {i}")}]});
        let t = Instant::now();
        agent
            .post(&format!("{url}/v1/chat/completions"))
            .send_json(&body)
            .expect("short request");
        latencies.push(t.elapsed());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    long.join().expect("long client");
    latencies.sort();
    println!(
        "\nshort requests ({MAX_TOKENS} tokens) beside a running 256-token generation: p50 {:.1} ms, p99 {:.1} ms",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99)
    );
}

fn run_agent_loop() {
    let device = candle_core::Device::Cpu;
    let (model, tok) = builtin_policy(&device).expect("model");
    let mut engine = Engine::new(model.config(), EngineConfig::default(), &device).expect("engine");
    let cfg = RolloutConfig {
        env_name: "frozen_lake".into(),
        env_config: env_config(),
        num_groups: SESSIONS,
        group_size: 1,
        base_seed: 1000,
        max_new_tokens: MAX_TOKENS,
        max_turns: TURNS,
        layout: ContextLayout::Concat,
        ..RolloutConfig::default()
    };
    let start = Instant::now();
    let rollout = run_rollout(&mut engine, &model, &tok, &ChatTemplate, &cfg, &mut |_| {
        Ok(())
    })
    .expect("rollout");
    let wall = start.elapsed().as_secs_f64();
    let c = &rollout.stats.cache;
    println!(
        "| agent loop, {SESSIONS} at once | {wall:6.2} | {:6.1} | {:7.1} | – | – | {:.3} | – |",
        c.requests as f64 / wall,
        c.decode_tokens as f64 / wall,
        c.hit_ratio()
    );
}

fn main() {
    // One compute thread, as the training defaults use.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    let device = candle_core::Device::Cpu;
    let (model, tokenizer) = builtin_policy(&device).expect("model");
    let engine = Engine::new(model.config(), EngineConfig::default(), &device).expect("engine");
    let mut opts = GatewayOptions::new("builtin", model.config().max_position_embeddings, 0);
    opts.port = 0;
    let gateway = serve::start(&opts).expect("gateway");
    let url = format!("http://{}", gateway.addr());
    gateway.spawn(PolicyBackend {
        model,
        tokenizer,
        engine,
        recorder: None,
    });
    println!(
        "{SESSIONS} FrozenLake sessions of {TURNS} turns, replies ≤ {MAX_TOKENS} tokens, built-in `small`, 1 compute thread\n"
    );
    println!("| arm | wall s | req/s | tokens/s | p50 ms | p99 ms | prefix hit | hit by turn 1..{TURNS} |");
    println!("|---|---|---|---|---|---|---|---|");
    for concurrent in LEVELS {
        run_level(&url, concurrent);
    }
    run_agent_loop();
    run_short_beside_long(&url);
}
