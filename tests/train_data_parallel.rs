//! Data-parallel training under `mpirun` (feature `mpi`): two ranks and one rank with the same
//! global batch and seed end with the same weights (up to f32 reduction order) and the same
//! dataset, and a two-rank checkpoint resumes on two ranks and on one; with the optimizer and
//! the gradients sharded (ZeRO-1/2) too, across rank counts and modes. Skipped, saying so, where
//! `mpirun` is not installed. `--ignored sharding_exactness_table` prints the bound each sharding
//! mode reaches at 2 and 3 ranks against one rank.
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

/// `--resume` with `sets` (keys a resumed run may change).
fn resume_args(out: &Path, sets: &[&str]) -> Vec<String> {
    let mut a = args(out, true, &[]);
    for s in sets {
        a.extend(["--set".to_string(), s.to_string()]);
    }
    a
}

fn with_max_steps(mut a: Vec<String>, n: u64) -> Vec<String> {
    a.extend(["--set".to_string(), format!("max_steps={n}")]);
    a
}

/// Every tensor of the safetensors files of `ckpt-<step>/<part>` (a directory or one file),
/// as `file/name` → flat f32 values, sorted.
fn checkpoint_tensors(run: &Path, step: u64, part: &str) -> Vec<(String, Vec<f32>)> {
    let path = run.join(format!("ckpt-{step}/{part}"));
    let files: Vec<_> = if path.is_dir() {
        std::fs::read_dir(&path)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect()
    } else {
        vec![path]
    };
    let mut w = Vec::new();
    for file in files {
        let stem = file.file_name().unwrap().to_string_lossy().to_string();
        for (n, t) in candle_core::safetensors::load(&file, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        {
            let v = t.to_dtype(candle_core::DType::F32).unwrap();
            w.push((
                format!("{stem}/{n}"),
                v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            ));
        }
    }
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// The largest |Δ| between the tensors of `part` at `step` in two runs.
fn max_difference(one: &Path, two: &Path, step: u64, part: &str) -> f32 {
    let (a, b) = (
        checkpoint_tensors(one, step, part),
        checkpoint_tensors(two, step, part),
    );
    worst_difference(&a, &b, part, step)
}

/// The largest |Δ| between two lists of named tensors, which must name the same tensors.
fn worst_difference(
    a: &[(String, Vec<f32>)],
    b: &[(String, Vec<f32>)],
    what: &str,
    step: u64,
) -> f32 {
    assert_eq!(a.len(), b.len(), "{what}: tensor counts");
    assert!(!a.is_empty(), "{what}: no tensors at step {step}");
    let mut worst = 0f32;
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        assert_eq!(va.len(), vb.len(), "{na}");
        for (x, y) in va.iter().zip(vb) {
            worst = worst.max((x - y).abs());
        }
    }
    worst
}

/// Optimizer `name`'s whole state at `step` as `name.safetensors/<tensor>` → flat values,
/// sorted: the file of an unsharded run, or the ranks' blocks of a sharded one read back by a
/// whole optimizer over the parameters their layout lists.
fn optimizer_tensors(run: &Path, step: u64, name: &str) -> Vec<(String, Vec<f32>)> {
    let file = format!("{name}.safetensors");
    let blocks = run.join(format!("ckpt-{step}/{name}"));
    if !blocks.is_dir() {
        return checkpoint_tensors(run, step, &file);
    }
    let layout: serde_json::Value =
        serde_json::from_slice(&std::fs::read(blocks.join("layout.json")).unwrap()).unwrap();
    // Each unit's parameters (name, values), in the flat order.
    let params: Vec<(String, candle_core::Var)> = layout["units"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|unit| unit.as_array().unwrap())
        .map(|p| {
            let len = p[1].as_u64().unwrap() as usize;
            let var = candle_core::Var::zeros(len, candle_core::DType::F32, &Device::Cpu);
            (p[0].as_str().unwrap().to_string(), var.unwrap())
        })
        .collect();
    let config = stepppo::algo::config::OptimizerConfig::default();
    let mut opt = stepppo::algo::AdamW::new(params, &config).unwrap();
    opt.load(&blocks).unwrap();
    let mut w: Vec<_> = opt
        .state()
        .unwrap()
        .into_iter()
        .map(|(n, t)| {
            let v = t.to_dtype(candle_core::DType::F32).unwrap();
            (
                format!("{file}/{n}"),
                v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        })
        .collect();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// The largest |Δ| between two runs' states of optimizer `name` at `step`.
fn optimizer_difference(one: &Path, two: &Path, step: u64, name: &str) -> f32 {
    let (a, b) = (
        optimizer_tensors(one, step, name),
        optimizer_tensors(two, step, name),
    );
    worst_difference(&a, &b, name, step)
}

fn assert_same_weights(one: &Path, two: &Path, step: u64) {
    let worst = max_difference(one, two, step, "policy");
    assert!(
        worst <= WEIGHT_TOLERANCE,
        "one rank and several differ by {worst} after {step} steps"
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

/// A separate critic, so that both optimizers shard.
const SEPARATE_CRITIC: &[&str] = &[
    "adv_estimator=step_gae",
    "critic.mode=separate",
    "critic.history_batches=1",
];

/// ZeRO-2 on three ranks (an uneven split of the flat parameters), resumed as ZeRO-1 on two,
/// then unsharded on one: the weights and the optimizer states of each checkpoint are one rank's.
/// With activation checkpointing, and the tree forward (the default).
#[test]
fn sharded_ranks_train_as_one_rank_and_resume_at_any_rank_count_and_mode() {
    let Some(_) = mpirun() else { return };
    let root = tempfile::tempdir().unwrap();
    let (one, sharded) = (root.path().join("one"), root.path().join("sharded"));
    let mut config = SEPARATE_CRITIC.to_vec();
    config.push("activation_checkpointing=true");
    train(None, 1, &with_max_steps(args(&one, false, &config), 4));
    let mut first = config.clone();
    first.push("sharding=gradients");
    train(
        mpirun(),
        3,
        &with_max_steps(args(&sharded, false, &first), 2),
    );
    train(
        mpirun(),
        2,
        &with_max_steps(resume_args(&sharded, &["sharding=optimizer"]), 3),
    );
    train(
        None,
        1,
        &with_max_steps(resume_args(&sharded, &["sharding=none"]), 4),
    );
    for step in 2..=4 {
        assert_same_weights(&one, &sharded, step);
        for part in ["optim_actor", "optim_critic"] {
            let worst = optimizer_difference(&one, &sharded, step, part);
            assert!(worst <= WEIGHT_TOLERANCE, "{part} at step {step}: {worst}");
        }
    }
    assert_same_dataset(&one, &sharded);
}

/// Largest |Δ| between two runs' values of each metric logged at the same step, and the metric
/// that reached it. Timings, memory, traffic, the prefix cache's counters (each rank's cache
/// sees its own groups) and the critic's explained variance per mini-batch (on several ranks,
/// the mean of each rank's part's) are not compared.
fn metric_difference(one: &Path, other: &Path) -> (f64, String) {
    let read = |run: &Path| -> Vec<serde_json::Map<String, serde_json::Value>> {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let cache = [
        "rollout/cached_tokens",
        "rollout/prefilled_tokens",
        "rollout/prefix_hit_ratio",
        "rollout/cascade_forwards",
        "rollout/shared_positions_saved",
        "critic/vf_explained_var_minibatch",
    ];
    let timing = |k: &str| {
        ["time/", "throughput/", "memory/", "dist/"]
            .iter()
            .any(|p| k.starts_with(p))
            || cache.contains(&k)
    };
    let (a, b) = (read(one), read(other));
    assert_eq!(a.len(), b.len(), "metrics rows");
    let mut worst = (0.0, String::new());
    for (x, y) in a.iter().zip(&b) {
        for (k, v) in x.iter().filter(|(k, _)| !timing(k)) {
            let (Some(p), Some(q)) = (v.as_f64(), y.get(k).and_then(|w| w.as_f64())) else {
                continue;
            };
            if (p - q).abs() > worst.0 {
                worst = ((p - q).abs(), k.clone());
            }
        }
    }
    worst
}

/// The bound each sharding mode reaches against one rank, on the default and on LoRA, at 2 and
/// 3 ranks: 4 steps each, largest |Δ| of the weights, of the optimizer state and of the metrics.
#[test]
#[ignore = "a table for BENCHMARKS: 26 tiny runs"]
fn sharding_exactness_table() {
    let Some(_) = mpirun() else { return };
    let root = tempfile::tempdir().unwrap();
    let configs: [(&str, Vec<&str>); 2] = [
        ("default + separate critic", SEPARATE_CRITIC.to_vec()),
        (
            "LoRA r2",
            vec!["lora={rank: 2, alpha: 4, target_modules: all-linear}"],
        ),
    ];
    println!(
        "| config | sharding | ranks | max |Δ| weights | max |Δ| AdamW state | max |Δ| metric \
         | max |Δ| weights vs `none` at as many ranks |"
    );
    println!("|---|---|--:|--:|--:|--:|--:|");
    for (ci, (name, extra)) in configs.iter().enumerate() {
        let one = root.path().join(format!("one-{ci}"));
        train(None, 1, &with_max_steps(args(&one, false, extra), 4));
        for mode in ["none", "optimizer", "gradients"] {
            for ranks in [2, 3] {
                let run = root.path().join(format!("{ci}-{mode}-{ranks}"));
                let mut sets = extra.clone();
                let setting = format!("sharding={mode}");
                sets.push(&setting);
                train(
                    mpirun(),
                    ranks,
                    &with_max_steps(args(&run, false, &sets), 4),
                );
                let w = max_difference(&one, &run, 4, "policy");
                let o = optimizer_difference(&one, &run, 4, "optim_actor");
                let (m, key) = metric_difference(&one, &run);
                let unsharded = root.path().join(format!("{ci}-none-{ranks}"));
                let same_ranks = max_difference(&unsharded, &run, 4, "policy");
                println!(
                    "| {name} | {mode} | {ranks} | {w:.1e} | {o:.1e} | {m:.1e} (`{key}`) \
                     | {same_ranks:.1e} |"
                );
            }
        }
    }
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
