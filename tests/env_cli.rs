//! `stepppo env list | play` end to end.

use std::io::Write;
use std::process::{Command, Stdio};

fn stepppo(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json_lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn list_names_every_env() {
    let (ok, out, _) = stepppo(&["env", "list"]);
    assert!(ok);
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        ["frozen_lake", "sokoban", "bandit", "hotpotqa", "remote"]
    );
}

#[test]
fn play_json_reports_one_object_per_episode() {
    let args = [
        "env",
        "play",
        "frozen_lake",
        "--agent",
        "oracle",
        "--episodes",
        "200",
    ];
    let (ok, out, err) = stepppo(&[&args[..], &["--set", "is_slippery=false", "--json"]].concat());
    assert!(ok, "{err}");
    let episodes = json_lines(&out);
    assert_eq!(episodes.len(), 200);
    for (i, e) in episodes.iter().enumerate() {
        assert_eq!(e["env"], "frozen_lake");
        assert_eq!(e["seed"], i as u64);
        assert_eq!(e["success"], true);
        assert!(e["steps"].as_u64().unwrap() >= 1 && e["reward"] == 1.0);
    }
    let (ok, out, _) = stepppo(&[
        "env",
        "play",
        "sokoban",
        "--agent",
        "oracle",
        "--episodes",
        "100",
        "--json",
    ]);
    assert!(ok);
    assert!(json_lines(&out).iter().all(|e| e["success"] == true));
}

#[test]
fn sokoban_oracle_plays_with_the_grid_local_render() {
    let play = ["env", "play", "sokoban", "--set", "render=grid_local"];
    let oracle = ["--agent", "oracle", "--episodes", "20", "--json"];
    let (ok, out, err) = stepppo(&[&play[..], &oracle[..]].concat());
    assert!(ok, "{err}");
    assert!(json_lines(&out).iter().all(|e| e["success"] == true));
    let (ok, out, err) = stepppo(&play);
    assert!(ok, "{err}");
    assert!(out.contains("\nUp: "), "{out}");
    assert!(out.contains("\nBox to target:\n"), "{out}");
    let (ok, _, err) = stepppo(&["env", "play", "sokoban", "--set", "render=pixels"]);
    assert!(
        !ok && err.contains("render") && err.contains("pixels"),
        "{err}"
    );
}

#[test]
fn play_transcript_and_bad_settings() {
    let (ok, out, _) = stepppo(&["env", "play", "bandit", "--agent", "random", "--seed", "3"]);
    assert!(ok);
    assert!(out.contains("[assistant]\n<answer>") && out.contains("success rate"));
    let (ok, _, err) = stepppo(&["env", "play", "sokoban", "--set", "boxes=2"]);
    assert!(
        !ok && err.contains("boxes") && err.contains("sokoban"),
        "{err}"
    );
    let (ok, _, err) = stepppo(&["env", "play", "bandit", "--agent", "genius"]);
    assert!(!ok && err.contains("genius"), "{err}");
}

#[test]
fn stdin_agent_accepts_bare_and_tagged_actions() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(["env", "play", "hotpotqa", "--agent", "stdin", "--json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"<search>founder</search>\nsome answer\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap();
    let episode: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(episode["turns"], 2);
    assert_eq!(episode["invalid_turns"], 0);
}

#[test]
fn stdin_agent_keeps_a_valid_answer_on_a_line_with_invalid_utf8() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(["env", "play", "bandit", "--agent", "stdin", "--json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = b"<answer>".to_vec();
    line.extend_from_slice(&first_bandit_arm());
    line.extend_from_slice(b"</answer> \xff\xfe\n");
    child.stdin.take().unwrap().write_all(&line).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let episode: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(episode["invalid_turns"], 0, "{stdout}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not UTF-8"));
}

/// The name of the bandit's first arm, read from the env's own action space.
fn first_bandit_arm() -> Vec<u8> {
    let (env, _) = stepppo::env::build_env("bandit", &serde_json::Value::Null).unwrap();
    match env.action_space() {
        stepppo::env::ActionSpace::Named(names) => names[0].clone().into_bytes(),
        other => panic!("bandit actions: {other:?}"),
    }
}

#[test]
fn a_written_generated_world_plays_as_a_data_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("val_world.json");
    let out = out.to_str().unwrap();
    let synth = [
        "env",
        "synth-hotpotqa",
        "--world-split",
        "val",
        "--seed",
        "5",
    ];
    let (ok, _, err) = stepppo(&[&synth[..], &["--records", "60", "--out", out]].concat());
    assert!(ok && err.contains("wrote 60 records"), "{err}");
    let data_file = format!("data_file={out}");
    let play = [
        "env",
        "play",
        "hotpotqa",
        "--set",
        &data_file,
        "--set",
        "split=all",
    ];
    let oracle = ["--agent", "oracle", "--episodes", "60", "--json"];
    let (ok, stdout, err) = stepppo(&[&play[..], &oracle[..]].concat());
    assert!(ok, "{err}");
    let episodes = json_lines(&stdout);
    assert!(episodes
        .iter()
        .all(|e| e["success"] == true && e["turns"] == 3));
    // Metrics are summed over the episode: two searches, then one right answer.
    assert!(
        episodes
            .iter()
            .all(|e| e["metrics"]["searches"] == 2.0 && e["metrics"]["em"] == 1.0),
        "{stdout}"
    );
    // The last turn's values beside them: the answer turn's EM.
    assert!(
        episodes.iter().all(|e| e["final_metrics"]["em"] == 1.0),
        "{stdout}"
    );
    let bad = [
        "env",
        "synth-hotpotqa",
        "--world-split",
        "test",
        "--out",
        out,
    ];
    let (ok, _, err) = stepppo(&bad);
    assert!(
        !ok && err.contains("--world-split") && err.contains("test"),
        "{err}"
    );
}
