//! Data-parallel training under `mpirun` (feature `mpi`): two ranks and one rank with the same
//! global batch and seed end with the same weights (up to f32 reduction order) and the same
//! dataset, and a two-rank checkpoint resumes on two ranks and on one. Skipped, saying so, where
//! `mpirun` is not installed.
#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::Command;

use candle_core::Device;
use stepppo::store::Dataset;

/// Largest |Δ| allowed between a weight trained on one rank and on two: the gradient sums and
/// the loss normalisers are added in another order.
const WEIGHT_TOLERANCE: f32 = 1e-4;

/// A tiny model on 4 groups of 2 FrozenLake episodes, 4 sequences per mini-batch (2 per rank).
const TINY: &[&str] = &[
    "builtin_size=tiny",
    "eval_steps=2",
    "save_steps=1",
    "sft.steps=3",
    "sft.episodes=4",
    "sft.batch_size=2",
    "ppo_mini_batch_size=4",
    "train_env_manager.group_size=2",
    "train_env_manager.num_groups_partition=[4]",
    "val_env_manager.num_groups_partition=[2]",
    "generating_args.max_new_tokens=6",
    "val_generating_args.max_new_tokens=6",
    "custom_envs.SimpleFrozenLake.env_config.max_turns=2",
    "cache.kv_slots=8192",
];

fn mpirun() -> Option<Command> {
    let found = Command::new("mpirun").arg("--version").output().is_ok();
    if !found {
        eprintln!(
            "skipped: mpirun is not on PATH (install Open MPI: docs/guides/data-parallel.md)"
        );
        return None;
    }
    let mut cmd = Command::new("mpirun");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    cmd.args(["--oversubscribe", "--bind-to", "none"]);
    Some(cmd)
}

/// `stepppo train` on `ranks` ranks (1: a plain process) with `args`.
fn train(launcher: Option<Command>, ranks: usize, args: &[String]) {
    let exe = env!("CARGO_BIN_EXE_stepppo");
    let mut cmd = match launcher {
        Some(mut m) if ranks > 1 => {
            m.args(["-np", &ranks.to_string(), exe]);
            m
        }
        _ => Command::new(exe),
    };
    let out = cmd
        .arg("train")
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .expect("the launcher runs");
    assert!(
        out.status.success(),
        "{ranks} rank(s) train {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn args(out: &Path, resume: bool, extra: &[&str]) -> Vec<String> {
    let mut a = vec!["--out".to_string(), out.display().to_string()];
    if resume {
        a.push("--resume".into());
    } else {
        for s in TINY.iter().chain(extra) {
            a.extend(["--set".to_string(), s.to_string()]);
        }
    }
    a
}

fn with_max_steps(mut a: Vec<String>, n: u64) -> Vec<String> {
    a.extend(["--set".to_string(), format!("max_steps={n}")]);
    a
}

fn policy_weights(run: &Path, step: u64) -> Vec<(String, Vec<f32>)> {
    let file = run.join(format!("ckpt-{step}/policy/model.safetensors"));
    let mut w: Vec<_> = candle_core::safetensors::load(&file, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .into_iter()
        .map(|(n, t)| {
            let v = t.to_dtype(candle_core::DType::F32).unwrap();
            (n, v.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

fn assert_same_weights(one: &Path, two: &Path, step: u64) {
    let (a, b) = (policy_weights(one, step), policy_weights(two, step));
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        for (x, y) in va.iter().zip(vb) {
            worst = worst.max((x - y).abs());
        }
    }
    assert!(
        worst <= WEIGHT_TOLERANCE,
        "one rank and two ranks differ by {worst} after {step} steps"
    );
}

fn assert_same_dataset(one: &Path, two: &Path) {
    let (a, b) = (
        Dataset::open(&one.join("dataset")).unwrap(),
        Dataset::open(&two.join("dataset")).unwrap(),
    );
    assert!(a.problems().is_empty(), "{:?}", a.problems());
    assert!(b.problems().is_empty(), "{:?}", b.problems());
    // Each rank writes its own segments: compare in trajectory order.
    let sorted = |d: &Dataset| {
        let mut r: Vec<_> = d.records().map(|r| r.to_record().unwrap()).collect();
        r.sort_by_key(|r| (r.traj_id, r.step_index));
        r
    };
    let (ra, rb) = (sorted(&a), sorted(&b));
    assert_eq!(ra.len(), rb.len(), "record counts");
    for (x, y) in ra.iter().zip(&rb) {
        let at = (x.traj_id, x.step_index);
        assert_eq!(at, (y.traj_id, y.step_index));
        assert_eq!(x.obs_ids, y.obs_ids, "observation of {at:?}");
        assert_eq!(x.response_ids, y.response_ids, "response of {at:?}");
        assert_eq!(x.reward, y.reward, "reward of {at:?}");
        for (p, q) in x.response_logprobs.iter().zip(&y.response_logprobs) {
            assert!((p - q).abs() < 1e-3, "log-probs of {at:?}: {p} vs {q}");
        }
    }
}

/// 4 steps on one rank; 2 steps on two ranks, resumed on two ranks to 3, then on one rank to 4.
fn two_ranks_train_as_one(extra: &[&str]) {
    let Some(_) = mpirun() else { return };
    let root = tempfile::tempdir().unwrap();
    let (one, two) = (root.path().join("one"), root.path().join("two"));
    train(None, 1, &with_max_steps(args(&one, false, extra), 4));
    train(mpirun(), 2, &with_max_steps(args(&two, false, extra), 2));
    assert_same_weights(&one, &two, 2);
    train(mpirun(), 2, &with_max_steps(args(&two, true, extra), 3));
    assert_same_weights(&one, &two, 3);
    train(None, 1, &with_max_steps(args(&two, true, extra), 4));
    assert_same_weights(&one, &two, 4);
    assert_same_dataset(&one, &two);
}

/// The default recipe: group-normalised step advantages and the self-imitation replay.
#[test]
fn two_ranks_train_the_default_as_one_rank() {
    two_ranks_train_as_one(&[]);
}

/// StepPO's critic: step-level GAE with a separate critic, its gradients summed too.
#[test]
fn two_ranks_train_a_separate_critic_as_one_rank() {
    two_ranks_train_as_one(&[
        "adv_estimator=step_gae",
        "critic.mode=separate",
        "critic.history_batches=1",
    ]);
}

/// A shared value head: one backward, the trunk's and the head's gradients summed apart.
#[test]
fn two_ranks_train_a_shared_head_as_one_rank() {
    two_ranks_train_as_one(&[
        "adv_estimator=step_gae",
        "critic.mode=shared",
        "critic.history_batches=1",
    ]);
}
