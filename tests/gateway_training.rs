//! Training from the gateway end to end: `stepppo train` with a `gateway` section serves the
//! OpenAI-compatible API, a client outside the trainer plays FrozenLake episodes through it over
//! HTTP (grouped by task id, closed with per-step rewards), and the trainer updates every full
//! batch of groups, serving the next version's weights from the next request on; sessions that
//! name the config's env are sampled under its answer grammar (constrained decoding).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use stepppo::env::build_session;
use stepppo::store::{self, Dataset};
use stepppo::train::run::metrics::read_jsonl;

const SETS: &[&str] = &[
    "builtin_size=tiny",
    "max_steps=2",
    "eval_steps=0",
    "save_steps=0",
    "sft.steps=0",
    "self_imitation.coef=0",
    "adv_estimator=step_reinforce",
    "critic.mode=none",
    "ppo_mini_batch_size=4",
    "train_env_manager.group_size=2",
    "train_env_manager.num_groups_partition=[2]",
    "cache.kv_slots=4096",
    "gateway.listen=127.0.0.1:0",
    "gateway.served_model_name=policy",
];

/// Plays FrozenLake episodes through the gateway at `url` until it stops answering; returns
/// the policy versions the replies came from.
fn play_until_the_gateway_stops(url: &str) -> Vec<u64> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into();
    let mut versions = Vec::new();
    for episode in 0u64.. {
        let task = episode / 2;
        let session_id = format!("ep-{episode}");
        let mut session = build_session("frozen_lake", &json!({"max_turns": 2})).unwrap();
        let mut messages = vec![
            json!({"role": "system", "content": session.system_prompt()}),
            json!({"role": "user", "content": session.reset(task).unwrap()}),
        ];
        let mut rewards = Vec::new();
        let mut success = false;
        loop {
            // The session plays the config's env: it is sampled under that env's answer grammar.
            let body = json!({"model": "policy", "messages": messages, "max_tokens": 6,
                              "metadata": {"env": "SimpleFrozenLake"}});
            let sent = agent
                .post(&format!("{url}/v1/chat/completions"))
                .header("x-session-id", &session_id)
                .header("x-task-id", &format!("map-{task}"))
                .send_json(&body);
            let Ok(mut resp) = sent else {
                return versions; // the trainer finished and closed the gateway
            };
            if resp.status() != 200 {
                return versions;
            }
            let version: u64 = resp.headers()["x-policy-version"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            versions.push(version);
            let reply: Value = resp.body_mut().read_json().unwrap();
            let text = reply["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string();
            let outcome = session.act(&text).unwrap();
            assert!(
                outcome.info.action_is_valid,
                "constrained decoding gave {text:?}"
            );
            rewards.push(outcome.reward);
            success |= outcome.info.success;
            let Some(next) = outcome.next_user_message else {
                break;
            };
            messages.push(json!({"role": "assistant", "content": text}));
            messages.push(json!({"role": "user", "content": next}));
        }
        let close = json!({"rewards": rewards, "success": success});
        let sent = agent
            .post(&format!("{url}/v1/sessions/{session_id}/close"))
            .send_json(&close);
        match sent {
            Ok(r) if r.status() == 200 => {}
            _ => return versions,
        }
    }
    unreachable!()
}

/// Runs `stepppo train ARGS` (which serves the gateway) while an agent plays through it; returns
/// the policy versions of the replies.
fn train_while_playing(args: &[&str]) -> Vec<u64> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let mut seen = String::new();
    let url = loop {
        line.clear();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "train exited before serving: {seen}"
        );
        seen.push_str(&line);
        if let Some(rest) = line.strip_prefix("gateway: http://") {
            break format!("http://{}", rest.split("/v1").next().unwrap());
        }
    };
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    let started = Instant::now();
    let versions = play_until_the_gateway_stops(&url);
    assert!(child.wait().unwrap().success(), "train failed");
    assert!(started.elapsed() < Duration::from_secs(300));
    versions
}

#[test]
fn an_outside_agent_trains_the_policy_through_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut args = vec!["train", "--out", run.to_str().unwrap()];
    for s in SETS {
        args.extend(["--set", s]);
    }
    let versions = train_while_playing(&args);
    assert_eq!(versions.first(), Some(&0));
    assert!(
        versions.contains(&1),
        "the second batch is served by the updated policy: {versions:?}"
    );

    let rows = read_jsonl(&run.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = rows
        .iter()
        .filter(|(_, m)| m.contains_key("actor/pg_loss"))
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(steps, vec![1, 2]);
    assert!(rows
        .iter()
        .any(|(_, m)| m.contains_key("gateway/staleness_mean")));
    assert!(run.join("ckpt-latest").exists());

    let data = run.join("dataset");
    let trajectory_ids = |data: &std::path::Path| {
        let dataset = Dataset::open(data).unwrap();
        let trajs = dataset.trajectories();
        for t in &trajs {
            assert_eq!(
                t.traj_id / 2,
                t.group_id,
                "trajectory ids follow the agent loop's"
            );
        }
        trajs.iter().map(|t| t.traj_id).collect::<Vec<u64>>()
    };
    assert_eq!(
        trajectory_ids(&data),
        (0..8).collect::<Vec<_>>(),
        "two updates of two groups of two sessions"
    );
    assert!(store::verify(&data).unwrap().problems.is_empty());

    // A resumed run serves the checkpoint's version and numbers its groups after the stored ones.
    let resumed = train_while_playing(&[
        "train",
        "--out",
        run.to_str().unwrap(),
        "--resume",
        "--set",
        "max_steps=3",
    ]);
    assert_eq!(resumed.first(), Some(&2));
    assert_eq!(trajectory_ids(&data), (0..12).collect::<Vec<_>>());
}
