//! Env throughput: agent turns per second through the full text protocol (parse + step +
//! render, including the resets of the episodes played; Sokoban resets generate a room) for
//! each env, Sokoban room generation time per room (reverse play + BFS acceptance check), and
//! for the QA task the time to generate a world with its questions and to index a whole world
//! (`corpus: world`).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use serde_json::Value;
use stepppo::env::hotpotqa::corpus::Corpus;
use stepppo::env::hotpotqa::world::{Split, World};
use stepppo::env::{build_session, in_process, play_episode, Agent, AgentKind, AgentSession, Env};
use stepppo::env::{SokobanConfig, SokobanEnv};

/// Plays random episodes on `session` until `turns` agent turns have run.
fn run_turns(session: &mut AgentSession, agent: &mut Agent, seed: &mut u64, turns: u64) {
    let mut done = 0;
    while done < turns {
        done += play_episode(session, *seed, &mut |s| agent.respond(s))
            .expect("in-process envs do not fail")
            .turns
            .len() as u64;
        *seed += 1;
    }
}

fn steps_per_second(c: &mut Criterion) {
    let mut group = c.benchmark_group("env_turns");
    for env in in_process() {
        let mut session = build_session(env, &Value::Null).unwrap();
        let mut agent = Agent::new(AgentKind::Random, 1);
        let mut seed = 0;
        group.throughput(Throughput::Elements(1000));
        group.bench_function(*env, |b| {
            b.iter(|| run_turns(&mut session, &mut agent, &mut seed, 1000))
        });
    }
    group.finish();
}

fn sokoban_generation(c: &mut Criterion) {
    let mut group = c.benchmark_group("sokoban_generate");
    for (name, cfg) in [
        ("6x6_1box_depth30", SokobanConfig::default()),
        (
            "6x6_1box_depth300",
            SokobanConfig {
                search_depth: 300,
                ..SokobanConfig::default()
            },
        ),
    ] {
        let mut env = SokobanEnv::new(cfg).unwrap();
        let mut seed = 0u64;
        group.throughput(Throughput::Elements(1));
        group.bench_function(name, |b| {
            b.iter(|| {
                seed += 1;
                env.reset(seed).unwrap()
            })
        });
    }
    group.finish();
}

/// A world of `size` entities with 2,400 questions (the defaults' count), and the BM25 index
/// over all its paragraphs.
fn hotpotqa_world(c: &mut Criterion) {
    let mut group = c.benchmark_group("hotpotqa_world");
    group.sample_size(20);
    for size in [400, 5000] {
        group.bench_function(format!("generate_{size}_entities_2400_questions"), |b| {
            b.iter(|| {
                let world = World::generate(1, Split::Train, size).unwrap();
                world.records(2400, 6).unwrap()
            })
        });
        let world = World::generate(1, Split::Train, size).unwrap();
        group.bench_function(format!("index_{size}_paragraphs"), |b| {
            b.iter(|| Corpus::new(world.paragraphs()))
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    steps_per_second,
    sokoban_generation,
    hotpotqa_world
);
criterion_main!(benches);
