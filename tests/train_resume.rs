//! Resume exactness and checkpoint atomicity through the public trainer API (tiny model, few
//! short episodes): 4 steps in one go and 2 steps + resume + 2 steps end with identical weights,
//! and a crashed `.tmp` checkpoint directory is ignored on resume.

mod common;

use stepppo::config::Config;
use stepppo::store::{Dataset, StepRecord};
use stepppo::train::run::checkpoint;
use stepppo::train::run::metrics::read_jsonl;
use stepppo::train::Trainer;

/// StepPO with the shared-trunk critic: the most state a checkpoint has to carry.
const SHARED_CRITIC: &[&str] = &["critic.mode=shared", "critic.history_batches=1"];

fn tiny_config() -> Config {
    tiny_config_with(SHARED_CRITIC)
}

fn tiny_config_with(critic: &[&str]) -> Config {
    common::tiny_config(critic)
}

fn weights(t: &Trainer) -> Vec<(String, Vec<f32>)> {
    t.policy_weights()
        .into_iter()
        .map(|(n, w)| (n, w.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

#[test]
fn two_plus_two_steps_equal_four_and_tmp_dirs_are_ignored() {
    two_plus_two_equal_four(SHARED_CRITIC);
}

/// The feature critic's MLP, its optimizer and its feature scaling resume exactly: the policy
/// after 2 + 2 steps (whose advantages read the critic) equals the one after 4.
#[test]
fn a_feature_critic_resumes_exactly() {
    two_plus_two_equal_four(&[
        "critic.mode=features",
        "critic.ppo_epochs=3",
        "critic.history_batches=1",
    ]);
}

/// The state critic (an MLP on the records' critic states) and its optimizer resume exactly.
#[test]
fn a_state_critic_resumes_exactly() {
    two_plus_two_equal_four(&["critic.mode=state", "critic.ppo_epochs=3"]);
}

/// A state critic fitted on the rows of its last batches resumes with the same rows.
#[test]
fn a_state_critic_history_resumes_exactly() {
    two_plus_two_equal_four(&[
        "critic.mode=state",
        "critic.ppo_epochs=3",
        "critic.history_batches=3",
    ]);
}

fn two_plus_two_equal_four(critic: &[&str]) {
    let tiny_config = || tiny_config_with(critic);
    let root = tempfile::tempdir().unwrap();
    let (a, b) = (root.path().join("a"), root.path().join("b"));

    let mut straight = Trainer::create(tiny_config(), &a).unwrap();
    straight.run(4, &mut |_| {}).unwrap();
    let expected = weights(&straight);

    let mut first = Trainer::create(tiny_config(), &b).unwrap();
    first.run(2, &mut |_| {}).unwrap();
    assert_eq!(first.state().step, 2);
    let after_two = weights(&first);
    drop(first);
    assert_ne!(after_two, expected, "two steps must differ from four");

    // A checkpoint that crashed mid-write: the resumed run must not pick it up.
    let crashed = b.join("ckpt-3.tmp");
    std::fs::create_dir_all(&crashed).unwrap();
    std::fs::write(crashed.join("state.json"), "{ torn").unwrap();
    assert_eq!(checkpoint::latest(&b).unwrap(), Some(b.join("ckpt-2")));

    let mut resumed = Trainer::resume(tiny_config(), &b).unwrap();
    assert_eq!(resumed.state().step, 2);
    assert_eq!(weights(&resumed), after_two);
    resumed.run(4, &mut |_| {}).unwrap();
    assert_eq!(resumed.state(), straight.state());
    assert_eq!(weights(&resumed), expected);
}

#[test]
fn a_fresh_run_refuses_a_directory_holding_one() {
    let root = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config();
    cfg.max_steps = 1;
    cfg.sft.steps = 0;
    cfg.eval_steps = 0;
    let mut t = Trainer::create(cfg.clone(), root.path()).unwrap();
    t.run(1, &mut |_| {}).unwrap();
    drop(t);
    let err = Trainer::create(cfg, root.path()).err().unwrap().to_string();
    assert!(err.contains("--resume"), "{err}");
}

#[test]
fn kl_to_the_reference_starts_at_zero_and_resumes_exactly() {
    let cfg = || {
        let mut cfg = tiny_config();
        cfg.init_kl_coef = 0.5;
        cfg.use_kl_loss = true;
        cfg.kl_loss_coef = 0.1;
        cfg.kl_penalty = stepppo::algo::config::KlEstimator::K3;
        cfg
    };
    let root = tempfile::tempdir().unwrap();
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    let (mut kl, mut kl_loss) = (Vec::new(), Vec::new());
    let mut straight = Trainer::create(cfg(), &a).unwrap();
    straight
        .run(4, &mut |event| {
            if let stepppo::train::run::trainer::Event::Step { scalars, .. } = event {
                kl.push(scalars["actor/reward_kl_penalty"]);
                kl_loss.push(scalars["actor/kl_loss"]);
            }
        })
        .unwrap();
    assert!(
        kl_loss.iter().all(|&k| k.is_finite() && k >= 0.0),
        "{kl_loss:?}"
    );
    assert!(a.join("reference/model.safetensors").is_file());
    assert_eq!(kl.len(), 4);
    // Step 1 samples from the reference itself: only float noise between the two paths.
    assert!(kl[0].abs() < 1e-3, "{kl:?}");

    let mut first = Trainer::create(cfg(), &b).unwrap();
    first.run(2, &mut |_| {}).unwrap();
    drop(first);
    let mut resumed = Trainer::resume(cfg(), &b).unwrap();
    resumed.run(4, &mut |_| {}).unwrap();
    assert_eq!(weights(&resumed), weights(&straight));
}

/// Under bf16 the reference is scored in the update's numerics, and the reward's KL penalty
/// reads the policy's log-probs recomputed in them: at step 1, where the policy is the reference,
/// the penalty is exactly zero (an f32 reference against bf16 log-probs would leave rounding).
#[test]
fn under_bf16_the_kl_to_the_reference_compares_like_with_like() {
    let mut cfg = tiny_config_with(&["precision=bf16"]);
    cfg.init_kl_coef = 0.5;
    cfg.use_kl_loss = true;
    cfg.kl_loss_coef = 0.1;
    cfg.kl_penalty = stepppo::algo::config::KlEstimator::K3;
    let root = tempfile::tempdir().unwrap();
    let mut t = Trainer::create(cfg, root.path()).unwrap();
    let mut kl = Vec::new();
    t.run(2, &mut |event| {
        if let stepppo::train::run::trainer::Event::Step { scalars, .. } = event {
            kl.push(scalars["actor/reward_kl_penalty"]);
        }
    })
    .unwrap();
    assert_eq!(kl[0], 0.0, "{kl:?}");
    assert!(kl[1].is_finite() && kl[1] >= 0.0, "{kl:?}");
}

#[test]
fn the_self_imitation_buffer_is_checkpointed_and_resumes_exactly() {
    self_imitation_resumes_exactly("context=window");
}

/// In the concat layout the buffer holds whole trajectories; they come back as they were saved.
#[test]
fn a_trajectory_self_imitation_buffer_resumes_exactly() {
    self_imitation_resumes_exactly("context=concat");
}

fn self_imitation_resumes_exactly(context: &str) {
    let cfg = || {
        let mut cfg = tiny_config_with(&[SHARED_CRITIC, &[context]].concat());
        cfg.self_imitation.coef = 1.0;
        cfg.self_imitation.margin = 0.0;
        cfg.self_imitation.batch_size = 2;
        cfg
    };
    let root = tempfile::tempdir().unwrap();
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    let (mut sizes, mut nll) = (Vec::new(), Vec::new());
    let mut straight = Trainer::create(cfg(), &a).unwrap();
    straight
        .run(4, &mut |event| {
            if let stepppo::train::run::trainer::Event::Step { scalars, .. } = event {
                sizes.push(scalars["self_imitation/buffer_size"]);
                nll.extend(scalars.get("self_imitation/nll").copied());
            }
        })
        .unwrap();
    assert!(
        sizes.last().unwrap() > &0.0,
        "no contrasted choice in 4 steps: {sizes:?}"
    );
    assert!(
        !nll.is_empty() && nll.iter().all(|x| x.is_finite() && *x > 0.0),
        "{nll:?}"
    );

    let mut first = Trainer::create(cfg(), &b).unwrap();
    first.run(2, &mut |_| {}).unwrap();
    drop(first);
    assert!(b.join("ckpt-2/self_imitation").is_dir());
    let mut resumed = Trainer::resume(cfg(), &b).unwrap();
    resumed.run(4, &mut |_| {}).unwrap();
    assert_eq!(weights(&resumed), weights(&straight));
}

#[test]
fn a_shared_value_head_steps_at_the_critic_learning_rate() {
    let root = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config();
    cfg.max_steps = 1;
    cfg.eval_steps = 0;
    // The head's steps are then of order 1e-30: invisible beside the actor's.
    cfg.critic.learning_rate = 1e-30;
    let mut t = Trainer::create(cfg, root.path()).unwrap();
    let before = weights(&t);
    t.run(1, &mut |_| {}).unwrap();
    let after = weights(&t);
    for ((name, b), (_, a)) in before.iter().zip(&after) {
        if name.starts_with("score.") {
            let moved = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(
                moved < 1e-20,
                "{name} moved {moved} at critic.learning_rate 1e-30"
            );
        }
    }
    let trunk_moved = before
        .iter()
        .zip(&after)
        .any(|((name, b), (_, a))| !name.starts_with("score.") && a != b);
    assert!(trunk_moved, "the actor's parameters should have moved");
    assert!(before.iter().any(|(n, _)| n.starts_with("score.")));
}

#[test]
fn the_critic_warm_up_trains_the_value_head_and_leaves_the_policy_alone() {
    let root = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config();
    cfg.max_steps = 1;
    cfg.eval_steps = 0;
    cfg.critic.warmup_steps = 1;
    let mut t = Trainer::create(cfg, root.path()).unwrap();
    let before = weights(&t);
    t.run(1, &mut |_| {}).unwrap();
    let after = weights(&t);
    let mut head_moved = false;
    for ((name, b), (_, a)) in before.iter().zip(&after) {
        if name.starts_with("score.") {
            head_moved |= a != b;
        } else {
            assert_eq!(a, b, "{name} moved during the critic warm-up");
        }
    }
    assert!(head_moved, "the value head should have been trained");
}

/// Recomputing the blocks in the backward (policy and separate critic, warm start included)
/// trains as keeping their activations does, and a resumed run may switch it.
#[test]
fn activation_checkpointing_trains_as_without_and_may_change_at_resume() {
    let cfg = |on: bool| {
        let flag = format!("activation_checkpointing={on}");
        tiny_config_with(&["critic.mode=separate", "critic.history_batches=1", &flag])
    };
    let root = tempfile::tempdir().unwrap();
    let run = |on: bool| {
        let dir = root.path().join(format!("ckpt-{on}"));
        let mut t = Trainer::create(cfg(on), &dir).unwrap();
        t.run(2, &mut |_| {}).unwrap();
        (weights(&t), dir)
    };
    let ((kept, _), (recomputed, dir)) = (run(false), run(true));
    for ((name, a), (_, b)) in kept.iter().zip(&recomputed) {
        let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst <= 1e-5, "{name}: {worst}");
    }
    let mut resumed = Trainer::resume(cfg(false), &dir).unwrap();
    resumed.run(3, &mut |_| {}).unwrap();
}

/// bf16 mixed precision (policy and separate critic, warm start included) trains
/// deterministically from f32 master weights, near the f32 run, and a resumed run may switch it.
#[test]
fn bf16_precision_trains_deterministically_near_f32_and_may_change_at_resume() {
    let cfg = |precision: &str| {
        let flag = format!("precision={precision}");
        tiny_config_with(&["critic.mode=separate", "critic.history_batches=1", &flag])
    };
    let root = tempfile::tempdir().unwrap();
    let run = |precision: &str, name: &str| {
        let dir = root.path().join(name);
        let mut t = Trainer::create(cfg(precision), &dir).unwrap();
        t.run(2, &mut |_| {}).unwrap();
        (weights(&t), dir)
    };
    let (full, _) = run("f32", "f32");
    let (bf16, dir) = run("bf16", "bf16");
    let (again, _) = run("bf16", "bf16-again");
    assert_eq!(
        bf16, again,
        "the same config and seed train the same weights"
    );
    let (mut moved, mut worst) = (false, 0f32);
    for ((name, a), (_, b)) in full.iter().zip(&bf16) {
        moved |= a != b;
        worst = a
            .iter()
            .zip(b)
            .fold(worst, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst <= 0.05, "{name}: bf16 strays {worst} from f32");
    }
    assert!(moved, "bf16 products should round differently from f32");
    // The update recomputes the sampled tokens' log-probs in its bf16 numerics and weighs each
    // token by its ratio to the f32 sampler's: near 1, logged; an f32 run needs none.
    let weights_logged = |run: &str| {
        let rows = read_jsonl(&root.path().join(run).join("metrics.jsonl")).unwrap();
        let updates: Vec<_> = rows
            .into_iter()
            .filter(|(_, s)| s.contains_key("time/update"))
            .collect();
        assert_eq!(updates.len(), 2, "{run}");
        updates
            .iter()
            .map(|(_, s)| s.get("actor/behaviour_weight_mean").copied())
            .collect::<Vec<_>>()
    };
    assert!(weights_logged("f32").iter().all(Option::is_none));
    for mean in weights_logged("bf16") {
        let mean = mean.expect("bf16 updates log their behaviour weights");
        assert!((mean - 1.0).abs() < 0.05, "behaviour weight mean {mean}");
    }
    let mut resumed = Trainer::resume(cfg("f32"), &dir).unwrap();
    resumed.run(3, &mut |_| {}).unwrap();
}

/// Rollouts in bf16 (`rollout_dtype`) record what the bf16 model gave the tokens it sampled:
/// the same on a second run, near the f32 rollouts' log-probs and not equal to them; a resumed
/// run may switch the dtype.
#[test]
fn bf16_rollouts_record_bf16_logprobs_deterministically_and_may_change_at_resume() {
    let cfg = |dtype: &str| tiny_config_with(&[&format!("rollout_dtype={dtype}")]);
    let root = tempfile::tempdir().unwrap();
    let run = |dtype: &str, name: &str| {
        let dir = root.path().join(name);
        let mut t = Trainer::create(cfg(dtype), &dir).unwrap();
        t.run(1, &mut |_| {}).unwrap();
        let dataset = Dataset::open(&dir.join("dataset")).unwrap();
        let records: Vec<StepRecord> = dataset.records().map(|v| v.to_record().unwrap()).collect();
        (records, dir)
    };
    let (full, _) = run("f32", "f32");
    let (bf16, dir) = run("bf16", "bf16");
    let (again, _) = run("bf16", "bf16-again");
    assert_eq!(
        bf16, again,
        "the same config and seed roll out the same steps"
    );
    let (mut compared, mut moved) = (0, false);
    for (a, b) in full.iter().zip(&bf16) {
        if a.obs_ids != b.obs_ids || a.response_ids != b.response_ids {
            break;
        }
        for (x, y) in a.response_logprobs.iter().zip(&b.response_logprobs) {
            assert!(
                (x - y).abs() <= 0.1,
                "bf16 log-prob {y} strays from f32's {x}"
            );
            moved |= x != y;
            compared += 1;
        }
    }
    assert!(
        compared > 0,
        "the first steps should sample the same tokens"
    );
    assert!(moved, "bf16 rollouts should round differently from f32");
    let mut resumed = Trainer::resume(cfg("f32"), &dir).unwrap();
    resumed.run(2, &mut |_| {}).unwrap();
}

/// The credit log holds, for every stored record, what its update used: the separate critic's
/// value (not 0), an advantage that is the whitened `return − value` of its batch (λ = 1), the
/// ratio the policy loss saw, and the version that sampled it (the learner's, synchronously).
#[test]
fn the_credit_log_holds_what_each_update_used() {
    use stepppo::train::run::credit_log::{read_credit, CREDIT_FILE};
    let root = tempfile::tempdir().unwrap();
    let cfg = tiny_config_with(&["critic.mode=separate", "critic.history_batches=1"]);
    let mut trainer = Trainer::create(cfg, root.path()).unwrap();
    trainer.run(3, &mut |_| {}).unwrap();
    drop(trainer);
    let credit = read_credit(&root.path().join(CREDIT_FILE)).unwrap();
    let dataset = Dataset::open(&root.path().join("dataset")).unwrap();
    let keys: Vec<(u64, u32)> = dataset
        .records()
        .map(|r| (r.traj_id, r.step_index))
        .collect();
    assert_eq!(credit.len(), keys.len(), "one row per stored record");
    assert!(keys.iter().all(|k| credit.contains_key(k)));
    for version in 0..3u64 {
        let rows: Vec<_> = credit
            .values()
            .filter(|c| c.learner_version == version)
            .collect();
        assert!(!rows.is_empty(), "no rows of update {version}");
        for c in &rows {
            assert_eq!(c.behaviour_version, version, "synchronous: on-policy");
            assert!(c.kept);
            let ratio = c.ratio_first.expect("a kept step passes the policy loss");
            assert!(ratio.is_finite() && (0.5..2.0).contains(&ratio), "{ratio}");
        }
        let values: Vec<f32> = rows.iter().map(|c| c.value.expect("a critic")).collect();
        assert!(values.iter().any(|&v| v != 0.0), "every value is 0");
        // Whitening is affine: the advantages correlate perfectly with return − value.
        let x: Vec<f64> = rows
            .iter()
            .map(|c| f64::from(c.ret - c.value.unwrap()))
            .collect();
        let a: Vec<f64> = rows.iter().map(|c| f64::from(c.advantage)).collect();
        let r = pearson(&x, &a);
        assert!(
            r > 0.9999,
            "update {version}: corr(return − value, advantage) = {r}"
        );
    }
}

fn pearson(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let cov: f64 = x.iter().zip(y).map(|(a, b)| (a - mx) * (b - my)).sum();
    let sx = x.iter().map(|a| (a - mx).powi(2)).sum::<f64>().sqrt();
    let sy = y.iter().map(|b| (b - my).powi(2)).sum::<f64>().sqrt();
    cov / (sx * sy)
}
