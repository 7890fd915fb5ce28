//! The agent text protocol through the public API: invalid turns, limits, multi-action turns,
//! window prompts, state hashes.

use serde_json::json;
use stepppo::env::{build_session, response_text, Env};

#[test]
fn invalid_turn_costs_the_penalty_without_stepping_and_counts_as_a_turn() {
    let mut session = build_session(
        "frozen_lake",
        &json!({"max_turns": 2, "format_penalty": -0.25}),
    )
    .unwrap();
    let first = session.reset(4).unwrap();
    assert!(first.contains("Turn 1:\nState:\n") && first.contains("You have 2 actions left."));
    let hash = session.state_hash();
    let state = session.state_text().to_string();
    let outcome = session.act("I would go left").unwrap();
    assert_eq!(outcome.reward, -0.25);
    assert!(!outcome.info.action_is_valid && outcome.info.num_actions == 0);
    assert_eq!(outcome.info.format_penalty, -0.25);
    assert_eq!(session.state_text(), state, "state unchanged");
    assert_eq!(session.state_hash(), hash);
    let message = outcome.next_user_message.unwrap();
    assert!(
        message.starts_with("Reward: -0.25 (invalid answer)\nTurn 2:"),
        "{message}"
    );
    let outcome = session.act("<answer>Jump</answer>").unwrap();
    assert!(outcome.truncated && !outcome.terminated && outcome.next_user_message.is_none());
    let after = session.act("<answer>Left</answer>").unwrap();
    assert!(
        after.next_user_message.is_none() && after.reward == 0.0,
        "acting after the end is inert"
    );
}

#[test]
fn several_actions_per_turn_run_until_done() {
    let mut session = build_session(
        "sokoban",
        &json!({"max_actions_per_turn": 10, "max_turns": 1}),
    )
    .unwrap();
    session.reset(9).unwrap();
    let plan = stepppo::env::SokobanEnv::new(Default::default()).map(|mut env| {
        env.reset(9).unwrap();
        env.solve().unwrap()
    });
    let names = ["Up", "Down", "Left", "Right"];
    let mut text: Vec<&str> = plan.unwrap().iter().map(|&d| names[d]).collect();
    text.push("Left");
    let outcome = session
        .act(&format!("<answer>{}</answer>", text.join(" || ")))
        .unwrap();
    assert!(outcome.terminated && outcome.info.success);
    assert_eq!(
        outcome.info.num_actions as usize,
        text.len() - 1,
        "stops at done"
    );
}

#[test]
fn window_message_holds_the_last_k_rounds_and_stop_strings_match_the_env() {
    let mut session = build_session("frozen_lake", &json!({"is_slippery": false})).unwrap();
    let first = session.reset(2).unwrap();
    assert_eq!(session.window_user_message(3), first, "no history yet");
    let action = session.env().oracle_action().unwrap();
    session.act(&response_text(&action, false)).unwrap();
    let window = session.window_user_message(1);
    assert!(window.contains("Recent history:\nTurn 1:") && window.contains("Turn 2:\nState:"));
    assert!(!session.window_user_message(0).contains("Recent history"));
    assert_eq!(session.stop_strings(), vec!["</answer>"]);
    let qa = build_session("hotpotqa", &json!(null)).unwrap();
    assert_eq!(qa.stop_strings(), vec!["</answer>", "</search>"]);
    assert!(qa.system_prompt().contains("<search>"));
}

#[test]
fn state_hash_depends_only_on_the_observation() {
    let mut a = build_session("sokoban", &json!(null)).unwrap();
    let mut b = build_session("sokoban", &json!({"format_penalty": -1.0})).unwrap();
    a.reset(5).unwrap();
    b.reset(5).unwrap();
    assert_eq!(a.state_hash(), b.state_hash());
    a.reset(6).unwrap();
    assert_ne!(a.state_hash(), b.state_hash());
    assert_eq!(
        a.state_hash(),
        stepppo::env::stable_hash(a.state_text().as_bytes())
    );
}

#[test]
fn show_reward_off_leaves_the_reward_out_of_the_next_message_and_the_window() {
    let mut session = build_session(
        "frozen_lake",
        &json!({"is_slippery": false, "show_reward": false, "format_penalty": -0.25}),
    )
    .unwrap();
    session.reset(2).unwrap();
    let invalid = session.act("I would go left").unwrap();
    let message = invalid.next_user_message.unwrap();
    assert!(
        message.starts_with("(invalid answer)\nTurn 2:"),
        "{message}"
    );
    assert_eq!(invalid.reward, -0.25, "the reward is still paid");
    let action = session.env().oracle_action().unwrap();
    let valid = session.act(&response_text(&action, false)).unwrap();
    let message = valid.next_user_message.unwrap();
    assert!(message.starts_with("Turn 3:"), "{message}");
    let window = session.window_user_message(2);
    assert!(window.contains("Recent history:\nTurn 1:") && !window.contains("Reward:"));
}

fn search_session(extra: serde_json::Value) -> stepppo::env::AgentSession {
    let mut config = json!({
        "world": "generated", "world_size": 60, "episode_worlds": true,
        "corpus": "distractor", "tools": true,
    });
    config
        .as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    build_session("hotpotqa", &config).unwrap()
}

/// Tool mode: the env's functions are offered, the oracle's calls search and answer through them,
/// each search's result is the next turn's tool message, and the answer ends the episode.
#[test]
fn tool_mode_offers_the_functions_and_returns_each_calls_result() {
    use stepppo::tokenizer::tool_calls::ParsedReply;
    let mut session = search_session(json!({}));
    let user = session.reset(3).unwrap();
    assert!(
        user.contains("`search` function") && user.contains("Question: "),
        "{user}"
    );
    assert!(!user.contains("<search>"), "{user}");
    assert!(session
        .system_prompt()
        .contains("call one of the functions"));
    let names: Vec<String> = session
        .tool_schemas()
        .iter()
        .map(|t| {
            serde_json::from_str::<serde_json::Value>(t).unwrap()["function"]["name"].to_string()
        })
        .collect();
    assert_eq!(names, ["\"search\"", "\"answer\""]);
    assert!(session.stop_strings().is_empty());
    let mut turns = 0;
    loop {
        let action = session.env().oracle_action().unwrap();
        let call = stepppo::env::tools::action_call(&action);
        let reply = ParsedReply::Calls {
            content: None,
            calls: vec![call],
        };
        let outcome = session.act_reply("(the call)", &reply).unwrap();
        turns += 1;
        assert!(outcome.info.action_is_valid && !outcome.info.tool_call_error);
        if outcome.terminated {
            assert!(outcome.info.success && outcome.reward == 1.0);
            assert!(outcome.tool_results.is_empty() && outcome.next_user_message.is_none());
            break;
        }
        assert_eq!(outcome.tool_results.len(), 1);
        assert!(outcome.tool_results[0].starts_with("<information>Doc 1(Title: "));
        assert!(outcome.next_user_message.is_none());
    }
    assert!(turns >= 2, "the oracle searches before it answers");
}

/// Tool mode: a reply that calls nothing, one whose call did not parse, and one whose call stands
/// for no action are invalid turns that pay the penalty and are told to call a function; the two
/// that tried to call are flagged `tool_call_error`.
#[test]
fn tool_mode_invalid_replies_pay_the_penalty_and_say_what_to_call() {
    use stepppo::tokenizer::tool_calls::{ParsedCall, ParsedReply};
    let mut session = search_session(json!({"format_penalty": -0.2, "max_turns": 4}));
    session.reset(5).unwrap();
    let unknown = ParsedReply::Calls {
        content: None,
        calls: vec![ParsedCall {
            name: "search".into(),
            arguments: r#"{"q": "x"}"#.into(),
        }],
    };
    let malformed = ParsedReply::Malformed {
        reason: "unclosed".into(),
    };
    for (reply, tried) in [
        (ParsedReply::Content, false),
        (malformed, true),
        (unknown, true),
    ] {
        let outcome = session.act_reply("text", &reply).unwrap();
        assert_eq!(outcome.reward, -0.2);
        assert!(!outcome.info.action_is_valid && outcome.info.num_actions == 0);
        assert_eq!(outcome.info.tool_call_error, tried, "{reply:?}");
        assert!(outcome.tool_results.is_empty());
        let message = outcome.next_user_message.unwrap();
        assert!(message.contains("search, answer"), "{message}");
    }
}
