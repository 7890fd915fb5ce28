//! Readers of a dataset that another process is still writing: `stepppo replay` (text, JSONL,
//! `--skip-open`, `--stats`, `--advantages`) tells trajectories with no terminal step yet from
//! finished ones. The writer is this test binary run again as a child process
//! ([`writer_process`]): it writes two finished trajectories and the first steps of two more,
//! flushes, and waits until the reader has looked before it finishes them.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use stepppo::store::{DatasetWriter, StepRecord, WriterOptions};

/// Set (to the dataset directory) in the child that plays the writer.
const WRITER_DIR: &str = "STEPPPO_TEST_LIVE_WRITER_DIR";
const READY: &str = "writer.ready";
const GO: &str = "reader.done";

fn step(traj_id: u64, step_index: u32, last: bool) -> StepRecord {
    StepRecord {
        traj_id,
        group_id: traj_id / 2,
        step_index,
        env_tag: "Live".into(),
        obs_ids: vec![1, 2, 3],
        response_ids: vec![4, 5],
        response_logprobs: vec![-0.5, -0.25],
        reward: 1.0,
        terminated: last,
        ..StepRecord::default()
    }
}

/// The child process's part: a no-op unless started by [`start_writer`].
#[test]
fn writer_process() {
    let Some(dir) = std::env::var_os(WRITER_DIR) else {
        return;
    };
    let dir = Path::new(&dir);
    let mut writer = DatasetWriter::create(&dir.join("data"), WriterOptions::default()).unwrap();
    for traj in 0..2 {
        for t in 0..3 {
            writer.append(&step(traj, t, t == 2)).unwrap();
        }
    }
    for traj in 2..4 {
        for t in 0..2 {
            writer.append(&step(traj, t, false)).unwrap();
        }
    }
    writer.flush().unwrap();
    std::fs::write(dir.join(READY), b"").unwrap();
    wait_for(&dir.join(GO));
    for traj in 2..4 {
        writer.append(&step(traj, 2, true)).unwrap();
    }
    writer.seal().unwrap();
}

fn wait_for(path: &Path) {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn start_writer(dir: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "writer_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(WRITER_DIR, dir)
        .stdout(Stdio::null())
        .spawn()
        .expect("the test binary runs as the writer")
}

fn replay(data: &Path, args: &[&str]) -> String {
    let out: Output = Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .arg("replay")
        .arg(data)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "replay {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap() + &String::from_utf8_lossy(&out.stderr)
}

/// `replay --stats --json` as a JSON value.
fn stats_of(data: &Path) -> serde_json::Value {
    let out = replay(data, &["--stats", "--json"]);
    serde_json::from_str(out.lines().next().unwrap()).unwrap()
}

fn lines_of(jsonl: &str) -> Vec<serde_json::Value> {
    jsonl
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn readers_mark_or_skip_the_trajectories_a_live_writer_has_not_finished() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let mut writer = start_writer(root.path());
    wait_for(&root.path().join(READY));

    // While the writer is alive: trajectories 2 and 3 have two steps and no end.
    let rows = lines_of(&replay(&data, &["--format", "jsonl"]));
    assert_eq!(rows.len(), 10);
    for row in &rows {
        let open = row["traj_id"].as_u64().unwrap() >= 2;
        assert_eq!(row.get("open").is_some(), open, "{row}");
        // Every line still parses back into a record.
        serde_json::from_value::<StepRecord>(row.clone()).unwrap();
    }
    let skipped = lines_of(&replay(&data, &["--format", "jsonl", "--skip-open"]));
    assert_eq!(skipped.len(), 6);
    assert!(skipped.iter().all(|r| r["traj_id"].as_u64().unwrap() < 2));
    let text = replay(&data, &[]);
    assert_eq!(
        text.matches("open: no terminal step yet").count(),
        2,
        "{text}"
    );
    let stats = stats_of(&data);
    assert_eq!(stats["trajectories"], 2, "{stats}");
    assert_eq!(stats["steps"], 6, "{stats}");
    assert_eq!(stats["open_trajectories"], 2, "{stats}");
    assert_eq!(stats["steps_per_trajectory"]["max"], 3.0, "{stats}");
    let advantages = replay(&data, &["--advantages", "grpo"]);
    assert_eq!(lines_of(&advantages).len(), 6, "{advantages}");
    assert!(advantages.contains("2 open trajectories"), "{advantages}");

    // Once the writer has finished them, nothing is open.
    std::fs::write(root.path().join(GO), b"").unwrap();
    assert!(writer.wait().unwrap().success());
    let rows = lines_of(&replay(&data, &["--format", "jsonl"]));
    assert_eq!(rows.len(), 12);
    assert!(rows.iter().all(|r| r.get("open").is_none()));
    let stats = stats_of(&data);
    assert_eq!(stats["trajectories"], 4);
    assert_eq!(stats["open_trajectories"], 0);
}
