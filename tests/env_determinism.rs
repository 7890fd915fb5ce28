//! Determinism: same config + seed ⇒ byte-identical transcripts on any thread; different seeds
//! ⇒ different episodes.

use serde_json::json;
use stepppo::env::{build_session, in_process, play_episode, Agent, AgentKind};

fn transcript(env: &str, seed: u64) -> String {
    let mut session = build_session(env, &json!({"max_actions_per_turn": 2})).unwrap();
    let mut agent = Agent::new(AgentKind::Random, seed);
    (0..3)
        .map(|i| {
            play_episode(&mut session, seed + i, &mut |s| agent.respond(s))
                .unwrap()
                .transcript()
        })
        .collect()
}

#[test]
fn same_seed_gives_identical_transcripts_across_threads() {
    for env in in_process() {
        let here = transcript(env, 11);
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let env = env.to_string();
                std::thread::spawn(move || transcript(&env, 11))
            })
            .collect();
        for handle in handles {
            assert_eq!(handle.join().unwrap(), here, "{env}");
        }
    }
}

#[test]
fn different_seeds_give_different_maps() {
    for env in ["frozen_lake", "sokoban", "hotpotqa"] {
        let mut session = build_session(env, &json!(null)).unwrap();
        let firsts: std::collections::BTreeSet<String> =
            (0..20).map(|seed| session.reset(seed).unwrap()).collect();
        assert!(firsts.len() >= 10, "{env}: {} distinct", firsts.len());
    }
}
