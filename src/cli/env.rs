//! `stepppo env list | play | synth-hotpotqa | serve`: list the registered environments, play
//! them with a model-free agent (or a person on stdin), regenerate the synthetic HotpotQA fixture
//! or write the questions of a generated world, and serve an env to agents in another process.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use serde_json::{json, Map, Value};

use stepppo::env::{self, hotpotqa, Agent, AgentKind, AgentSession, Episode};
use stepppo::serve::env_server::{serve_env, EnvSpec};

#[derive(Subcommand, Debug)]
pub enum EnvCommand {
    /// List registered environments.
    List,
    /// Play episodes with a model-free agent (random, oracle) or from stdin.
    Play(PlayArgs),
    /// Write synthetic HotpotQA records (official JSON schema): the fixture, or with
    /// --world-split the questions of a generated world.
    SynthHotpotqa(SynthArgs),
    /// Serve an environment over HTTP/JSON to agents in another process (the protocol's
    /// prompts and parsing, functions in tool mode): `docs/guides/env-server.md`.
    Serve(ServeArgs),
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Environment name (see `stepppo env list`).
    env: String,
    /// Env or protocol setting (e.g. `tools=true`); the value is read as YAML, as `train --set`
    /// reads it (`3`, `true`, `[a, b]`, else a string).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on; 0 picks a free one.
    #[arg(long, default_value_t = 8766)]
    port: u16,
}

#[derive(Args, Debug)]
pub struct PlayArgs {
    /// Environment name (see `stepppo env list`).
    env: String,
    /// random | oracle | searcher (search envs) | stdin.
    #[arg(long, default_value = "random")]
    agent: String,
    /// Seed of the first episode; episode i uses seed + i.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, default_value_t = 1)]
    episodes: u64,
    /// Env or protocol setting; the value is read as YAML, as `train --set` reads it (`3`,
    /// `true`, `[a, b]`, else a string).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// One JSON object per episode instead of a transcript (its `metrics` summed over the turns).
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct SynthArgs {
    #[arg(long, default_value_t = hotpotqa::synthetic::FIXTURE_RECORDS)]
    records: usize,
    /// Fixture seed, or the world seed with --world-split.
    #[arg(long, default_value_t = hotpotqa::synthetic::FIXTURE_SEED)]
    seed: u64,
    #[arg(long, default_value = "data/hotpotqa/synthetic_dev.json")]
    out: String,
    /// Write the questions of this generated world (train | val) instead of the fixture.
    #[arg(long)]
    world_split: Option<String>,
    /// Entities of the generated world.
    #[arg(long, default_value_t = 400)]
    world_size: usize,
    /// Distractor paragraphs per generated record.
    #[arg(long, default_value_t = 6)]
    distractors: usize,
}

pub fn run(cmd: EnvCommand) -> anyhow::Result<()> {
    match cmd {
        EnvCommand::List => {
            for name in env::registry() {
                println!("{name}");
            }
            Ok(())
        }
        EnvCommand::Play(args) => play(args),
        EnvCommand::SynthHotpotqa(args) => synth(args),
        EnvCommand::Serve(args) => serve(args),
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let spec = EnvSpec {
        env: args.env.clone(),
        config: config_from_sets(&args.set)?,
    };
    let addr = format!("{}:{}", args.host, args.port);
    serve_env(spec, &addr, |bound| {
        println!("env server: http://{bound} ({})", args.env);
    })
    .with_context(|| format!("serving env `{}` on {addr}", args.env))
}

fn synth(args: SynthArgs) -> anyhow::Result<()> {
    use hotpotqa::world::{Split, World};
    let records = match args.world_split.as_deref() {
        None => hotpotqa::synthetic::synthetic_records(args.records, args.seed),
        Some(name) => {
            let split = match name {
                "train" => Split::Train,
                "val" => Split::Val,
                other => bail!("--world-split `{other}`: expected train or val"),
            };
            World::generate(args.seed, split, args.world_size)
                .and_then(|world| world.records(args.records, args.distractors))
                .map_err(|reason| anyhow::anyhow!("--world-size {}: {reason}", args.world_size))?
        }
    };
    std::fs::write(&args.out, hotpotqa::data::to_json(&records))
        .with_context(|| format!("writing {}", args.out))?;
    eprintln!("wrote {} records to {}", records.len(), args.out);
    Ok(())
}

fn config_from_sets(sets: &[String]) -> anyhow::Result<Value> {
    let mut config = Value::Object(Map::new());
    for pair in sets {
        stepppo::config::apply_set(&mut config, pair)?;
    }
    Ok(config)
}

fn play(args: PlayArgs) -> anyhow::Result<()> {
    let config = config_from_sets(&args.set)?;
    let mut session = env::build_session(&args.env, &config)?;
    let mut successes = 0u64;
    for episode in 0..args.episodes {
        let seed = args.seed.wrapping_add(episode);
        let played = match args.agent.as_str() {
            "stdin" => env::play_episode(&mut session, seed, &mut |s| Ok(stdin_response(s))),
            name => {
                let kind: AgentKind = name.parse().map_err(anyhow::Error::msg)?;
                let mut agent = Agent::new(kind, stepppo::seed::derive(seed, &[0xA6E7]));
                env::play_episode(&mut session, seed, &mut |s| agent.respond(s))
            }
        }
        .with_context(|| format!("env `{}`, episode seed {seed}", args.env))?;
        successes += u64::from(played.success());
        if args.json {
            println!("{}", episode_json(&played));
        } else {
            print!("{}", played.transcript());
        }
    }
    if !args.json {
        println!(
            "success rate {:.3} over {} episodes",
            successes as f64 / args.episodes.max(1) as f64,
            args.episodes
        );
    }
    Ok(())
}

/// One episode as JSON. `metrics` are the env's per-turn metrics summed over the episode, as a
/// training rollout logs them (right for per-turn amounts: `searches` counts every search);
/// `final_metrics` are each metric's value at the last turn that reported it (right for running
/// totals an env reports, such as a score or a turn counter).
fn episode_json(episode: &Episode) -> Value {
    let mut sums: BTreeMap<&str, f64> = BTreeMap::new();
    let mut last: BTreeMap<&str, f64> = BTreeMap::new();
    for (name, value) in episode.turns.iter().flat_map(|t| &t.outcome.metrics) {
        *sums.entry(name.as_str()).or_default() += f64::from(*value);
        last.insert(name.as_str(), f64::from(*value));
    }
    let as_map = |m: BTreeMap<&str, f64>| -> Map<String, Value> {
        m.into_iter()
            .map(|(name, value)| (name.to_string(), json!(value)))
            .collect()
    };
    let (metrics, final_metrics) = (as_map(sums), as_map(last));
    json!({
        "env": episode.env,
        "seed": episode.seed,
        "success": episode.success(),
        "reward": episode.reward(),
        "steps": episode.steps(),
        "turns": episode.turns.len(),
        "invalid_turns": episode.turns.iter().filter(|t| !t.outcome.info.action_is_valid).count(),
        "metrics": metrics,
        "final_metrics": final_metrics,
    })
}

/// Shows the current prompt on stderr (stdout carries the transcript or JSON) and reads one
/// line: a bare action (wrapped in `<answer>`) or tagged text. Bytes that are not UTF-8 become
/// U+FFFD (with a warning); the rest of the line is kept as typed.
fn stdin_response(session: &AgentSession) -> String {
    eprint!("{}> ", session.window_user_message(0));
    let _ = std::io::stderr().flush();
    let mut bytes = Vec::new();
    if let Err(e) = std::io::stdin().lock().read_until(b'\n', &mut bytes) {
        eprintln!("warning: reading stdin: {e}");
    }
    let text = String::from_utf8_lossy(&bytes);
    if let std::borrow::Cow::Owned(_) = text {
        eprintln!("warning: the line held bytes that are not UTF-8; each became U+FFFD");
    }
    let line = text.trim();
    if line.contains('<') {
        line.to_string()
    } else {
        format!("<answer>{line}</answer>")
    }
}
