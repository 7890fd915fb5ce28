//! The bridge protocol's optional fields against an axum server in this process: a free-text
//! guessing game that takes seeds up to `seed_max` only, gives each episode its own instruction,
//! and offers an `oracle_action` and the `admissible_actions` of each state. Larger seeds reach it
//! modulo its range, the first message carries the episode's instruction, the oracle agent plays
//! the offered action and solves every episode, and the random agent draws among the admissible
//! ones; a server that offers neither leaves both agents with an error saying so. Constrained
//! decoding samples among each state's admissible actions, keeps them with the step, and the
//! update scores the step under the same grammar.

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use candle_core::Device;
use serde_json::{json, Value};
use stepppo::env::{build_session, play_episode, Agent, AgentKind};
use stepppo::model::{Model, ModelConfig};
use stepppo::rollout::agent_loop::{run_rollout, ContextLayout, RolloutConfig};
use stepppo::rollout::engine::{Engine, EngineConfig};
use stepppo::tokenizer::{ChatTemplate, Tokenizer};
use stepppo::train::learner::batch::trajectories;
use stepppo::train::learner::masks::ResponseMasks;
use stepppo::train::learner::scoring::response_logprobs;
use stepppo::train::BatchLayout;

/// The largest seed the game takes.
const SEED_MAX: u64 = 99;

/// One game: the number to guess is the seed; the admissible guesses are the seed and its two
/// neighbours above.
#[derive(Default)]
struct Game {
    secret: u64,
    guesses: Vec<String>,
}

#[derive(Clone)]
struct Shared {
    /// Whether answers carry `oracle_action` and `admissible_actions`.
    offers: bool,
    games: Arc<Mutex<Vec<Game>>>,
    /// Every seed `/reset` received.
    seeds: Arc<Mutex<Vec<u64>>>,
}

fn answer(status: StatusCode, body: Value) -> Response {
    (
        status,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn admissible(secret: u64) -> Vec<String> {
    (secret..secret + 3).map(|n| n.to_string()).collect()
}

async fn spec() -> Response {
    answer(
        StatusCode::OK,
        json!({"name": "guess", "instruction": "Guess the number.", "actions": null,
               "max_steps": 6, "seed_max": SEED_MAX}),
    )
}

async fn reset(State(s): State<Shared>, body: String) -> Response {
    let seed = serde_json::from_str::<Value>(&body).unwrap()["seed"]
        .as_u64()
        .unwrap();
    s.seeds.lock().unwrap().push(seed);
    if seed > SEED_MAX {
        let error = format!("seed {seed} is out of range 0..={SEED_MAX}");
        return answer(StatusCode::BAD_REQUEST, json!({ "error": error }));
    }
    let mut games = s.games.lock().unwrap();
    games.push(Game {
        secret: seed,
        guesses: Vec::new(),
    });
    let mut out = json!({
        "env_id": (games.len() - 1).to_string(),
        "observation": "No guess yet.",
        "instruction": format!("Guess the number of game {seed}: it lies in {seed}..={}.", seed + 2),
    });
    if s.offers {
        out["oracle_action"] = json!(seed.to_string());
        out["admissible_actions"] = json!(admissible(seed));
    }
    answer(StatusCode::OK, out)
}

async fn step(State(s): State<Shared>, body: String) -> Response {
    let body: Value = serde_json::from_str(&body).unwrap();
    let id: usize = body["env_id"].as_str().unwrap().parse().unwrap();
    let guess = body["action"].as_str().unwrap().to_string();
    let mut games = s.games.lock().unwrap();
    let game = &mut games[id];
    game.guesses.push(guess.clone());
    let right = guess == game.secret.to_string();
    let mut out = json!({
        "observation": if right { "Right." } else { "Wrong." },
        "reward": if right { 1.0 } else { 0.0 },
        "terminated": right, "truncated": false, "info": {"success": right},
    });
    if s.offers && !right {
        out["oracle_action"] = json!(game.secret.to_string());
        out["admissible_actions"] = json!(admissible(game.secret));
    }
    answer(StatusCode::OK, out)
}

async fn close() -> Response {
    answer(StatusCode::OK, json!({}))
}

/// The game served on a free port; stopped when dropped.
struct GuessServer {
    runtime: Option<tokio::runtime::Runtime>,
    url: String,
    shared: Shared,
}

impl GuessServer {
    fn start(offers: bool) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let shared = Shared {
            offers,
            games: Arc::default(),
            seeds: Arc::default(),
        };
        let app = Router::new()
            .route("/spec", get(spec))
            .route("/reset", post(reset))
            .route("/step", post(step))
            .route("/close", post(close))
            .with_state(shared.clone());
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        runtime.spawn(async move { axum::serve(listener, app).await });
        GuessServer {
            runtime: Some(runtime),
            url,
            shared,
        }
    }

    fn config(&self) -> Value {
        json!({"url": self.url, "timeout": 5.0, "max_turns": 6})
    }
}

impl Drop for GuessServer {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[test]
fn seeds_beyond_seed_max_arrive_modulo_its_range_and_each_episode_has_its_instruction() {
    let server = GuessServer::start(true);
    let mut session = build_session("remote", &server.config()).unwrap();
    let first = session.reset(1234).unwrap();
    assert_eq!(*server.shared.seeds.lock().unwrap(), vec![1234 % 100]);
    assert!(
        first.starts_with("Guess the number of game 34: it lies in 34..=36."),
        "{first}"
    );
    let again = session.reset(34).unwrap();
    assert_eq!(first, again, "seed 1234 is seed 34 to this server");
    let small = session.reset(7).unwrap();
    assert!(small.contains("game 7"), "{small}");
}

#[test]
fn the_oracle_plays_the_offered_action_and_the_random_agent_the_admissible_ones() {
    let server = GuessServer::start(true);
    let mut session = build_session("remote", &server.config()).unwrap();
    for seed in [3, 250, u64::MAX] {
        let mut oracle = Agent::new(AgentKind::Oracle, seed);
        let episode = play_episode(&mut session, seed, &mut |s| oracle.respond(s)).unwrap();
        assert!(episode.success(), "seed {seed}: the oracle guesses right");
        assert_eq!(episode.steps(), 1, "seed {seed}");
    }
    let mut random = Agent::new(AgentKind::Random, 5);
    let mut solved = 0;
    for seed in 0..20 {
        let episode = play_episode(&mut session, seed, &mut |s| random.respond(s)).unwrap();
        solved += usize::from(episode.success());
    }
    let games = server.shared.games.lock().unwrap();
    let random_games = &games[3..];
    for game in random_games {
        let allowed = admissible(game.secret);
        assert!(
            game.guesses.iter().all(|g| allowed.contains(g)),
            "{:?} outside {allowed:?}",
            game.guesses
        );
    }
    assert!(
        solved >= 15,
        "three admissible guesses in six turns: {solved}/20"
    );
}

#[test]
fn without_offers_the_oracle_and_the_random_agent_say_what_is_missing() {
    let server = GuessServer::start(false);
    for (kind, missing) in [
        (AgentKind::Oracle, "oracle_action"),
        (AgentKind::Random, "admissible_actions"),
    ] {
        let mut session = build_session("remote", &server.config()).unwrap();
        let mut agent = Agent::new(kind, 1);
        let err = play_episode(&mut session, 1, &mut |s| agent.respond(s))
            .expect_err("nothing to play")
            .to_string();
        assert!(err.contains(missing), "{kind:?}: {err}");
    }
}

/// A rollout of the tiny random model under constrained decoding (`remote` env, Concat layout).
fn constrained_rollout(
    server: &GuessServer,
) -> Result<(Vec<stepppo::store::StepRecord>, Tokenizer, Model), String> {
    let tok = Tokenizer::builtin();
    let cfg = ModelConfig::tiny(tok.vocab_size());
    let model = Model::new(&cfg, 3, &Device::Cpu).unwrap();
    let mut engine = Engine::new(&cfg, EngineConfig::default(), &Device::Cpu).unwrap();
    let rollout_cfg = RolloutConfig {
        env_name: "remote".into(),
        env_config: server.config(),
        num_groups: 3,
        group_size: 2,
        base_seed: 11,
        max_new_tokens: 16,
        max_turns: 4,
        layout: ContextLayout::Concat,
        constrained_decoding: true,
        ..RolloutConfig::default()
    };
    let out = run_rollout(
        &mut engine,
        &model,
        &tok,
        &ChatTemplate,
        &rollout_cfg,
        &mut |_| Ok(()),
    )
    .map_err(|e| e.to_string())?;
    Ok((out.records, tok, model))
}

/// Constrained decoding over a free-text env that offers each state's admissible actions: every
/// response names one of them, the record keeps the list, and the update scores the response
/// under the grammar of that list (the rollout's log-probs again), which the whole vocabulary
/// does not give.
#[test]
fn constrained_decoding_samples_among_each_state_s_admissible_actions() {
    let server = GuessServer::start(true);
    let (records, tok, model) = constrained_rollout(&server).unwrap();
    assert!(records.len() > 6, "{} steps", records.len());
    let secrets: Vec<u64> = (server.shared.games.lock().unwrap().iter())
        .map(|g| g.secret)
        .collect();
    for r in &records {
        let text = tok.decode(&r.response_ids);
        let guess = text
            .strip_prefix("<answer>")
            .and_then(|t| t.strip_suffix("</answer>"))
            .unwrap_or_else(|| panic!("not an answer: {text:?}"));
        assert!(r.admissible_actions.iter().any(|a| a == guess), "{text:?}");
        assert!(
            secrets
                .iter()
                .any(|&s| admissible(s) == r.admissible_actions),
            "{:?}",
            r.admissible_actions
        );
    }
    let session = build_session("remote", &server.config()).unwrap();
    let tag = records[0].env_tag.clone();
    let vocab = model.config().vocab_size;
    let masks = ResponseMasks::for_envs(&tok, [(tag, session)], vocab).unwrap();
    let seqs = trajectories(&records);
    let layout = BatchLayout {
        pad_id: tok.pad_id(),
        tree: true,
    };
    let scored = response_logprobs(&model, &records, &seqs, (4, layout), 1.0, &masks).unwrap();
    let free = ResponseMasks::default();
    let unmasked = response_logprobs(&model, &records, &seqs, (4, layout), 1.0, &free).unwrap();
    let mut lower = 0;
    for (r, (lp, free)) in records.iter().zip(scored.iter().zip(&unmasked)) {
        for (j, (&a, &b)) in r.response_logprobs.iter().zip(lp).enumerate() {
            assert!((a - b).abs() < 1e-4, "token {j}: rollout {a} update {b}");
        }
        lower += free.iter().zip(lp).filter(|(f, c)| *f < *c).count();
    }
    assert!(
        lower > 0,
        "over the whole vocabulary the tokens score lower"
    );
}

#[test]
fn constrained_decoding_over_free_text_without_admissible_actions_is_an_error() {
    let server = GuessServer::start(false);
    let err = constrained_rollout(&server)
        .err()
        .expect("nothing to choose among");
    assert!(err.contains("offered no `admissible_actions`"), "{err}");
}
