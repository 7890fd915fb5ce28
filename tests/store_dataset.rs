//! Dataset-level properties of the step store: round trip, linear storage, crash and corruption
//! handling, index lookup, readers over a dataset being appended.

use std::fs;
use std::path::{Path, PathBuf};

use stepppo::store::{
    repair, rewind, verify, Dataset, DatasetWriter, ProblemKind, StepInfo, StepRecord,
    WriterOptions,
};

/// A trajectory in the concatenated layout: `turns` steps, `new_tokens` tokens per obs/response.
fn trajectory(traj_id: u64, group_id: u64, turns: u32, new_tokens: u32) -> Vec<StepRecord> {
    let mut context_len = 0;
    (0..turns)
        .map(|t| {
            let base = (traj_id as u32) * 10_000 + t * 100;
            let record = StepRecord {
                traj_id,
                group_id,
                step_index: t,
                env_tag: ["frozen_lake", "sokoban"][(group_id % 2) as usize].into(),
                seed: 1_000 + group_id,
                policy_version: 3,
                context_len,
                obs_ids: (0..new_tokens).map(|i| base + i).collect(),
                response_ids: (0..new_tokens / 2).map(|i| base + 50 + i).collect(),
                response_logprobs: (0..new_tokens / 2).map(|i| -(i as f32) / 7.0).collect(),
                reward: if t + 1 == turns { 1.0 } else { -0.1 * t as f32 },
                terminated: t + 1 == turns,
                truncated: false,
                state_hash: u64::MAX - (traj_id << 8) - t as u64,
                info: StepInfo {
                    success: t + 1 == turns,
                    action_is_valid: t % 2 == 0,
                    action_is_effective: t % 3 == 0,
                    format_penalty: -0.05 * (t % 2) as f32,
                    num_actions: t + 1,
                    observation_text: format!("state of {traj_id} at turn {t}\n_P_G ✓"),
                    action_text: format!("<answer>Right || Down {t}</answer>"),
                },
            };
            context_len += new_tokens + new_tokens / 2;
            record
        })
        .collect()
}

fn sample_records() -> Vec<StepRecord> {
    let mut records = Vec::new();
    for group in 0..3u64 {
        for member in 0..2u64 {
            records.extend(trajectory(group * 2 + member, group, 2 + member as u32, 12));
        }
    }
    records
}

fn write(dir: &Path, records: &[StepRecord], roll_bytes: u64) {
    let opts = WriterOptions {
        roll_bytes,
        ..WriterOptions::default()
    };
    let mut writer = DatasetWriter::create(dir, opts).unwrap();
    records.iter().for_each(|r| {
        writer.append(r).unwrap();
    });
    writer.seal().unwrap();
}

/// Writes records, flushes, and leaves the active segment unsealed, as a killed process would.
fn write_killed(dir: &Path, records: &[StepRecord]) {
    let mut writer = DatasetWriter::create(dir, WriterOptions::default()).unwrap();
    records.iter().for_each(|r| {
        writer.append(r).unwrap();
    });
    writer.flush().unwrap();
    std::mem::forget(writer);
}

fn read_all(dir: &Path) -> Vec<StepRecord> {
    let dataset = Dataset::open(dir).unwrap();
    dataset.records().map(|v| v.to_record().unwrap()).collect()
}

fn only_segment(dir: &Path) -> PathBuf {
    let mut segs: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "stp"))
        .collect();
    assert_eq!(segs.len(), 1);
    segs.pop().unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn every_field_round_trips_across_rolled_segments() {
    let dir = tempfile::tempdir().unwrap();
    let records = sample_records();
    write(dir.path(), &records, 600);
    let dataset = Dataset::open(dir.path()).unwrap();
    assert!(
        dataset.segments().count() > 3,
        "small roll size rolls segments"
    );
    assert!(dataset.problems().is_empty(), "{:?}", dataset.problems());
    assert_eq!(read_all(dir.path()), records);
    let trajectories = dataset.trajectories();
    assert_eq!(trajectories.len(), 6);
    for traj in &trajectories {
        let expected: Vec<_> = records
            .iter()
            .filter(|r| r.traj_id == traj.traj_id)
            .collect();
        let got: Vec<_> = traj.steps.iter().map(|s| s.to_record().unwrap()).collect();
        assert_eq!(got.iter().collect::<Vec<_>>(), expected);
    }
    let groups = dataset.groups();
    assert_eq!(groups.len(), 3);
    assert!(groups.iter().all(|g| g.trajectories.len() == 2));
    assert!(verify(dir.path()).unwrap().is_sound());
}

#[test]
fn full_context_is_rebuilt_from_the_trajectory_and_storage_is_linear() {
    let mut bytes_per_turns = Vec::new();
    for turns in [4u32, 8, 16, 32] {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &trajectory(1, 0, turns, 64), u64::MAX);
        bytes_per_turns.push(fs::metadata(only_segment(dir.path())).unwrap().len() as f64);
        let dataset = Dataset::open(dir.path()).unwrap();
        let traj = dataset.trajectory(1).unwrap();
        for (t, step) in traj.steps.iter().enumerate() {
            let context = traj.context(t);
            assert_eq!(
                context.len(),
                step.context_len as usize + step.obs_ids.len()
            );
            assert_eq!(step.obs_ids, context[step.context_len as usize..]);
        }
    }
    // Doubling the turns doubles the bytes (up to the fixed header/footer), never quadruples them.
    for pair in bytes_per_turns.windows(2) {
        let ratio = pair[1] / pair[0];
        assert!((1.8..2.1).contains(&ratio), "bytes {bytes_per_turns:?}");
    }
}

#[test]
fn index_lookup_equals_scan_in_sealed_and_unsealed_segments() {
    let dir = tempfile::tempdir().unwrap();
    let records = sample_records();
    let opts = WriterOptions {
        roll_bytes: 700,
        ..WriterOptions::default()
    };
    let mut writer = DatasetWriter::create(dir.path(), opts).unwrap();
    records.iter().for_each(|r| {
        writer.append(r).unwrap();
    });
    writer.flush().unwrap();
    let dataset = Dataset::open(dir.path()).unwrap();
    let sealed = dataset
        .segments()
        .filter(|s| s.scan.footer.is_some())
        .count();
    assert!(sealed >= 2 && sealed < dataset.segments().count());
    for traj in dataset.trajectories() {
        let found = dataset.trajectory(traj.traj_id).unwrap();
        let ids = |t: &stepppo::store::Trajectory| -> Vec<StepRecord> {
            t.steps.iter().map(|s| s.to_record().unwrap()).collect()
        };
        assert_eq!(ids(&found), ids(&traj));
    }
    assert!(dataset.trajectory(999).is_none());
    drop(dataset);
    writer.seal().unwrap();
}

#[test]
fn kill_mid_write_at_every_byte_of_the_last_record_is_reported_and_repaired() {
    let records = sample_records();
    let whole = tempfile::tempdir().unwrap();
    write_killed(whole.path(), &records);
    let seg = only_segment(whole.path());
    let full_len = fs::metadata(&seg).unwrap().len();
    let last_start = Dataset::open(whole.path())
        .unwrap()
        .segments()
        .flat_map(|s| s.scan.frames.clone())
        .last()
        .unwrap()
        .offset;
    for cut in last_start..full_len {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(whole.path(), dir.path());
        let seg = only_segment(dir.path());
        fs::OpenOptions::new()
            .write(true)
            .open(&seg)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let report = verify(dir.path()).unwrap();
        if cut == last_start {
            assert!(
                report.is_sound(),
                "cut at a frame boundary: {:?}",
                report.problems
            );
        } else {
            assert_eq!(report.problems.len(), 1, "cut {cut}: {:?}", report.problems);
            let problem = &report.problems[0];
            assert_eq!((&problem.path, problem.offset), (&seg, last_start));
            assert_eq!(problem.kind, ProblemKind::TornTail);
        }
        assert_eq!(read_all(dir.path()), records[..records.len() - 1]);
        repair(dir.path()).unwrap();
        assert!(verify(dir.path()).unwrap().is_sound());
        assert_eq!(read_all(dir.path()), records[..records.len() - 1]);
        // The repaired dataset takes appends again.
        let mut writer = DatasetWriter::open_append(dir.path(), WriterOptions::default()).unwrap();
        writer.append(&records[records.len() - 1]).unwrap();
        writer.seal().unwrap();
        assert_eq!(read_all(dir.path()), records);
    }
}

#[test]
fn torn_footer_of_a_sealed_segment_keeps_every_record() {
    let records = sample_records();
    let whole = tempfile::tempdir().unwrap();
    write(whole.path(), &records, u64::MAX);
    let seg = only_segment(whole.path());
    let full_len = fs::metadata(&seg).unwrap().len();
    let frames_end = Dataset::open(whole.path())
        .unwrap()
        .segments()
        .next()
        .unwrap()
        .scan
        .frames
        .last()
        .unwrap()
        .end();
    for cut in frames_end + 1..full_len {
        let dir = tempfile::tempdir().unwrap();
        copy_dir(whole.path(), dir.path());
        let seg = only_segment(dir.path());
        fs::OpenOptions::new()
            .write(true)
            .open(&seg)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let report = verify(dir.path()).unwrap();
        assert!(
            report
                .problems
                .iter()
                .any(|p| p.path == seg && p.offset == frames_end),
            "{:?}",
            report.problems
        );
        assert_eq!(read_all(dir.path()), records);
        repair(dir.path()).unwrap();
        assert!(verify(dir.path()).unwrap().is_sound());
        assert_eq!(read_all(dir.path()), records);
    }
}

#[test]
fn a_flipped_byte_anywhere_in_a_record_is_detected_and_hides_nothing_else() {
    let records = sample_records();
    let whole = tempfile::tempdir().unwrap();
    write(whole.path(), &records, u64::MAX);
    let seg = only_segment(whole.path());
    let frames = Dataset::open(whole.path())
        .unwrap()
        .segments()
        .next()
        .unwrap()
        .scan
        .frames
        .clone();
    let victim = 5;
    let expected: Vec<_> = records
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != victim)
        .map(|(_, r)| r.clone())
        .collect();
    let original = fs::read(&seg).unwrap();
    let dir = tempfile::tempdir().unwrap();
    copy_dir(whole.path(), dir.path());
    let target = only_segment(dir.path());
    for at in frames[victim].offset..frames[victim].end() {
        let mut bytes = original.clone();
        bytes[at as usize] ^= 0x5A;
        fs::write(&target, &bytes).unwrap();
        let report = verify(dir.path()).unwrap();
        let at_victim =
            |p: &&stepppo::store::Problem| p.path == target && p.offset == frames[victim].offset;
        assert!(
            report.problems.iter().any(|p| at_victim(&p)),
            "byte {at}: {:?}",
            report.problems
        );
        assert_eq!(read_all(dir.path()), expected, "byte {at}");
    }
    repair(dir.path()).unwrap();
    assert!(verify(dir.path()).unwrap().is_sound());
    assert_eq!(read_all(dir.path()), expected);
}

#[test]
fn readers_see_only_complete_records_while_a_writer_appends() {
    let records = sample_records();
    let dir = tempfile::tempdir().unwrap();
    let mut writer = DatasetWriter::create(dir.path(), WriterOptions::default()).unwrap();
    for (i, record) in records.iter().enumerate() {
        writer.append(record).unwrap();
        writer.flush().unwrap();
        assert_eq!(read_all(dir.path()), records[..=i]);
    }
    let dataset = Dataset::open(dir.path()).unwrap();
    assert!(dataset.problems().is_empty(), "{:?}", dataset.problems());
    drop(dataset);
    writer.seal().unwrap();
    assert_eq!(read_all(dir.path()), records);
}

#[test]
fn open_append_refuses_a_damaged_dataset_and_create_refuses_an_existing_one() {
    let dir = tempfile::tempdir().unwrap();
    write_killed(dir.path(), &sample_records());
    let seg = only_segment(dir.path());
    let len = fs::metadata(&seg).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&seg)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    let err = DatasetWriter::open_append(dir.path(), WriterOptions::default()).unwrap_err();
    assert!(err.to_string().contains("torn tail"), "{err}");
    assert!(DatasetWriter::create(dir.path(), WriterOptions::default()).is_err());
}

#[test]
fn verify_reports_repeated_keys_and_repair_keeps_the_first_of_each() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let records = sample_records();
    // The last two trajectories written again, as a resume without a rewind would; the small
    // roll size puts the copies in later segments than the originals.
    let tail: Vec<StepRecord> = records.iter().filter(|r| r.traj_id >= 4).cloned().collect();
    let all: Vec<StepRecord> = records.iter().chain(&tail).cloned().collect();
    write(&data, &all, 600);

    let report = verify(&data).unwrap();
    let repeated: Vec<_> = report
        .problems
        .iter()
        .filter_map(|p| match &p.kind {
            ProblemKind::DuplicateKey {
                traj_id,
                step_index,
                first_offset,
                ..
            } => Some((*traj_id, *step_index, p.offset > 0, *first_offset > 0)),
            _ => None,
        })
        .collect();
    assert_eq!(repeated.len(), tail.len(), "{:?}", report.problems);
    assert_eq!(report.problems.len(), tail.len(), "{:?}", report.problems);
    let shown = report.problems[0].to_string();
    assert!(shown.contains("repeats the one at"), "{shown}");

    let fixed = repair(&data).unwrap();
    assert!(
        fixed
            .actions
            .iter()
            .any(|a| a.contains("repeating an earlier key removed")),
        "{:?}",
        fixed.actions
    );
    assert!(verify(&data).unwrap().is_sound());
    assert_eq!(read_all(&data), records);
}

#[test]
fn rewind_cuts_a_dataset_back_to_a_recorded_position_across_rolls_and_seals() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let records = sample_records();
    let (before, after) = records.split_at(7);
    let opts = || WriterOptions {
        roll_bytes: 600,
        ..WriterOptions::default()
    };
    let mut writer = DatasetWriter::create(&data, opts()).unwrap();
    for r in before {
        writer.append(r).unwrap();
    }
    let position = writer.position().unwrap();
    assert_eq!(position.records(), before.len() as u64);
    // Later records roll into new segments and the segment active at the position is sealed.
    for r in after {
        writer.append(r).unwrap();
    }
    writer.seal().unwrap();
    let grown = Dataset::open(&data).unwrap();
    assert!(grown.segments().count() > position.segments.len());
    assert!(grown.len() > before.len());

    let removed = rewind(&data, &position).unwrap();
    assert_eq!(removed, after.len() as u64);
    // A reader that had the dataset mapped still reads what it mapped (no fault on cut bytes).
    let still: Vec<StepRecord> = grown.records().map(|v| v.to_record().unwrap()).collect();
    assert_eq!(still, records);
    drop(grown);
    assert!(verify(&data).unwrap().is_sound());
    assert_eq!(read_all(&data), before);
    // Rewinding again changes nothing; appending continues where the position was.
    assert_eq!(rewind(&data, &position).unwrap(), 0);
    let mut writer = DatasetWriter::open_append(&data, opts()).unwrap();
    for r in after {
        writer.append(r).unwrap();
    }
    writer.seal().unwrap();
    assert_eq!(read_all(&data), records);

    // A dataset shorter than the position lost records the position counts: an error naming it.
    let seg = data.join(&position.segments.last().unwrap().file);
    fs::OpenOptions::new()
        .write(true)
        .open(&seg)
        .unwrap()
        .set_len(20)
        .unwrap();
    let err = rewind(&data, &position).unwrap_err().to_string();
    assert!(
        err.contains("fewer than") || err.contains("was sealed"),
        "{err}"
    );
}
