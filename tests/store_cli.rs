//! `stepppo replay` and `stepppo dataset verify|repair` on a dataset written through the library.

use std::path::Path;
use std::process::{Command, Output};

use stepppo::env::StepInfo;
use stepppo::store::{scan_segment, DatasetWriter, StepRecord, WriterOptions};
use stepppo::tokenizer::Tokenizer;

fn stepppo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(args)
        .output()
        .unwrap()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Two trajectories: traj 0 succeeds in two steps, traj 1 fails in one.
fn records() -> Vec<StepRecord> {
    let step = |traj_id, step_index, reward, success, last| StepRecord {
        traj_id,
        group_id: 4,
        step_index,
        env_tag: "frozen_lake".into(),
        seed: 11,
        context_len: step_index * 6,
        obs_ids: Tokenizer::builtin().encode("<|im_start|>user\nWhich way?<|im_end|>\n"),
        response_ids: vec![5, 6],
        response_logprobs: vec![0.0, 0.0],
        reward,
        terminated: last,
        info: StepInfo {
            success,
            action_is_valid: true,
            observation_text: format!("obs {traj_id}/{step_index}"),
            action_text: format!("<answer>Down</answer> {traj_id}/{step_index}"),
            ..StepInfo::default()
        },
        ..StepRecord::default()
    };
    vec![
        step(0, 0, 0.0, false, false),
        step(0, 1, 1.0, true, true),
        step(1, 0, 0.0, false, true),
    ]
}

fn write(dir: &Path) {
    let mut writer = DatasetWriter::create(dir, WriterOptions::default()).unwrap();
    records().iter().for_each(|r| {
        writer.append(r).unwrap();
    });
    writer.seal().unwrap();
}

#[test]
fn replay_prints_transcripts_jsonl_and_stats() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let path = dir.path().to_str().unwrap();

    let text = stepppo(&["replay", path, "--traj", "0"]);
    assert!(text.status.success());
    let text = stdout(&text);
    assert!(
        text.contains("trajectory 0")
            && text.contains("obs 0/1")
            && text.contains("[end: terminated]"),
        "{text}"
    );
    assert!(!text.contains("obs 1/0"));
    // The new context tokens, decoded: everything the model saw, template markers included.
    assert!(
        text.contains("new tokens]\n<|im_start|>user\nWhich way?<|im_end|>\n[observation]"),
        "{text}"
    );
    let bad = stepppo(&["replay", path, "--tokenizer", "/no/such/dir"]);
    assert!(!bad.status.success());
    assert!(
        stdout(&bad).is_empty()
            && String::from_utf8_lossy(&bad.stderr).contains("--tokenizer /no/such/dir")
    );

    let jsonl = stdout(&stepppo(&["replay", path, "--format", "jsonl"]));
    let parsed: Vec<StepRecord> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(parsed, records());

    let stats = stepppo(&["replay", path, "--stats", "--json"]);
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(stats["trajectories"], 2);
    assert_eq!(stats["steps"], 3);
    assert_eq!(stats["success_rate"], 0.5);
    assert_eq!(stats["per_env"]["frozen_lake"]["trajectories"], 2);
    assert!(stdout(&stepppo(&["replay", path, "--stats"])).contains("frozen_lake"));
}

#[test]
fn verify_fails_on_damage_naming_file_and_offset_and_repair_fixes_it() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let path = dir.path().to_str().unwrap();
    assert!(stepppo(&["dataset", "verify", path]).status.success());

    let seg = dir.path().join("seg-000000.stp");
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[40] ^= 1; // inside the first record
    std::fs::write(&seg, bytes).unwrap();
    let verify = stepppo(&["dataset", "verify", path]);
    assert!(!verify.status.success());
    let listed = stdout(&verify);
    assert!(
        listed.contains("seg-000000.stp at byte 16: corrupt record"),
        "{listed}"
    );

    assert!(stepppo(&["dataset", "repair", path]).status.success());
    assert!(stepppo(&["dataset", "verify", path]).status.success());
    let jsonl = stdout(&stepppo(&["replay", path, "--format", "jsonl"]));
    assert_eq!(jsonl.lines().count(), 2);
}

/// Four records; the second and fourth refer to the first one's observation text.
fn shared_text_records() -> Vec<StepRecord> {
    let mut records = records();
    records.push(StepRecord {
        traj_id: 2,
        ..records[0].clone()
    });
    for i in [1, 3] {
        records[i].info.observation_text = records[0].info.observation_text.clone();
    }
    records
}

#[test]
fn replay_skips_records_that_do_not_decode_and_fails_only_with_strict() {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = DatasetWriter::create(dir.path(), WriterOptions::default()).unwrap();
    for r in &shared_text_records() {
        writer.append(r).unwrap();
    }
    writer.seal().unwrap();
    let path = dir.path().to_str().unwrap();
    let seg = dir.path().join("seg-000000.stp");
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[40] ^= 1; // inside the first record, whose observation text two others refer to
    std::fs::write(&seg, bytes).unwrap();

    let jsonl = stepppo(&["replay", path, "--format", "jsonl"]);
    assert!(jsonl.status.success());
    let stderr = String::from_utf8_lossy(&jsonl.stderr);
    assert!(
        stderr.contains("skipped 2 records that do not decode")
            && stderr.contains("seg-000000.stp at byte ")
            && stderr.contains("corrupt record"),
        "{stderr}"
    );
    let parsed: Vec<StepRecord> = stdout(&jsonl)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(parsed, vec![records()[2].clone()]);

    for args in [
        &["replay", path][..],
        &["replay", path, "--stats", "--json"],
        &["replay", path, "--advantages", "grpo"],
    ] {
        let plain = stepppo(args);
        assert!(plain.status.success(), "{args:?}: {plain:?}");
        assert!(!plain.stdout.is_empty(), "{args:?}");
        let strict = stepppo(&[args, &["--strict"]].concat());
        assert!(!strict.status.success(), "{args:?}");
        assert_eq!(
            strict.stdout, plain.stdout,
            "{args:?}: same output, other exit status"
        );
        let stderr = String::from_utf8_lossy(&strict.stderr);
        assert!(stderr.contains("--strict"), "{stderr}");
    }
    let stats = stepppo(&["replay", path, "--stats", "--json"]);
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(stats["trajectories"], 1);
    // The corrupt frame, the manifest's record count of the segment, the two skipped records.
    assert_eq!(stats["problems"], 4);
}

#[test]
fn replay_of_a_sound_dataset_is_unchanged_by_strict() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let path = dir.path().to_str().unwrap();
    let plain = stepppo(&["replay", path, "--format", "jsonl"]);
    let strict = stepppo(&["replay", path, "--format", "jsonl", "--strict"]);
    assert!(plain.status.success() && strict.status.success());
    assert!(
        plain.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&plain.stderr)
    );
    assert_eq!(plain.stdout, strict.stdout);
}

/// Traj 0 ends after three steps, traj 1 after two; the frame of traj 0's step 1 is damaged.
fn dataset_missing_a_middle_step(dir: &Path) -> Vec<StepRecord> {
    let step = |traj_id, step_index, last: bool| StepRecord {
        traj_id,
        step_index,
        reward: if last { 1.0 } else { 0.0 },
        terminated: last,
        ..records()[0].clone()
    };
    let written = vec![
        step(0, 0, false),
        step(0, 1, false),
        step(0, 2, true),
        step(1, 0, false),
        step(1, 1, true),
    ];
    let mut writer = DatasetWriter::create(dir, WriterOptions::default()).unwrap();
    for r in &written {
        writer.append(r).unwrap();
    }
    writer.seal().unwrap();
    let seg = dir.join("seg-000000.stp");
    let mut bytes = std::fs::read(&seg).unwrap();
    let frames = scan_segment(&bytes).frames;
    let middle = frames[1];
    assert_eq!((middle.layout.traj_id, middle.layout.step_index), (0, 1));
    bytes[middle.offset as usize + 16] ^= 0x01;
    std::fs::write(&seg, bytes).unwrap();
    written
}

#[test]
fn a_trajectory_that_lost_a_middle_step_is_marked_and_left_out_of_stats_and_advantages() {
    let dir = tempfile::tempdir().unwrap();
    let written = dataset_missing_a_middle_step(dir.path());
    let path = dir.path().to_str().unwrap();

    let text = stdout(&stepppo(&["replay", path, "--traj", "0"]));
    assert!(
        text.contains("| 2 steps |") && text.contains("incomplete: step 1 missing"),
        "{text}"
    );
    let jsonl = stdout(&stepppo(&["replay", path, "--format", "jsonl"]));
    let mut read = Vec::new();
    for line in jsonl.lines() {
        let mut row: serde_json::Value = serde_json::from_str(line).unwrap();
        let fields = row.as_object_mut().unwrap();
        let marks = (fields.remove("incomplete"), fields.remove("missing_step"));
        let expected = match row["traj_id"] == 0 {
            true => (Some(true.into()), Some(1.into())),
            false => (None, None),
        };
        assert_eq!(marks, expected, "{line}");
        read.push(serde_json::from_value::<StepRecord>(row).unwrap());
    }
    let kept = [0, 2, 3, 4].map(|i| written[i].clone());
    assert_eq!(read, kept);

    let stats = stepppo(&["replay", path, "--stats", "--json"]);
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(
        (
            &stats["trajectories"],
            &stats["steps"],
            &stats["incomplete_trajectories"]
        ),
        (&1.into(), &2.into(), &1.into()),
        "{stats}"
    );
    assert_eq!(stats["open_trajectories"], 0);
    let table = stdout(&stepppo(&["replay", path, "--stats"]));
    assert!(
        table.contains("incomplete trajectories (a step lost to damage; left out above): 1"),
        "{table}"
    );

    let advantages = stepppo(&["replay", path, "--advantages", "grpo"]);
    assert!(advantages.status.success(), "{advantages:?}");
    let rows: Vec<serde_json::Value> = stdout(&advantages)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r["traj_id"] == 1), "{rows:?}");
    let stderr = String::from_utf8_lossy(&advantages.stderr);
    assert!(
        stderr.contains("1 incomplete trajectories (a step lost to damage) left out")
            && stderr.contains("trajectory 0 step 1"),
        "{stderr}"
    );
    let one = stepppo(&["replay", path, "--advantages", "grpo", "--traj", "0"]);
    let stderr = String::from_utf8_lossy(&one.stderr);
    assert!(
        !one.status.success() && stderr.contains("no trajectory 0 to score"),
        "{stderr}"
    );
}
