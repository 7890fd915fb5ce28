//! Model-free agents through the public API: oracle success, random baselines, solver optimality.

use std::collections::HashMap;

use serde_json::json;
use stepppo::env::sokoban::room::Room;
use stepppo::env::{
    build_session, play_episode, Agent, AgentKind, AgentSession, Env, ProtocolConfig,
    SokobanConfig, SokobanEnv,
};

fn success_rate(session: &mut AgentSession, kind: AgentKind, episodes: u64) -> f64 {
    let wins = (0..episodes)
        .filter(|&seed| {
            let mut agent = Agent::new(kind, seed ^ 0x5eed);
            play_episode(session, seed, &mut |s| agent.respond(s))
                .unwrap()
                .success()
        })
        .count();
    wins as f64 / episodes as f64
}

#[test]
fn frozen_lake_oracle_always_wins_without_slipping_and_random_does_not() {
    let mut session = build_session("frozen_lake", &json!({"is_slippery": false})).unwrap();
    assert_eq!(success_rate(&mut session, AgentKind::Oracle, 200), 1.0);
    let random = success_rate(&mut session, AgentKind::Random, 200);
    assert!(random < 0.5, "{random}");
}

/// Whether some move sequence of at most `depth` solves the room (memoised depth-first search,
/// independent of the BFS solver).
fn solvable_within(room: Room, depth: usize, memo: &mut HashMap<(u128, usize), usize>) -> bool {
    if room.solved() {
        return true;
    }
    if depth == 0
        || memo
            .get(&(room.boxes, room.player))
            .is_some_and(|&d| d >= depth)
    {
        return false;
    }
    memo.insert((room.boxes, room.player), depth);
    (0..4).any(|dir| {
        let mut next = room;
        next.push(dir).moved && solvable_within(next, depth - 1, memo)
    })
}

#[test]
fn sokoban_oracle_solves_every_room_in_the_optimal_number_of_steps() {
    for seed in 0..100 {
        let mut env = SokobanEnv::new(SokobanConfig::default()).unwrap();
        env.reset(seed).unwrap();
        let optimum = env.solve().unwrap().len();
        let room = *env.room();
        if seed < 30 {
            assert!(solvable_within(room, optimum, &mut HashMap::new()));
            assert!(
                !solvable_within(room, optimum - 1, &mut HashMap::new()),
                "seed {seed}"
            );
        }
        let mut session = AgentSession::new(Box::new(env), ProtocolConfig::default_for("sokoban"));
        let mut agent = Agent::new(AgentKind::Oracle, seed);
        let episode = play_episode(&mut session, seed, &mut |s| agent.respond(s)).unwrap();
        assert!(episode.success(), "seed {seed}");
        assert_eq!(episode.steps(), optimum, "seed {seed}");
        assert!(episode.reward() > 10.0 - 0.1 * optimum as f32);
    }
}

#[test]
fn sokoban_random_agent_rarely_solves() {
    let mut session = build_session("sokoban", &json!(null)).unwrap();
    let random = success_rate(&mut session, AgentKind::Random, 100);
    assert!(random < 0.1, "{random}");
}

#[test]
fn bandit_oracle_picks_the_better_arm_and_random_is_a_coin_flip() {
    let mut session = build_session("bandit", &json!(null)).unwrap();
    assert_eq!(success_rate(&mut session, AgentKind::Oracle, 200), 1.0);
    let random = success_rate(&mut session, AgentKind::Random, 600);
    assert!((random - 0.5).abs() < 0.07, "{random}");
}

/// The text between `<search>` and `</search>` of a response.
fn searched(response: &str) -> Option<&str> {
    let rest = response.split_once("<search>")?.1;
    Some(rest.split_once("</search>")?.0.trim())
}

/// Plays the oracle for `episodes` seeds: each episode searches the two supporting titles (each
/// found at rank 1), then answers with exact match 1.
fn assert_oracle_does_both_hops(config: serde_json::Value, episodes: u64) {
    let mut session = build_session("hotpotqa", &config).unwrap();
    for seed in 0..episodes {
        let mut agent = Agent::new(AgentKind::Oracle, seed);
        let episode = play_episode(&mut session, seed, &mut |s| agent.respond(s)).unwrap();
        assert_eq!(episode.reward(), 1.0, "{config} seed {seed}");
        assert_eq!(episode.turns.len(), 3, "search, search, answer");
        for hop in 0..2 {
            let title = searched(&episode.turns[hop].response).expect("a search");
            let found = &episode.turns[hop + 1].user_message;
            assert!(
                found.contains(&format!("<information>Doc 1(Title: {title}) ")),
                "{config} seed {seed}: {title} not first in {found}"
            );
        }
        let last = &episode.turns[2].outcome;
        assert_eq!(
            last.metrics[..2],
            [("em".to_string(), 1.0), ("f1".to_string(), 1.0)]
        );
    }
}

#[test]
fn hotpotqa_oracle_does_both_hops_on_both_splits_and_corpora() {
    for split in ["train", "val"] {
        for corpus in ["distractor", "world"] {
            let config = json!({"split": split, "corpus": corpus, "world_seed": 3});
            assert_oracle_does_both_hops(config.clone(), 300);
            let per_episode = json!({"split": split, "corpus": corpus, "episode_worlds": true,
                                     "world_size": 60});
            assert_oracle_does_both_hops(per_episode, 100);
            let mut session = build_session("hotpotqa", &config).unwrap();
            let random = success_rate(&mut session, AgentKind::Random, 300);
            assert!(random < 0.1, "{config}: random {random}");
        }
    }
}

#[test]
fn hotpotqa_oracle_has_exact_match_one_on_the_fixture() {
    for corpus in ["distractor", "world"] {
        let config = json!({"world": "fixture", "split": "all", "corpus": corpus});
        assert_oracle_does_both_hops(config.clone(), 200);
        let mut session = build_session("hotpotqa", &config).unwrap();
        let random = success_rate(&mut session, AgentKind::Random, 200);
        assert!(random < 0.3, "{random}");
    }
}

#[test]
fn thinking_agents_pass_the_think_format() {
    for name in ["frozen_lake", "sokoban", "bandit", "hotpotqa"] {
        let mut session = build_session(name, &json!({"enable_think": true})).unwrap();
        let mut agent = Agent::new(AgentKind::Oracle, 1);
        let episode = play_episode(&mut session, 3, &mut |s| agent.respond(s)).unwrap();
        assert!(
            episode.turns.iter().all(|t| t.outcome.info.action_is_valid),
            "{name}"
        );
        assert!(episode.turns[0].response.starts_with("<think>"));
        assert!(session.env().tag() == name);
    }
}

/// `ids` holds `part` as a contiguous run.
fn contains_run(ids: &[u32], part: &[u32]) -> bool {
    ids.windows(part.len()).any(|w| w == part)
}

#[test]
fn the_oracle_copies_each_name_as_the_tokens_it_was_read_as() {
    // A search query or answer that copies a name must be the same tokens as the name where the
    // model reads it (question, passages), or a model cannot learn to copy a name it never wrote.
    for split in ["train", "val"] {
        let config = json!({"split": split, "episode_worlds": true, "world_size": 60});
        let tok = stepppo::tokenizer::Tokenizer::builtin_with_words(
            &stepppo::env::builtin_words("hotpotqa", &config).unwrap(),
        );
        let mut session = build_session("hotpotqa", &config).unwrap();
        for seed in 0..50 {
            let mut agent = Agent::new(AgentKind::Oracle, seed);
            let episode = play_episode(&mut session, seed, &mut |s| agent.respond(s)).unwrap();
            let mut read = Vec::new();
            for turn in &episode.turns {
                read.extend(tok.encode(&turn.user_message));
                let response = &turn.response;
                let open = response.find('>').expect("a tag") + 1;
                let close = response.rfind("</").expect("a closing tag");
                if ["yes", "no"].contains(&response[open..close].trim()) {
                    continue;
                }
                let copied = tok.encode(&response[open..close]);
                assert!(
                    contains_run(&read, &copied),
                    "{split} seed {seed}: {:?} is not read as {copied:?}",
                    &response[open..close]
                );
            }
        }
    }
}

#[test]
fn in_tool_mode_the_builtin_tokenizer_holds_the_tool_markup_whole() {
    // Real tokenizers hold their tool markup in few tokens; spelled byte by byte, a call would
    // cost the built-in model fifty tokens of which two carry the query.
    use stepppo::tokenizer::tool_calls::{builtin_call_text, builtin_tools_system};
    use stepppo::tokenizer::{Tokenizer, ToolCall};
    let tokenizer_for = |config: &serde_json::Value| {
        Tokenizer::builtin_with_words(&stepppo::env::builtin_words("hotpotqa", config).unwrap())
    };
    let plain = json!({"episode_worlds": true, "world_size": 60});
    let tools = json!({"episode_worlds": true, "world_size": 60, "tools": true});
    let (text_mode, tool_mode) = (tokenizer_for(&plain), tokenizer_for(&tools));
    let schemas = build_session("hotpotqa", &tools).unwrap().tool_schemas();
    let system = builtin_tools_system(None, &schemas);
    let call = builtin_call_text(
        None,
        &[ToolCall::new(
            "c",
            "search",
            r#"{"query":" The Galnax Voyage"}"#,
        )],
    );
    for (text, most) in [(&system, 200), (&call, 30)] {
        let ids = tool_mode.encode(text);
        assert!(ids.len() <= most, "{} tokens: {text}", ids.len());
        let spelled = text_mode.encode(text).len();
        assert!(
            ids.len() * 5 < spelled * 3,
            "{} vs {spelled}: {text}",
            ids.len()
        );
        assert_eq!(tool_mode.decode(&ids), *text);
    }
    // The names a query copies are the same tokens as where they are read.
    let name = tool_mode.encode(" The Galnax Voyage");
    assert!(contains_run(&tool_mode.encode(&call), &name));
    // An env of named actions gets its names whole too.
    let lake = json!({"tools": true});
    let words = stepppo::env::builtin_words("frozen_lake", &lake).unwrap();
    assert!(["act", "action", "enum"]
        .iter()
        .all(|w| words.iter().any(|x| x == w)));
}
