//! `stepppo replay --advantages`: a collected frozen_lake dataset re-scored through the binary.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

fn stepppo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(args)
        .output()
        .unwrap()
}

fn collect(out: &Path) {
    let path = out.to_str().unwrap();
    let args = [
        "collect",
        "--env",
        "frozen_lake",
        "--agent",
        "random",
        "--episodes",
        "16",
    ];
    let done = stepppo(
        &[
            &args[..],
            &["--group-size", "4", "--seed", "3", "--out", path],
        ]
        .concat(),
    );
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
}

/// Runs `replay --advantages` and parses its JSONL rows.
fn replay(dataset: &Path, extra: &[&str]) -> (Vec<Value>, String) {
    let path = dataset.to_str().unwrap();
    let out = stepppo(
        &[
            &["replay", path, "--format", "jsonl", "--advantages"],
            extra,
        ]
        .concat(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let rows = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (rows, stderr)
}

const FIELDS: [&str; 8] = [
    "traj_id",
    "group_id",
    "step_index",
    "reward",
    "value",
    "advantage_raw",
    "advantage",
    "return",
];

fn f(row: &Value, key: &str) -> f64 {
    row[key].as_f64().unwrap()
}

#[test]
fn grpo_rows_are_trajectory_scores_minus_their_group_mean() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("ds");
    collect(&ds);
    let (rows, stderr) = replay(&ds, &["grpo", "--set", "reward_normalization.method=mean"]);
    assert!(!stderr.contains("values are"), "{stderr}");
    assert!(rows.len() >= 16);
    for row in &rows {
        let keys: Vec<&str> = row
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        assert_eq!(keys.len(), FIELDS.len(), "{row}");
        assert!(FIELDS.iter().all(|k| keys.contains(k)), "{row}");
    }
    // group_id -> traj_id -> (score, advantage of every step)
    let mut groups: BTreeMap<u64, BTreeMap<u64, (f64, Vec<f64>)>> = BTreeMap::new();
    for row in &rows {
        let traj = groups
            .entry(row["group_id"].as_u64().unwrap())
            .or_default()
            .entry(row["traj_id"].as_u64().unwrap())
            .or_default();
        traj.0 += f(row, "reward");
        traj.1.push(f(row, "advantage"));
    }
    assert_eq!(groups.len(), 4);
    for trajs in groups.values() {
        assert_eq!(trajs.len(), 4);
        let mean = trajs.values().map(|t| t.0).sum::<f64>() / 4.0;
        let sum: f64 = trajs.values().map(|t| t.1[0]).sum();
        assert!(sum.abs() < 1e-4, "group advantages sum to {sum}");
        for (score, advantages) in trajs.values() {
            assert!(advantages.iter().all(|a| (a - (score - mean)).abs() < 1e-4));
        }
    }
}

#[test]
fn step_gae_uses_zero_values_without_a_critic_and_critic_values_with_one() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("ds");
    collect(&ds);
    let (rows, stderr) = replay(&ds, &["step_gae", "--gamma", "0.9", "--lam", "1"]);
    assert!(stderr.contains("every value is 0"), "{stderr}");
    assert!(rows.iter().all(|r| f(r, "value") == 0.0));
    // γ = 0.9, λ = 1, V = 0: the raw advantage is the discounted reward-to-go.
    let mut by_traj: BTreeMap<u64, Vec<&Value>> = BTreeMap::new();
    rows.iter().for_each(|r| {
        by_traj
            .entry(r["traj_id"].as_u64().unwrap())
            .or_default()
            .push(r)
    });
    for steps in by_traj.values() {
        let mut to_go = 0.0;
        for step in steps.iter().rev() {
            to_go = f(step, "reward") + 0.9 * to_go;
            assert!((f(step, "advantage_raw") - to_go).abs() < 1e-4, "{step}");
            assert!((f(step, "return") - to_go).abs() < 1e-4, "{step}");
        }
    }

    let critic = dir.path().join("critic");
    let init = stepppo(&[
        "init-model",
        "--config",
        "tiny",
        "--out",
        critic.to_str().unwrap(),
    ]);
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );
    let (valued, stderr) = replay(&ds, &["step_gae", "--critic", critic.to_str().unwrap()]);
    assert!(!stderr.contains("every value is 0"), "{stderr}");
    assert_eq!(valued.len(), rows.len());
    assert!(valued.iter().any(|r| f(r, "value") != 0.0));
    for row in &valued {
        let sum = f(row, "advantage_raw") + f(row, "value");
        assert!((f(row, "return") - sum).abs() < 1e-4, "{row}");
    }
}

#[test]
fn bad_overrides_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("ds");
    collect(&ds);
    let path = ds.to_str().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (&["grpo", "--set", "gamm=0.5"], "gamm"),
        (
            &["grpo", "--set", "reward_normalization.methd=mean"],
            "methd",
        ),
        (&["grpo", "--set", "gamma=fast"], "gamma"),
        (&["no_such_estimator"], "adv_estimator"),
    ];
    for (extra, key) in cases {
        let out = stepppo(&[&["replay", path, "--advantages"], extra].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(key),
            "{extra:?}: {stderr}"
        );
    }
}
