//! Damage stays local: a damaged or missing manifest, a lost footer, and records whose text
//! references point at a damaged frame cost only what they hold.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use stepppo::env::StepInfo;
use stepppo::store::{
    repair, scan_segment, verify, Dataset, DatasetWriter, Manifest, ProblemKind, SegmentEntry,
    StepRecord, WriterOptions, FORMAT_VERSION, MANIFEST_FILE,
};

/// `count` one-step trajectories; records of even traj_id share one observation text.
fn records(count: u64) -> Vec<StepRecord> {
    (0..count)
        .map(|i| StepRecord {
            traj_id: i,
            step_index: 0,
            env_tag: "sokoban".into(),
            obs_ids: vec![i as u32; 6],
            response_ids: vec![3, 4],
            response_logprobs: vec![-0.5, -0.25],
            terminated: true,
            info: StepInfo {
                observation_text: match i % 2 {
                    0 => "#####\n#P.X#\n#####".into(),
                    _ => format!("board {i}"),
                },
                action_text: format!("<answer>Left</answer> {i}"),
                ..StepInfo::default()
            },
            ..StepRecord::default()
        })
        .collect()
}

fn metadata() -> BTreeMap<String, serde_json::Value> {
    [
        ("agent", serde_json::json!("random")),
        (
            "collect",
            serde_json::json!({"env": "sokoban", "episodes": 9}),
        ),
        ("seed", serde_json::json!(5)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// A sealed dataset of `records` (two segments) with [`metadata`].
fn write(dir: &Path, records: &[StepRecord]) {
    let opts = WriterOptions {
        roll_bytes: 600,
        metadata: metadata(),
        ..WriterOptions::default()
    };
    let mut writer = DatasetWriter::create(dir, opts).unwrap();
    for record in records {
        writer.append(record).unwrap();
    }
    writer.seal().unwrap();
}

fn read_all(dir: &Path) -> Vec<StepRecord> {
    let dataset = Dataset::open(dir).unwrap();
    dataset.records().map(|v| v.to_record().unwrap()).collect()
}

fn manifest_problems(dataset: &Dataset) -> Vec<String> {
    (dataset.problems().iter())
        .filter(|p| matches!(p.kind, ProblemKind::Manifest(_)))
        .map(|p| p.to_string())
        .collect()
}

#[test]
fn every_flipped_manifest_byte_is_reported_and_the_dataset_opens_from_its_segments() {
    let written = records(9);
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &written);
    let manifest_path = dir.path().join(MANIFEST_FILE);
    let original = fs::read(&manifest_path).unwrap();
    let sound = Dataset::open(dir.path()).unwrap();
    assert!(sound.problems().is_empty(), "{:?}", sound.problems());
    let segments: Vec<SegmentEntry> = sound.manifest().segments.clone();
    assert!(segments.len() >= 2);
    drop(sound);
    for at in 0..original.len() {
        let mut bytes = original.clone();
        bytes[at] ^= 0x04;
        fs::write(&manifest_path, &bytes).unwrap();
        let dataset = Dataset::open(dir.path()).unwrap();
        let reported = manifest_problems(&dataset);
        assert_eq!(reported.len(), 1, "byte {at}: {reported:?}");
        assert!(reported[0].contains("manifest.json"), "{reported:?}");
        assert_eq!(dataset.manifest().segments, segments, "byte {at}");
        let read: Vec<StepRecord> = dataset.records().map(|v| v.to_record().unwrap()).collect();
        assert_eq!(read, written, "byte {at}");
    }
}

#[test]
fn a_missing_manifest_is_rebuilt_from_the_segments_and_an_old_one_without_checksum_opens() {
    let written = records(9);
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &written);
    let manifest = Manifest::read(dir.path()).unwrap();
    fs::remove_file(dir.path().join(MANIFEST_FILE)).unwrap();
    let dataset = Dataset::open(dir.path()).unwrap();
    let reported = manifest_problems(&dataset);
    assert!(reported[0].contains("is missing"), "{reported:?}");
    assert_eq!(dataset.manifest().segments, manifest.segments);
    drop(dataset);
    assert_eq!(read_all(dir.path()), written);
    repair(dir.path()).unwrap();
    assert!(verify(dir.path()).unwrap().is_sound());

    let old = serde_json::to_string_pretty(&manifest).unwrap();
    fs::write(dir.path().join(MANIFEST_FILE), old).unwrap();
    let reopened = Dataset::open(dir.path()).unwrap();
    assert!(reopened.problems().is_empty(), "{:?}", reopened.problems());
    assert_eq!(reopened.manifest(), &manifest);

    let empty = tempfile::tempdir().unwrap();
    let err = Dataset::open(empty.path()).unwrap_err().to_string();
    assert!(err.contains("not a dataset"), "{err}");
}

#[test]
fn repair_keeps_the_metadata_of_a_manifest_that_parses_and_recovers_what_it_can_otherwise() {
    let written = records(9);
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &written);
    let manifest_path = dir.path().join(MANIFEST_FILE);
    let text = fs::read_to_string(&manifest_path).unwrap();

    // Parses, fails its checksum: every entry is kept.
    let checksum_digit = text.find("crc32:").unwrap() + 6;
    let mut bytes = text.clone().into_bytes();
    bytes[checksum_digit] = if bytes[checksum_digit] == b'0' {
        b'1'
    } else {
        b'0'
    };
    fs::write(&manifest_path, &bytes).unwrap();
    assert!(!verify(dir.path()).unwrap().is_sound());
    repair(dir.path()).unwrap();
    assert!(verify(dir.path()).unwrap().is_sound());
    assert_eq!(Manifest::read(dir.path()).unwrap().metadata, metadata());

    // Does not parse: the damaged entry is lost, the others and the segment list are kept.
    let at = text.find("\"episodes\"").unwrap();
    let mut bytes = text.into_bytes();
    bytes[at + 2] = b'"';
    fs::write(&manifest_path, &bytes).unwrap();
    let report = repair(dir.path()).unwrap();
    assert!(
        report
            .actions
            .iter()
            .any(|a| a.contains("2 metadata entries kept")),
        "{:?}",
        report.actions
    );
    assert!(verify(dir.path()).unwrap().is_sound());
    let repaired = Manifest::read(dir.path()).unwrap();
    let keys: Vec<&str> = repaired.metadata.keys().map(String::as_str).collect();
    assert_eq!(keys, ["agent", "seed"]);
    assert!(repaired.segments.len() >= 2 && repaired.segments.iter().all(|s| s.sealed));
    assert_eq!(read_all(dir.path()), written);
}

#[test]
fn a_sealed_segment_cut_at_its_seal_offset_fails_verify_and_repair_seals_it_again() {
    let written = records(9);
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &written);
    let seg = dir.path().join("seg-000000.stp");
    let bytes = fs::read(&seg).unwrap();
    let seal = scan_segment(&bytes).footer.unwrap().seal_offset;
    fs::write(&seg, &bytes[..seal as usize]).unwrap();

    let report = verify(dir.path()).unwrap();
    let lost: Vec<_> = (report.problems.iter())
        .filter(|p| p.path == seg && p.offset == seal)
        .collect();
    assert_eq!(lost.len(), 1, "{:?}", report.problems);
    assert!(matches!(&lost[0].kind, ProblemKind::BadFooter(why) if why.contains("missing")));
    assert_eq!(read_all(dir.path()), written);

    let actions = repair(dir.path()).unwrap().actions;
    assert!(actions[0].contains("sealed"), "{actions:?}");
    assert_eq!(
        fs::read(&seg).unwrap(),
        bytes,
        "the same footer is written again"
    );
    assert!(verify(dir.path()).unwrap().is_sound());
    assert_eq!(Manifest::read(dir.path()).unwrap().metadata, metadata());
}

#[test]
fn a_sealed_segment_of_another_size_than_listed_fails_verify() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &records(9));
    let mut manifest = Manifest::read(dir.path()).unwrap();
    manifest.segments[0].bytes += 4;
    manifest.write(dir.path()).unwrap();
    let report = verify(dir.path()).unwrap();
    assert!(
        (report.problems.iter()).any(|p| p.to_string().contains("as sealed at")),
        "{:?}",
        report.problems
    );
}

#[test]
fn records_referring_to_a_damaged_frame_are_skipped_and_listed() {
    let written = records(9);
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &written);
    let seg = dir.path().join("seg-000000.stp");
    let mut bytes = fs::read(&seg).unwrap();
    let frames = scan_segment(&bytes).frames;
    bytes[frames[0].offset as usize + 16] ^= 0x01;
    fs::write(&seg, &bytes).unwrap();

    let mut dataset = Dataset::open(dir.path()).unwrap();
    let before = dataset.problems().len();
    let skipped = dataset.skip_undecodable();
    // Every later even record of the segment refers to the damaged frame's observation text.
    let dependents: Vec<(u64, u64)> = (frames.iter().skip(1))
        .filter(|f| f.layout.traj_id % 2 == 0)
        .map(|f| (f.offset, f.layout.traj_id))
        .collect();
    assert!(!dependents.is_empty());
    let offsets: Vec<u64> = skipped.iter().map(|p| p.offset).collect();
    assert_eq!(offsets, dependents.iter().map(|d| d.0).collect::<Vec<_>>());
    assert!(skipped.iter().all(|p| p.path == seg));
    assert_eq!(dataset.problems().len(), before + skipped.len());
    let lost = 1 + dependents.len();
    let read: Vec<StepRecord> = dataset.records().map(|v| v.to_record().unwrap()).collect();
    assert_eq!(read.len(), written.len() - lost);
    assert!(read.iter().all(|r| written.contains(r)));
    assert_eq!(dataset.trajectories().len(), written.len() - lost);
    assert!(dataset.trajectory(dependents[0].1).is_none());
    assert!(dataset.trajectory(1).is_some());
}

#[test]
fn repair_keeps_the_first_record_of_a_key_that_decodes() {
    let mut written = records(3);
    written[1].info.observation_text = written[0].info.observation_text.clone();
    written[2].info.observation_text = "board 2 alone".into();
    let repeat = StepRecord {
        traj_id: 1,
        ..written[2].clone()
    };
    written.push(repeat.clone());
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &written);
    let seg = dir.path().join("seg-000000.stp");
    let mut bytes = fs::read(&seg).unwrap();
    let first = scan_segment(&bytes).frames[0].offset as usize;
    bytes[first + 16] ^= 0x01;
    fs::write(&seg, &bytes).unwrap();
    // Record 1 refers to the damaged record 0: the repeat of its key is the first that decodes.
    let report = verify(dir.path()).unwrap();
    assert!(!(report.problems.iter()).any(|p| matches!(p.kind, ProblemKind::DuplicateKey { .. })));
    repair(dir.path()).unwrap();
    assert!(verify(dir.path()).unwrap().is_sound());
    assert_eq!(read_all(dir.path()), vec![written[2].clone(), repeat]);
}

#[test]
fn repair_lowers_a_manifest_format_version_newer_than_every_segment() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &records(3));
    let mut manifest = Manifest::read(dir.path()).unwrap();
    manifest.format_version += 1;
    manifest.write(dir.path()).unwrap();
    assert!(!verify(dir.path()).unwrap().is_sound());
    repair(dir.path()).unwrap();
    assert!(verify(dir.path()).unwrap().is_sound());
    assert_eq!(Manifest::read(dir.path()).unwrap().metadata, metadata());
}

#[test]
fn a_flipped_version_or_flags_byte_loses_no_record_and_repair_rewrites_the_header() {
    let written = records(9);
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &written);
    let seg = dir.path().join("seg-000000.stp");
    let manifest_path = dir.path().join(MANIFEST_FILE);
    let (original, manifest) = (fs::read(&seg).unwrap(), fs::read(&manifest_path).unwrap());
    for (at, mask, field) in [(8, 0x01, 8), (10, 0x80, 8), (12, 0x01, 12), (15, 0x20, 12)] {
        let mut bytes = original.clone();
        bytes[at] ^= mask;
        fs::write(&seg, &bytes).unwrap();
        assert_eq!(read_all(dir.path()), written, "byte {at}");
        let listed: Vec<String> = (verify(dir.path()).unwrap().problems.iter())
            .map(|p| p.to_string())
            .collect();
        let expected = format!("seg-000000.stp at byte {field}: damaged segment header: ");
        assert_eq!(listed.len(), 1, "byte {at}: {listed:?}");
        assert!(listed[0].contains(&expected), "{listed:?}");
        let actions = repair(dir.path()).unwrap().actions;
        assert!(actions[0].contains("header rewritten"), "{actions:?}");
        assert_eq!(fs::read(&seg).unwrap(), original, "byte {at}");
        assert_eq!(fs::read(&manifest_path).unwrap(), manifest, "byte {at}");
        assert!(verify(dir.path()).unwrap().is_sound());
    }
}

#[test]
fn without_a_listed_version_a_damaged_header_is_read_as_its_records_decode() {
    let written = records(9);
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &written);
    let mut manifest = Manifest::read(dir.path()).unwrap();
    manifest
        .segments
        .iter_mut()
        .for_each(|s| s.format_version = None);
    manifest.write(dir.path()).unwrap();
    let seg = dir.path().join("seg-000001.stp");
    let original = fs::read(&seg).unwrap();
    let mut bytes = original.clone();
    bytes[8] = 1; // the current version reads as 1, a version this build reads
    fs::write(&seg, &bytes).unwrap();
    assert_eq!(read_all(dir.path()), written);
    let problems = verify(dir.path()).unwrap().problems;
    assert_eq!(problems.len(), 1, "{problems:?}");
    let listed = problems[0].to_string();
    assert!(
        listed.contains("seg-000001.stp at byte 8")
            && listed.contains(&format!("records decode as version {FORMAT_VERSION}")),
        "{listed}"
    );
    repair(dir.path()).unwrap();
    assert_eq!(fs::read(&seg).unwrap(), original);
    let versions = Manifest::read(dir.path()).unwrap().segments;
    assert!(
        versions
            .iter()
            .all(|s| s.format_version == Some(FORMAT_VERSION)),
        "{versions:?}"
    );
}

#[test]
fn a_segment_the_manifest_lists_in_a_newer_format_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &records(9));
    let mut manifest = Manifest::read(dir.path()).unwrap();
    let newer = manifest.segments[0].format_version.unwrap() + 1;
    manifest.segments[0].format_version = Some(newer);
    manifest.write(dir.path()).unwrap();
    let seg = dir.path().join("seg-000000.stp");
    let problems = verify(dir.path()).unwrap().problems;
    let refusal = format!(
        "seg-000000.stp at byte 8: bad segment header: format version {newer} is not supported"
    );
    assert!(
        problems.iter().any(|p| p.to_string().contains(&refusal)),
        "{problems:?}"
    );
    let dataset = Dataset::open(dir.path()).unwrap();
    let segments: Vec<_> = dataset.segments().collect();
    assert!(segments[0].path == seg && segments[0].frames().next().is_none());
    assert!(segments[1].frames().next().is_some());
    drop(dataset);
    let before = fs::read(&seg).unwrap();
    let err = repair(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains(&refusal) && err.contains("unknown format"),
        "{err}"
    );
    assert_eq!(fs::read(&seg).unwrap(), before);
}

#[test]
fn a_shard_segment_the_lead_has_not_recorded_is_read_and_repair_lists_it() {
    let dir = tempfile::tempdir().unwrap();
    let written = records(24);
    let (mine, theirs) = written.split_at(8);
    let (recorded, late) = theirs.split_at(6);
    write(dir.path(), mine);
    let mut lead = DatasetWriter::open_append(dir.path(), WriterOptions::default()).unwrap();
    let shard_opts = || WriterOptions {
        roll_bytes: 600,
        shard: Some(3),
        ..WriterOptions::default()
    };
    let mut shard = DatasetWriter::create(dir.path(), shard_opts()).unwrap();
    for record in recorded {
        shard.append(record).unwrap();
    }
    lead.record_shards(shard.position().unwrap().segments)
        .unwrap();
    lead.seal().unwrap();
    // The rank goes on into new segments; the lead never hears of them (a crash, say).
    let mut rolled = None;
    for record in late {
        rolled = Some(shard.append(record).unwrap().segment);
    }
    drop(shard);
    let unlisted = format!("seg-r0003-{:06}.stp", rolled.unwrap());

    let dataset = Dataset::open(dir.path()).unwrap();
    let problems = manifest_problems(&dataset);
    assert!(
        problems
            .iter()
            .any(|p| p.ends_with(&format!("does not list {unlisted}"))),
        "{problems:?}"
    );
    assert_eq!(problems.len(), dataset.problems().len());
    assert!(problems
        .iter()
        .all(|p| p.contains("does not list seg-r0003-")));
    let mut read = read_all(dir.path());
    read.sort_by_key(|r| r.traj_id);
    assert_eq!(read, written);
    drop(dataset);
    // The shard's writer refuses to append to segments the manifest does not list.
    let err = DatasetWriter::open_append(dir.path(), shard_opts()).unwrap_err();
    assert!(
        err.to_string().contains("run `stepppo dataset repair`"),
        "{err}"
    );

    let fixed = repair(dir.path()).unwrap();
    assert!(
        fixed.actions.iter().any(|a| a.contains("rebuilt")),
        "{:?}",
        fixed.actions
    );
    assert!(verify(dir.path()).unwrap().is_sound());
    let manifest = Manifest::read(dir.path()).unwrap();
    assert!(manifest.segments.iter().any(|e| e.file == unlisted));
    assert_eq!(manifest.metadata, metadata());
    // The lead resumes with every shard segment in its position, counted.
    let mut lead = DatasetWriter::open_append(dir.path(), WriterOptions::default()).unwrap();
    assert_eq!(lead.position().unwrap().records(), written.len() as u64);
    let shard = DatasetWriter::open_append(dir.path(), shard_opts()).unwrap();
    drop((lead, shard));
}

#[test]
fn a_shard_segment_shorter_than_the_lead_recorded_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &records(2));
    let mut lead = DatasetWriter::open_append(dir.path(), WriterOptions::default()).unwrap();
    let opts = WriterOptions {
        shard: Some(1),
        ..WriterOptions::default()
    };
    let mut shard = DatasetWriter::create(dir.path(), opts).unwrap();
    for record in &records(6)[2..] {
        shard.append(record).unwrap();
    }
    let position = shard.position().unwrap();
    std::mem::forget(shard);
    lead.record_shards(position.segments.clone()).unwrap();
    lead.seal().unwrap();
    let seg = dir.path().join(&position.segments[0].file);
    let len = fs::metadata(&seg).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&seg)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    let problems = verify(dir.path()).unwrap().problems;
    let shown: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
    let lost = format!(
        "lists seg-r0001-000000.stp at {len} bytes, the file holds {}",
        len - 3
    );
    assert!(shown.iter().any(|p| p.contains(&lost)), "{shown:?}");
    repair(dir.path()).unwrap();
    assert!(verify(dir.path()).unwrap().is_sound());
    assert_eq!(read_all(dir.path()).len(), 5);
}
