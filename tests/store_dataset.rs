//! Dataset-level properties of the step store: round trip, linear storage, crash and corruption
//! handling, index lookup, readers over a dataset being appended, rewind, and the shards of
//! data-parallel ranks writing one dataset.

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use stepppo::env::StepInfo;
use stepppo::store::{
    repair, rewind, verify, Dataset, DatasetPosition, DatasetWriter, Manifest, ProblemKind,
    SegmentEntry, StepRecord, WriterOptions,
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
                    tool_call_error: t % 4 == 1,
                    context_rebuilt: false,
                },
                critic_state: (0..(group_id % 3) as usize)
                    .map(|i| i as f32 - 0.5)
                    .collect(),
                admissible_actions: (0..t % 3).map(|i| format!("go {i} ✓ {traj_id}")).collect(),
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

/// Options of the writer of `shard` (`None`: the lead) rolling at 600 bytes.
fn ranked(shard: Option<u32>) -> WriterOptions {
    WriterOptions {
        roll_bytes: 600,
        shard,
        ..WriterOptions::default()
    }
}

/// Rank `rank`'s share of `groups` in a world of 3: trajectory `3g + rank` of each group `g`, so
/// every group has one trajectory in each rank's files.
fn rank_records(rank: u64, groups: Range<u64>) -> Vec<StepRecord> {
    groups
        .flat_map(|g| trajectory(3 * g + rank, g, 2 + ((g + rank) % 3) as u32, 12))
        .collect()
}

fn append_all(writer: &mut DatasetWriter, records: &[StepRecord]) {
    for record in records {
        writer.append(record).unwrap();
    }
}

/// Records ordered by (traj_id, step_index): the order of no one file.
fn by_key(mut records: Vec<StepRecord>) -> Vec<StepRecord> {
    records.sort_by_key(|r| (r.traj_id, r.step_index));
    records
}

/// One training step of a world of 3: every rank appends its share of `groups` (added to
/// `all`), and the lead records the shard writers' positions.
fn ranks_step(
    lead: &mut DatasetWriter,
    shards: &mut [DatasetWriter],
    groups: Range<u64>,
    all: &mut Vec<StepRecord>,
) {
    let own = rank_records(0, groups.clone());
    append_all(lead, &own);
    all.extend(own);
    let mut reported = Vec::new();
    for (rank, shard) in (1..).zip(shards.iter_mut()) {
        let records = rank_records(rank, groups.clone());
        append_all(shard, &records);
        all.extend(records);
        reported.extend(shard.position().unwrap().segments);
    }
    lead.record_shards(reported).unwrap();
}

/// The lead writer and the writers of shards 1 and 2 of a new dataset in `dir`.
fn ranks(dir: &Path) -> (DatasetWriter, Vec<DatasetWriter>) {
    let lead = DatasetWriter::create(dir, ranked(None)).unwrap();
    let shards = (1..=2)
        .map(|r| DatasetWriter::create(dir, ranked(Some(r))).unwrap())
        .collect();
    (lead, shards)
}

fn file_names(segments: &[SegmentEntry]) -> Vec<&str> {
    segments.iter().map(|e| e.file.as_str()).collect()
}

#[test]
fn a_lead_and_two_shard_writers_write_one_dataset_that_reads_as_one() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let (mut lead, mut shards) = ranks(&data);
    let mut all = Vec::new();
    for step in 0..2 {
        ranks_step(&mut lead, &mut shards, step * 3..step * 3 + 3, &mut all);
    }
    let position = lead.position().unwrap();
    assert_eq!(position.records(), all.len() as u64);
    let files = file_names(&position.segments);
    for name in [
        "seg-000000.stp",
        "seg-r0001-000001.stp",
        "seg-r0002-000001.stp",
    ] {
        assert!(files.contains(&name), "{files:?}");
    }
    // Shards seal on drop after the lead last recorded them: listed unsealed, which is no problem.
    drop(shards);
    lead.seal().unwrap();

    let dataset = Dataset::open(&data).unwrap();
    assert!(dataset.problems().is_empty(), "{:?}", dataset.problems());
    let read: Vec<StepRecord> = dataset.records().map(|v| v.to_record().unwrap()).collect();
    assert_eq!(by_key(read), by_key(all.clone()));
    let on_disk: Vec<String> = dataset
        .segments()
        .map(|s| s.path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(on_disk, file_names(&dataset.manifest().segments));
    assert_eq!(on_disk.len(), files.len());
    assert!(on_disk[0].starts_with("seg-0") && on_disk.last().unwrap().starts_with("seg-r0002-"));
    // Each group has a trajectory in every rank's files, each trajectory whole.
    let groups = dataset.groups();
    assert_eq!(groups.len(), 6);
    for group in &groups {
        let ranks: Vec<u64> = group.trajectories.iter().map(|t| t.traj_id % 3).collect();
        assert_eq!(ranks, [0, 1, 2], "group {}", group.group_id);
        for traj in &group.trajectories {
            let expected = all.iter().filter(|r| r.traj_id == traj.traj_id).count();
            assert_eq!(traj.steps.len(), expected);
            assert_eq!(traj.missing_step(), None);
            assert!(!traj.is_open().unwrap());
            let found = dataset.trajectory(traj.traj_id).unwrap();
            assert_eq!(found.steps.len(), expected);
        }
    }
    drop(dataset);
    let report = verify(&data).unwrap();
    assert!(report.is_sound(), "{:?}", report.problems);
    assert_eq!((report.segments, report.records), (files.len(), all.len()));
}

#[test]
fn rewind_brings_every_shard_back_to_the_lead_position_and_every_rank_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let (mut lead, mut shards) = ranks(&data);
    let mut before = Vec::new();
    ranks_step(&mut lead, &mut shards, 0..3, &mut before);
    let position = lead.position().unwrap();
    assert_eq!(position.records(), before.len() as u64);
    // Later steps roll every rank into new segments; shard 2 writes past the last record too.
    let mut after = Vec::new();
    ranks_step(&mut lead, &mut shards, 3..7, &mut after);
    let unrecorded = rank_records(2, 7..9);
    append_all(&mut shards[1], &unrecorded);
    after.extend(unrecorded);
    drop(shards);
    lead.seal().unwrap();
    assert_eq!(
        Dataset::open(&data).unwrap().len(),
        before.len() + after.len()
    );

    assert_eq!(rewind(&data, &position).unwrap(), after.len() as u64);
    assert!(verify(&data).unwrap().is_sound());
    assert_eq!(by_key(read_all(&data)), by_key(before.clone()));
    let manifest = Manifest::read(&data).unwrap();
    assert_eq!(
        file_names(&manifest.segments),
        file_names(&position.segments)
    );
    assert_eq!(rewind(&data, &position).unwrap(), 0);

    // Every rank resumes where the position left it, a shard in its own last segment.
    let mut lead = DatasetWriter::open_append(&data, ranked(None)).unwrap();
    assert_eq!(lead.position().unwrap(), position);
    let mut reported = Vec::new();
    for rank in 1..=2 {
        let opts = WriterOptions {
            shard: Some(rank),
            ..WriterOptions::default()
        };
        let mut shard = DatasetWriter::open_append(&data, opts).unwrap();
        let last = shard.position().unwrap().segments.pop().unwrap();
        assert!(!last.sealed && last.file.starts_with(&format!("seg-r{rank:04}-")));
        let at = shard.append(&rank_records(rank.into(), 3..4)[0]).unwrap();
        assert_eq!(at.shard, Some(rank));
        assert_eq!(format!("seg-r{rank:04}-{:06}.stp", at.segment), last.file);
        reported.extend(shard.position().unwrap().segments);
    }
    lead.record_shards(reported).unwrap();
    lead.seal().unwrap();
    assert!(verify(&data).unwrap().is_sound());
    assert_eq!(Dataset::open(&data).unwrap().len(), before.len() + 2);
}

#[test]
fn a_shard_writer_creates_beside_the_lead_refuses_its_own_segments_and_keeps_its_numbering() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d");
    let mut lead = DatasetWriter::create(&data, ranked(None)).unwrap();
    append_all(&mut lead, &rank_records(0, 0..3));
    let mut shard = DatasetWriter::create(&data, ranked(Some(1))).unwrap();
    let ones = rank_records(1, 0..3);
    append_all(&mut shard, &ones);
    let reported = shard.position().unwrap();
    drop(shard);
    let (last, count) = (
        reported.segments.last().unwrap().clone(),
        reported.segments.len(),
    );
    assert!(count > 1 && last.file == format!("seg-r0001-{:06}.stp", count - 1));

    let err = DatasetWriter::create(&data, ranked(Some(1))).unwrap_err();
    assert!(
        err.to_string()
            .contains("already holds shard 1's segments (seg-r0001-000000.stp)"),
        "{err}"
    );
    let err = DatasetWriter::create(&data, ranked(None)).unwrap_err();
    assert!(err.to_string().contains("already holds a dataset"), "{err}");
    // Its segments are not listed yet: the shard refuses to append until the lead records them.
    let err = DatasetWriter::open_append(&data, ranked(Some(1))).unwrap_err();
    assert!(
        err.to_string().contains("does not list seg-r0001-"),
        "{err}"
    );
    lead.record_shards(reported.segments).unwrap();

    // Sealed on drop, so the next record starts the shard's next segment.
    let mut shard = DatasetWriter::open_append(&data, ranked(Some(1))).unwrap();
    let at = shard.append(&rank_records(1, 3..4)[0]).unwrap();
    assert_eq!((at.shard, at.segment), (Some(1), count as u64));
    // A killed shard writer's unsealed segment is resumed.
    let mut other = DatasetWriter::create(&data, ranked(Some(2))).unwrap();
    other.append(&rank_records(2, 0..1)[0]).unwrap();
    let mut reported = shard.position().unwrap().segments;
    reported.extend(other.position().unwrap().segments);
    std::mem::forget(other);
    lead.record_shards(reported).unwrap();
    let mut other = DatasetWriter::open_append(&data, ranked(Some(2))).unwrap();
    let at = other.append(&rank_records(2, 1..2)[0]).unwrap();
    assert_eq!((at.shard, at.segment), (Some(2), 0));
    let resumed = other.position().unwrap();
    assert_eq!(resumed.segments.len(), 1);
    assert_eq!(resumed.records(), 2);

    // Recording shards is the lead's, and only shard segments are recorded.
    let err = other.record_shards(resumed.segments.clone()).unwrap_err();
    assert!(
        err.to_string().contains("shard 2 cannot record shards"),
        "{err}"
    );
    let mut lead_entry = resumed.segments[0].clone();
    lead_entry.file = "seg-000003.stp".into();
    let err = lead.record_shards(vec![lead_entry]).unwrap_err();
    assert!(
        err.to_string()
            .contains("seg-000003.stp: is not a shard's segment"),
        "{err}"
    );
    let twice = [resumed.segments.clone(), resumed.segments.clone()].concat();
    let err = lead.record_shards(twice).unwrap_err();
    assert!(err.to_string().contains("listed twice"), "{err}");
    lead.record_shards(resumed.segments).unwrap();
    // A rank that has written nothing yet (a world grown on resume) opens to append as well.
    let mut newcomer = DatasetWriter::open_append(&data, ranked(Some(7))).unwrap();
    assert!(newcomer.position().unwrap().segments.is_empty());
    let at = newcomer.append(&rank_records(1, 4..5)[0]).unwrap();
    assert_eq!((at.shard, at.segment), (Some(7), 0));
    lead.record_shards(newcomer.position().unwrap().segments)
        .unwrap();
    drop((shard, other, newcomer));
    lead.seal().unwrap();
    let report = verify(&data).unwrap();
    assert!(report.is_sound(), "{:?}", report.problems);
}

/// A position of a dataset can be stored and read back (a checkpoint's `run_position.json`).
#[test]
fn a_position_with_shard_segments_round_trips_through_json() {
    let dir = tempfile::tempdir().unwrap();
    let (mut lead, mut shards) = ranks(dir.path());
    ranks_step(&mut lead, &mut shards, 0..2, &mut Vec::new());
    let position = lead.position().unwrap();
    let text = serde_json::to_string(&position).unwrap();
    assert_eq!(
        serde_json::from_str::<DatasetPosition>(&text).unwrap(),
        position
    );
}
