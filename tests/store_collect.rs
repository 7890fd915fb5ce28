//! `stepppo collect`: model-free episodes stored as token-space steps, grouped by seed.

use std::process::Command;

use stepppo::store::{Dataset, StepRecord};
use stepppo::tokenizer::Tokenizer;

fn collect(out: &std::path::Path, agent: &str, sets: &[&str]) {
    let status = Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args([
            "collect",
            "--env",
            "frozen_lake",
            "--agent",
            agent,
            "--episodes",
            "6",
            "--group-size",
            "3",
        ])
        .args(["--seed", "5", "--out", out.to_str().unwrap()])
        .args(sets.iter().flat_map(|s| ["--set", s]))
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn collected_steps_form_groups_and_token_space_trajectories() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ds");
    collect(&out, "random", &["max_turns=4"]);
    let dataset = Dataset::open(&out).unwrap();
    assert!(dataset.problems().is_empty(), "{:?}", dataset.problems());
    assert!(dataset.manifest().metadata.contains_key("collect"));
    let groups = dataset.groups();
    assert_eq!(groups.len(), 2);
    let tok = Tokenizer::builtin();
    for group in &groups {
        assert_eq!(group.trajectories.len(), 3);
        let firsts: Vec<StepRecord> = group
            .trajectories
            .iter()
            .map(|t| t.steps[0].to_record().unwrap())
            .collect();
        assert!(firsts
            .iter()
            .all(|r| r.seed == firsts[0].seed && r.obs_ids == firsts[0].obs_ids));
        for traj in &group.trajectories {
            assert_eq!(traj.traj_id / 3, group.group_id);
            let steps: Vec<StepRecord> =
                traj.steps.iter().map(|s| s.to_record().unwrap()).collect();
            assert!(steps.last().unwrap().is_last());
            let mut context = 0;
            for (t, step) in steps.iter().enumerate() {
                assert_eq!(step.step_index as usize, t);
                assert_eq!(step.context_len, context);
                context += (step.obs_ids.len() + step.response_ids.len()) as u32;
                assert_eq!(step.response_ids.last(), Some(&tok.eos_id()));
                assert_eq!(step.response_logprobs, vec![0.0; step.response_ids.len()]);
                let body = &step.response_ids[..step.response_ids.len() - 1];
                assert_eq!(tok.decode(body), step.info.action_text);
            }
        }
    }
    // Same seed, same config: the same bytes.
    let again = dir.path().join("again");
    collect(&again, "random", &["max_turns=4"]);
    let seg = |d: &std::path::Path| std::fs::read(d.join("seg-000000.stp")).unwrap();
    assert_eq!(seg(&out), seg(&again));
}

#[test]
fn oracle_collection_reports_success_in_stats() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ds");
    collect(&out, "oracle", &["is_slippery=false", "max_turns=10"]);
    let stats = Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(["replay", out.to_str().unwrap(), "--stats", "--json"])
        .output()
        .unwrap();
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(stats["trajectories"], 6);
    assert_eq!(stats["success_rate"], 1.0, "{stats}");
}
