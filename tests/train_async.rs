//! Asynchronous rollout (`async_rollout.staleness` k): the batch of step s comes from policy
//! version max(s − k, 0) whatever the timing, the update logs the lag and the decoupled-PPO
//! weights, and a run checkpointed with batches in flight resumes to exactly the run that never
//! stopped (tiny model, few short episodes).

mod common;

use std::path::Path;
use stepppo::config::Config;
use stepppo::store::Dataset;
use stepppo::train::run::metrics::read_jsonl;
use stepppo::train::Trainer;

/// Groups per rollout batch in [`config`].
const GROUPS: u64 = 2;

fn config(staleness: usize) -> Config {
    let staleness = format!("async_rollout.staleness={staleness}");
    common::tiny_config(&["critic.mode=shared", "critic.history_batches=1", &staleness])
}

fn weights(t: &Trainer) -> Vec<(String, Vec<f32>)> {
    t.policy_weights()
        .into_iter()
        .map(|(n, w)| (n, w.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// (group id, policy version) of every stored record, in store order.
fn stored_versions(run: &Path) -> Vec<(u64, u64)> {
    let dataset = Dataset::open(&run.join("dataset")).unwrap();
    dataset
        .records()
        .map(|v| {
            let r = v.to_record().unwrap();
            (r.group_id, r.policy_version)
        })
        .collect()
}

#[test]
fn each_batch_comes_from_the_version_k_steps_back_and_the_lag_is_logged() {
    for k in [1u64, 2] {
        let root = tempfile::tempdir().unwrap();
        let mut t = Trainer::create(config(k as usize), root.path()).unwrap();
        t.run(4, &mut |_| {}).unwrap();
        let stored = stored_versions(root.path());
        assert!(!stored.is_empty());
        for (group, version) in stored {
            let step = group / GROUPS;
            assert_eq!(version, step.saturating_sub(k), "k {k}, group {group}");
        }
        let rows = read_jsonl(&root.path().join("metrics.jsonl")).unwrap();
        let steps: Vec<_> = rows
            .iter()
            .filter(|(_, s)| s.contains_key("time/update"))
            .collect();
        assert_eq!(steps.len(), 4);
        for (step, s) in steps {
            let lag = (step - 1).min(k) as f64;
            assert_eq!(s["rollout/staleness_max"], lag, "k {k} step {step}");
            assert!(s["async/rollout_busy"] > 0.0 && s["async/trainer_busy"] > 0.0);
            assert!(s.contains_key("time/trainer_wait") && s.contains_key("time/rollout_wait"));
            // Decoupled PPO weighs the lagging steps' tokens; fresh batches need no weights.
            assert_eq!(s.contains_key("actor/behaviour_weight_mean"), lag > 0.0);
        }
    }
}

#[test]
fn an_async_run_checkpointed_with_batches_in_flight_resumes_exactly() {
    for k in [1usize, 2] {
        let root = tempfile::tempdir().unwrap();
        let (a, b) = (root.path().join("a"), root.path().join("b"));
        let mut straight = Trainer::create(config(k), &a).unwrap();
        straight.run(4, &mut |_| {}).unwrap();
        let expected = weights(&straight);

        let mut first = Trainer::create(config(k), &b).unwrap();
        first.run(2, &mut |_| {}).unwrap();
        drop(first);
        let pending = b.join("ckpt-2").join("pending_rollouts");
        assert!(pending.join("batches.json").exists(), "k {k}");

        let mut resumed = Trainer::resume(config(k), &b).unwrap();
        resumed.run(4, &mut |_| {}).unwrap();
        assert_eq!(resumed.state(), straight.state(), "k {k}");
        assert_eq!(weights(&resumed), expected, "k {k}");
        assert_eq!(stored_versions(&b), stored_versions(&a), "k {k}");
    }
}

#[test]
fn a_checkpoint_without_its_pending_batches_is_refused_by_name() {
    let root = tempfile::tempdir().unwrap();
    let mut first = Trainer::create(config(1), root.path()).unwrap();
    first.run(2, &mut |_| {}).unwrap();
    drop(first);
    std::fs::remove_dir_all(root.path().join("ckpt-2").join("pending_rollouts")).unwrap();
    let err = Trainer::resume(config(1), root.path())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("pending_rollouts"), "{err}");
}

/// `proximal: behaviour` clips around the stored behaviour log-probs: no extra pass and no
/// weights, and so another update than decoupled PPO's on the same lagging batches.
#[test]
fn the_behaviour_policy_as_the_anchor_skips_the_correction() {
    let root = tempfile::tempdir().unwrap();
    let run = |name: &str, cfg: Config| {
        let dir = root.path().join(name);
        let mut t = Trainer::create(cfg, &dir).unwrap();
        t.run(4, &mut |_| {}).unwrap();
        (weights(&t), read_jsonl(&dir.join("metrics.jsonl")).unwrap())
    };
    let mut behaviour = config(1);
    behaviour.async_rollout.proximal = stepppo::config::ProximalPolicy::Behaviour;
    let (decoupled_weights, _) = run("decoupled", config(1));
    let (behaviour_weights, rows) = run("behaviour", behaviour);
    assert_ne!(decoupled_weights, behaviour_weights);
    for (step, s) in rows.iter().filter(|(_, s)| s.contains_key("time/update")) {
        assert!(
            !s.contains_key("actor/behaviour_weight_mean"),
            "step {step}"
        );
        assert!(!s.contains_key("time/proximal"), "step {step}");
        assert_eq!(s["rollout/staleness_max"], (step - 1).min(1) as f64);
    }
}
