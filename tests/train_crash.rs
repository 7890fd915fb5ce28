//! A real `stepppo train` process killed with SIGKILL at every crash point that matters (during a
//! rollout, halfway through a step's store write, after a step's metrics row, inside a
//! checkpoint's temporary write, between its rename and the `ckpt-latest` pointer, after it),
//! then resumed with plain `--resume` (no `--set`: the run's own config): the dataset (record keys
//! and segment bytes), the metric rows, the TensorBoard events and the final weights equal those
//! of an uninterrupted run.

use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Command;
use stepppo::store::Dataset;
use stepppo::train::run::credit_log::CREDIT_FILE;
use stepppo::train::run::metrics::{is_measurement, read_events, read_jsonl};
use stepppo::train::Scalars;

/// Four steps of a tiny run with checkpoints at steps 2 and 4.
const TINY: &[&str] = &[
    "builtin_size=tiny",
    "max_steps=4",
    "eval_steps=2",
    "save_steps=2",
    "sft.steps=2",
    "sft.episodes=2",
    "sft.batch_size=2",
    "ppo_mini_batch_size=2",
    "train_env_manager.group_size=2",
    "train_env_manager.num_groups_partition=[2]",
    "val_env_manager.num_groups_partition=[2]",
    "generating_args.max_new_tokens=6",
    "val_generating_args.max_new_tokens=6",
    "custom_envs.SimpleFrozenLake.env_config.max_turns=3",
    "cache.kv_slots=4096",
];

fn train(run: &Path, extra: &[&str], crash_at: Option<&str>) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stepppo"));
    cmd.arg("train").arg("--out").arg(run).args(extra);
    match crash_at {
        Some(point) => cmd.env(stepppo::crash::ENV_VAR, point),
        None => cmd.env_remove(stepppo::crash::ENV_VAR),
    };
    cmd.output().expect("the stepppo binary runs")
}

fn fresh(run: &Path, crash_at: Option<&str>) -> std::process::Output {
    let mut args = Vec::new();
    for s in TINY {
        args.extend(["--set", s]);
    }
    train(run, &args, crash_at)
}

fn assert_ok(out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Metric rows without wall-clock measurements (those differ between any two runs).
fn deterministic(rows: Vec<(u64, Scalars)>) -> Vec<(u64, Scalars)> {
    rows.into_iter()
        .map(|(step, mut m)| {
            m.retain(|k, _| !is_measurement(k));
            (step, m)
        })
        .collect()
}

fn events(run: &Path) -> Vec<(u64, Vec<(String, f32)>)> {
    let mut files: Vec<_> = std::fs::read_dir(run.join("tb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let mut all = Vec::new();
    for f in files {
        for e in read_events(&f).unwrap() {
            if e.file_version.is_none() {
                let kept = e.scalars.into_iter().filter(|(k, _)| !is_measurement(k));
                all.push((e.step, kept.collect()));
            }
        }
    }
    all
}

fn segment_bytes(run: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(run.join("dataset"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "stp"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

/// Checks that the run in `got` equals the uninterrupted run in `want`.
fn assert_same_run(want: &Path, got: &Path, case: &str) {
    let (da, db) = (
        Dataset::open(&want.join("dataset")).unwrap(),
        Dataset::open(&got.join("dataset")).unwrap(),
    );
    assert!(db.problems().is_empty(), "{case}: {:?}", db.problems());
    let keys = |d: &Dataset| -> Vec<(u64, u32)> {
        d.records().map(|r| (r.traj_id, r.step_index)).collect()
    };
    let (ka, kb) = (keys(&da), keys(&db));
    let unique: BTreeSet<_> = kb.iter().collect();
    assert_eq!(unique.len(), kb.len(), "{case}: duplicate record keys");
    assert_eq!(ka, kb, "{case}: record keys differ");
    let records = |d: &Dataset| -> Vec<_> { d.records().map(|r| r.to_record().unwrap()).collect() };
    assert!(records(&da) == records(&db), "{case}: records differ");
    assert!(
        segment_bytes(want) == segment_bytes(got),
        "{case}: segment bytes differ"
    );
    let rows = |run: &Path| deterministic(read_jsonl(&run.join("metrics.jsonl")).unwrap());
    assert_eq!(rows(want), rows(got), "{case}: metrics.jsonl differs");
    let credit = |run: &Path| std::fs::read_to_string(run.join(CREDIT_FILE)).unwrap();
    assert_eq!(credit(want), credit(got), "{case}: credit.jsonl differs");
    assert_eq!(
        events(want),
        events(got),
        "{case}: TensorBoard events differ"
    );
    let weights = |run: &Path| std::fs::read(run.join("ckpt-4/policy/model.safetensors")).unwrap();
    assert!(
        weights(want) == weights(got),
        "{case}: final weights differ"
    );
}

#[test]
fn a_run_killed_at_any_crash_point_resumes_to_the_uninterrupted_run() {
    let root = tempfile::tempdir().unwrap();
    let want = root.path().join("straight");
    assert_ok(&fresh(&want, None), "uninterrupted run");

    for point in [
        "train.rollout_done@3",
        "train.store_write@3",
        "train.step_logged@3",
        "checkpoint.partial@2",
        "checkpoint.renamed@1",
        "checkpoint.renamed@2",
        "checkpoint.committed@1",
    ] {
        let run = root.path().join(point.replace(['.', '@'], "_"));
        let killed = fresh(&run, Some(point));
        assert_eq!(
            killed.status.signal(),
            Some(libc::SIGKILL),
            "{point}: the run should die at its crash point: {}",
            String::from_utf8_lossy(&killed.stderr)
        );
        assert_ok(&train(&run, &["--resume"], None), point);
        assert_same_run(&want, &run, point);
    }
}

#[test]
fn a_run_killed_before_its_first_checkpoint_says_so_and_starts_over_with_overwrite() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("run");
    let killed = fresh(&run, Some("train.step_logged@1"));
    assert_eq!(killed.status.signal(), Some(libc::SIGKILL));

    let resumed = train(&run, &["--resume"], None);
    assert!(!resumed.status.success());
    let err = String::from_utf8_lossy(&resumed.stderr);
    assert!(
        err.contains("before its first checkpoint") && err.contains("--overwrite"),
        "{err}"
    );
    let again = fresh(&run, None);
    assert!(!again.status.success());
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(err.contains("--overwrite"), "{err}");

    let mut args = vec!["--overwrite"];
    for s in TINY {
        args.extend(["--set", s]);
    }
    assert_ok(&train(&run, &args, None), "--overwrite");
    let want = root.path().join("straight");
    assert_ok(&fresh(&want, None), "uninterrupted run");
    assert_same_run(&want, &run, "--overwrite after a crash");
}

#[test]
fn resume_keeps_the_run_config_and_names_the_keys_a_flag_would_change() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("run");
    let killed = fresh(&run, Some("checkpoint.committed@1"));
    assert_eq!(killed.status.signal(), Some(libc::SIGKILL));

    let changed = train(
        &run,
        &["--resume", "--set", "learning_rate=0.1", "--set", "seed=7"],
        None,
    );
    assert!(!changed.status.success());
    let err = String::from_utf8_lossy(&changed.stderr);
    assert!(
        err.contains("learning_rate") && err.contains("seed") && err.contains("max_steps"),
        "{err}"
    );
    // The refused resume touched nothing: a plain resume still ends as the uninterrupted run.
    assert_ok(
        &train(&run, &["--resume", "--set", "max_steps=4"], None),
        "resume",
    );
    let want = root.path().join("straight");
    assert_ok(&fresh(&want, None), "uninterrupted run");
    assert_same_run(&want, &run, "resume after a refused one");
    // Resuming a run that reached its max_steps trains nothing and says so.
    let finished = train(&run, &["--resume", "--set", "max_steps=4"], None);
    assert_ok(&finished, "resume of a finished run");
    let err = String::from_utf8_lossy(&finished.stderr);
    assert!(
        err.contains("already reached step 4 of max_steps 4"),
        "{err}"
    );
}
