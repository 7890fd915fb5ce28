//! The on-disk format stays readable: segments written by format versions 1 to 6 are pinned
//! here byte for byte (records of versions before 5 read with `tool_call_error` and
//! `context_rebuilt` false); arbitrary or mutated bytes never make the reader panic or return a
//! changed record (backward text references included); appending to a dataset whose last segment is an
//! unsealed older-format one seals that segment and continues in a new one.

use proptest::prelude::*;
use stepppo::env::StepInfo;
use stepppo::store::{
    scan_segment, Dataset, DatasetWriter, StepRecord, WriterOptions, FORMAT_VERSION,
};

fn pinned_record() -> StepRecord {
    StepRecord {
        traj_id: 5,
        group_id: 2,
        step_index: 1,
        env_tag: "sokoban".into(),
        seed: 77,
        policy_version: 3,
        context_len: 9,
        obs_ids: vec![10, 11, 151_643],
        response_ids: vec![42, 151_645],
        response_logprobs: vec![-0.5, -2.0],
        reward: -0.1,
        terminated: false,
        truncated: true,
        state_hash: 0x0123_4567_89AB_CDEF,
        info: StepInfo {
            success: false,
            action_is_valid: true,
            action_is_effective: true,
            format_penalty: -0.1,
            num_actions: 2,
            observation_text: "#P_#".into(),
            action_text: "<answer>Up</answer>".into(),
            tool_call_error: false,
            context_rebuilt: false,
        },
        critic_state: Vec::new(),
        admissible_actions: Vec::new(),
    }
}

/// The records of the pinned version-2 segment: the second repeats both texts of the first
/// (stored as references to it).
fn pinned_records_v2() -> Vec<StepRecord> {
    let second = StepRecord {
        traj_id: 6,
        reward: 1.0,
        obs_ids: vec![12],
        ..pinned_record()
    };
    vec![pinned_record(), second]
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    let clean: Vec<u8> = text.bytes().filter(|b| b.is_ascii_hexdigit()).collect();
    clean
        .chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
        .collect()
}

fn written_segment(records: &[StepRecord]) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = stepppo::store::DatasetWriter::create(dir.path(), Default::default()).unwrap();
    for record in records {
        writer.append(record).unwrap();
    }
    writer.seal().unwrap();
    std::fs::read(dir.path().join("seg-000000.stp")).unwrap()
}

/// `seg-000000.stp` holding [`pinned_record`], as written by format version 1.
const V1_SEGMENT: &str = "\
    535450504f53454701000000000000005354504680000000dbce1d1805000000\
    0000000002000000000000000100000009000000030000000200000002000000\
    3a0000000a0000000b0000005b5002002a0000005d500200000000bf000000c0\
    07736f6b6f62616e4d03cdccccbd0001fdefcdab8967452301000101cdccccbd\
    020423505f23133c616e737765723e55703c2f616e737765723e000053545053\
    0100000000000000050000000000000010000000000000003a43062418000000\
    53545045\
";

#[test]
fn version_1_segments_stay_readable_and_are_still_written_identically() {
    check_pinned(V1_SEGMENT, 1, &[pinned_record()]);
}

/// `seg-000000.stp` holding [`pinned_records_v2`], as written by format version 2.
const V2_SEGMENT: &str = "\
    535450504f53454702000000000000005354504680000000fc7c6b6d05000000\
    0000000002000000000000000100000009000000030000000200000002000000\
    3a0000000a0000000b0000005b5002002a0000005d500200000000bf000000c0\
    0823505f23263c616e737765723e55703c2f616e737765723e07736f6b6f6261\
    6e4d03cdccccbd0001fdefcdab8967452301000101cdccccbd02000053545046\
    60000000e83c3fcc060000000000000002000000000000000100000009000000\
    010000000200000002000000230000000c0000002a0000005d500200000000bf\
    000000c0212107736f6b6f62616e4d030000803f0001fdefcdab896745230100\
    0101cdccccbd0200535450530200000000000000050000000000000010000000\
    0000000006000000000000009c0000000000000099b791b82800000053545045\
";

fn read_all(bytes: &[u8]) -> Vec<Result<StepRecord, String>> {
    let scan = scan_segment(bytes);
    let views = scan.frames.iter().map(|f| scan.view(bytes, f));
    views
        .map(|v| v.to_record().map_err(|e| e.to_string()))
        .collect()
}

/// Checks a pinned segment of format `version`: it scans without problems, its records read back
/// as `records`, and while `version` is the current format this build writes the same bytes.
/// Returns the bytes and their scan.
fn check_pinned(
    segment: &str,
    version: u32,
    records: &[StepRecord],
) -> (Vec<u8>, stepppo::store::SegmentScan) {
    let bytes = unhex(segment);
    let scan = scan_segment(&bytes);
    assert!(scan.problems.is_empty(), "{:?}", scan.problems);
    assert_eq!(scan.format_version, version);
    let read: Vec<StepRecord> = read_all(&bytes).into_iter().map(Result::unwrap).collect();
    assert_eq!(read, records);
    if FORMAT_VERSION == version {
        assert_eq!(
            hex(&written_segment(records)),
            hex(&bytes),
            "format {version} changed: bump FORMAT_VERSION and keep reading {version}"
        );
    }
    (bytes, scan)
}

#[test]
fn version_2_segments_stay_readable_and_are_still_written_identically() {
    let (_, scan) = check_pinned(V2_SEGMENT, 2, &pinned_records_v2());
    let frame_bytes: Vec<u64> = scan.frames.iter().map(|f| f.end() - f.offset).collect();
    assert!(
        frame_bytes[1] < frame_bytes[0],
        "texts of the second record are references: {frame_bytes:?}"
    );
}

/// The records of the pinned version-3 segment: those of version 2 (ids 3 bytes and 1 byte wide,
/// texts referenced) and one with 2-byte response ids, a new action text and zero floats.
fn pinned_records_v3() -> Vec<StepRecord> {
    let mut third = StepRecord {
        traj_id: 7,
        obs_ids: vec![7],
        response_ids: vec![300, 65_535],
        response_logprobs: vec![-0.75, f32::from_bits(0x8000_0001)],
        reward: 0.0,
        ..pinned_record()
    };
    third.info.format_penalty = 0.0;
    third.info.action_text = "<answer>Down</answer>".into();
    let mut records = pinned_records_v2();
    records.push(third);
    records
}

/// `seg-000000.stp` holding [`pinned_records_v3`], as written by format version 3.
const V3_SEGMENT: &str = "\
    535450504f534547030000000000000053545046640000004922c14700050201\
    090302020a000000000000bf000000c00a00000b00005b50020000002a00005d\
    50027a0823505f23263c616e737765723e55703c2f616e737765723e07736f6b\
    6f62616e4d00000000000000efcdab89674523010302cdccccbdcdccccbd0000\
    5354504644000000854508cc010602010901020208000000000000bf000000c0\
    0c0000002a00005d50027a030307736f6b6f62616e4d00000000000000efcdab\
    896745230103020000803fcdccccbd00535450465000000002d0634002070201\
    0901020204000000000040bf01000080070000002c01ffff1a052a3c616e7377\
    65723e446f776e3c2f616e737765723e07736f6b6f62616e4d00000000000000\
    efcdab8967452301030200005354505303000000000000000500000000000000\
    1000000000000000060000000000000080000000000000000700000000000000\
    d0000000000000005ea1f4353800000053545045\
";

#[test]
fn version_3_segments_stay_readable_and_are_still_written_identically() {
    let (bytes, scan) = check_pinned(V3_SEGMENT, 3, &pinned_records_v3());
    let widths: Vec<(usize, usize)> = (scan.frames.iter())
        .map(|f| scan.view(&bytes, f))
        .map(|v| (v.obs_ids.width(), v.response_ids.width()))
        .collect();
    assert_eq!(widths, [(3, 3), (1, 3), (1, 2)]);
}

/// The records of the pinned version-4 segment: those of version 3 and one that carries a
/// critic state.
fn pinned_records_v4() -> Vec<StepRecord> {
    let fourth = StepRecord {
        traj_id: 8,
        critic_state: vec![1.0, 0.0, -0.5, f32::from_bits(0x8000_0001)],
        ..pinned_record()
    };
    let mut records = pinned_records_v3();
    records.push(fourth);
    records
}

/// `seg-000000.stp` holding [`pinned_records_v4`], as written by format version 4.
const V4_SEGMENT: &str = "\
    535450504f534547040000000000000053545046640000004922c14700050201\
    090302020a000000000000bf000000c00a00000b00005b50020000002a00005d\
    50027a0823505f23263c616e737765723e55703c2f616e737765723e07736f6b\
    6f62616e4d00000000000000efcdab89674523010302cdccccbdcdccccbd0000\
    5354504644000000854508cc010602010901020208000000000000bf000000c0\
    0c0000002a00005d50027a030307736f6b6f62616e4d00000000000000efcdab\
    896745230103020000803fcdccccbd00535450465000000002d0634002070201\
    0901020204000000000040bf01000080070000002c01ffff1a052a3c616e7377\
    65723e446f776e3c2f616e737765723e07736f6b6f62616e4d00000000000000\
    efcdab896745230103020000535450465c0000009ad0faef0308020109030202\
    0a000000000000bf000000c00a00000b00005b50020000002a00005d5002fa07\
    0707736f6b6f62616e4d00000000000000efcdab89674523010302cdccccbdcd\
    ccccbd040000803f00000000000000bf01000080535450530400000000000000\
    0500000000000000100000000000000006000000000000008000000000000000\
    0700000000000000d00000000000000008000000000000002c01000000000000\
    5bb850964800000053545045\
";

#[test]
fn version_4_segments_stay_readable_and_are_still_written_identically() {
    let (bytes, scan) = check_pinned(V4_SEGMENT, 4, &pinned_records_v4());
    for frame in &scan.frames {
        let meta = scan.view(&bytes, frame).meta_view().unwrap();
        assert!(!meta.tool_call_error && !meta.context_rebuilt);
    }
}

/// The records of the pinned version-5 segment: those of version 4, one whose tool call did
/// not parse and one whose context was rebuilt (both flags set).
fn pinned_records_v5() -> Vec<StepRecord> {
    let mut fifth = StepRecord {
        traj_id: 9,
        ..pinned_record()
    };
    fifth.info.action_is_valid = false;
    fifth.info.tool_call_error = true;
    let mut sixth = StepRecord {
        step_index: 2,
        context_len: 0,
        ..fifth.clone()
    };
    sixth.info.context_rebuilt = true;
    let mut records = pinned_records_v4();
    records.extend([fifth, sixth]);
    records
}

/// `seg-000000.stp` holding [`pinned_records_v5`], as written by format version 5.
const V5_SEGMENT: &str = "\
    535450504f534547050000000000000053545046640000006a277c7000050201\
    090302020a000000000000bf000000c00a00000b00005b50020000002a00005d\
    50027a000823505f23263c616e737765723e55703c2f616e737765723e07736f\
    6b6f62616e4d00000000000000efcdab89674523010302cdccccbdcdccccbd00\
    53545046440000003ee35990010602010901020208000000000000bf000000c0\
    0c0000002a00005d50027a00030307736f6b6f62616e4d00000000000000efcd\
    ab896745230103020000803fcdccccbd5354504650000000f7917dc102070201\
    0901020204000000000040bf01000080070000002c01ffff1a00052a3c616e73\
    7765723e446f776e3c2f616e737765723e07736f6b6f62616e4d000000000000\
    00efcdab89674523010302005354504660000000f6c0f31e0308020109030202\
    0a000000000000bf000000c00a00000b00005b50020000002a00005d5002fa00\
    070707736f6b6f62616e4d00000000000000efcdab89674523010302cdccccbd\
    cdccccbd040000803f00000000000000bf01000080000000535450464c000000\
    67968c1e04090201090302020a000000000000bf000000c00a00000b00005b50\
    020000002a00005d50027201090907736f6b6f62616e4d00000000000000efcd\
    ab89674523010302cdccccbdcdccccbd535450464c0000003cb7a1e205090202\
    000302020a000000000000bf000000c00a00000b00005b50020000002a00005d\
    500272030b0b07736f6b6f62616e4d00000000000000efcdab89674523010302\
    cdccccbdcdccccbd535450530600000000000000050000000000000010000000\
    00000000060000000000000080000000000000000700000000000000d0000000\
    0000000008000000000000002c01000000000000090000000000000098010000\
    000000000900000000000000f001000000000000360d5ebd6800000053545045\
";

#[test]
fn version_5_segments_stay_readable_and_are_still_written_identically() {
    let (bytes, scan) = check_pinned(V5_SEGMENT, 5, &pinned_records_v5());
    let flags: Vec<(bool, bool)> = (scan.frames.iter())
        .map(|f| scan.view(&bytes, f).meta_view().unwrap())
        .map(|m| (m.tool_call_error, m.context_rebuilt))
        .collect();
    let (none, tool, both) = ((false, false), (true, false), (true, true));
    assert_eq!(flags, [none, none, none, none, tool, both]);
}

/// The records of the pinned version-6 segment: those of version 5, then two steps sampled
/// among their state's admissible actions (the same list twice, then another).
fn pinned_records_v6() -> Vec<StepRecord> {
    let actions = |list: &[&str]| list.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let seventh = StepRecord {
        traj_id: 10,
        env_tag: "textworld".into(),
        admissible_actions: actions(&["go east", "open chest", "take key from chest"]),
        ..pinned_record()
    };
    let eighth = StepRecord {
        step_index: 2,
        admissible_actions: actions(&["go west", "unlock door with key"]),
        ..seventh.clone()
    };
    let mut records = pinned_records_v5();
    records.extend([seventh, eighth]);
    records
}

/// `seg-000000.stp` holding [`pinned_records_v6`], as written by format version 6.
const V6_SEGMENT: &str = "\
    535450504f534547060000000000000053545046640000006a277c7000050201\
    090302020a000000000000bf000000c00a00000b00005b50020000002a00005d\
    50027a000823505f23263c616e737765723e55703c2f616e737765723e07736f\
    6b6f62616e4d00000000000000efcdab89674523010302cdccccbdcdccccbd00\
    53545046440000003ee35990010602010901020208000000000000bf000000c0\
    0c0000002a00005d50027a00030307736f6b6f62616e4d00000000000000efcd\
    ab896745230103020000803fcdccccbd5354504650000000f7917dc102070201\
    0901020204000000000040bf01000080070000002c01ffff1a00052a3c616e73\
    7765723e446f776e3c2f616e737765723e07736f6b6f62616e4d000000000000\
    00efcdab89674523010302005354504660000000f6c0f31e0308020109030202\
    0a000000000000bf000000c00a00000b00005b50020000002a00005d5002fa00\
    070707736f6b6f62616e4d00000000000000efcdab89674523010302cdccccbd\
    cdccccbd040000803f00000000000000bf01000080000000535450464c000000\
    67968c1e04090201090302020a000000000000bf000000c00a00000b00005b50\
    020000002a00005d50027201090907736f6b6f62616e4d00000000000000efcd\
    ab89674523010302cdccccbdcdccccbd535450464c0000003cb7a1e205090202\
    000302020a000000000000bf000000c00a00000b00005b50020000002a00005d\
    500272030b0b07736f6b6f62616e4d00000000000000efcdab89674523010302\
    cdccccbdcdccccbd5354504678000000b674d768060a0201090302020a000000\
    000000bf000000c00a00000b00005b50020000002a00005d50027a040d0d0974\
    657874776f726c644d00000000000000efcdab89674523010302cdccccbdcdcc\
    ccbd0307676f20656173740a6f70656e2063686573741374616b65206b657920\
    66726f6d2063686573740000535450466c000000828af329070a020209030202\
    0a000000000000bf000000c00a00000b00005b50020000002a00005d50027a04\
    0f0f0974657874776f726c644d00000000000000efcdab89674523010302cdcc\
    ccbdcdccccbd0207676f207765737414756e6c6f636b20646f6f722077697468\
    206b657953545053080000000000000005000000000000001000000000000000\
    060000000000000080000000000000000700000000000000d000000000000000\
    08000000000000002c0100000000000009000000000000009801000000000000\
    0900000000000000f0010000000000000a000000000000004802000000000000\
    0a00000000000000cc020000000000002a9142e58800000053545045\
";

#[test]
fn version_6_segments_stay_readable_and_are_still_written_identically() {
    let (bytes, scan) = check_pinned(V6_SEGMENT, 6, &pinned_records_v6());
    let lists: Vec<usize> = (scan.frames.iter())
        .map(|f| scan.view(&bytes, f).meta_view().unwrap())
        .map(|m| m.admissible_actions().len())
        .collect();
    assert_eq!(lists, [0, 0, 0, 0, 0, 0, 3, 2]);
}

#[test]
fn appending_after_an_unsealed_version_1_segment_seals_it_and_continues_in_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let sealed_v1 = unhex(V1_SEGMENT);
    let frame_end = scan_segment(&sealed_v1).frames[0].end() as usize;
    std::fs::write(dir.path().join("seg-000000.stp"), &sealed_v1[..frame_end]).unwrap();
    let manifest = serde_json::json!({
        "format_version": 1, "created_by": "stepppo (format 1)", "metadata": {},
        "segments": [{"file": "seg-000000.stp", "sealed": false, "records": 0, "bytes": 0}],
    });
    std::fs::write(dir.path().join("manifest.json"), manifest.to_string()).unwrap();

    let mut writer = DatasetWriter::open_append(dir.path(), WriterOptions::default()).unwrap();
    let appended = StepRecord {
        traj_id: 6,
        ..pinned_record()
    };
    let at = writer.append(&appended).unwrap();
    assert_eq!(
        at.segment, 1,
        "frames of the current version go to a new segment"
    );
    writer.seal().unwrap();

    let old = std::fs::read(dir.path().join("seg-000000.stp")).unwrap();
    let old_scan = scan_segment(&old);
    assert_eq!(old_scan.format_version, 1);
    assert_eq!(
        old_scan.footer.map(|f| f.record_count),
        Some(1),
        "sealed as it was"
    );
    assert_eq!(old[..frame_end], sealed_v1[..frame_end]);
    let dataset = Dataset::open(dir.path()).unwrap();
    assert!(dataset.problems().is_empty(), "{:?}", dataset.problems());
    assert!(dataset.manifest().segments.iter().all(|s| s.sealed));
    let versions: Vec<Option<u32>> = (dataset.manifest().segments.iter())
        .map(|s| s.format_version)
        .collect();
    assert_eq!(
        versions,
        [Some(1), Some(FORMAT_VERSION)],
        "each segment's version listed"
    );
    let read: Vec<StepRecord> = dataset.records().map(|v| v.to_record().unwrap()).collect();
    assert_eq!(read, vec![pinned_record(), appended]);
    assert_eq!(dataset.trajectory(5).unwrap().steps.len(), 1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let scan = scan_segment(&bytes);
        for frame in &scan.frames {
            let _ = scan.view(&bytes, frame).to_record();
        }
    }

    #[test]
    fn mutated_segments_never_panic_or_return_a_changed_record(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = unhex(V1_SEGMENT);
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        let scan = scan_segment(&bytes);
        for frame in &scan.frames {
            // Any frame that passes its crc is the original record (or its metadata fails to decode).
            if let Ok(record) = scan.view(&bytes, frame).to_record() {
                prop_assert_eq!(record, pinned_record());
            }
        }
        if let Some(footer) = scan.footer {
            let _ = footer.lookup(&bytes, 5);
        }
    }

    #[test]
    fn mutated_version_3_segments_never_return_a_changed_record(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = unhex(V3_SEGMENT);
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        let originals = pinned_records_v3();
        for record in read_all(&bytes).into_iter().flatten() {
            prop_assert!(originals.contains(&record), "{record:?}");
        }
    }

    #[test]
    fn mutated_version_5_segments_never_return_a_changed_record(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = unhex(V5_SEGMENT);
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        let originals = pinned_records_v5();
        for record in read_all(&bytes).into_iter().flatten() {
            prop_assert!(originals.contains(&record), "{record:?}");
        }
    }

    #[test]
    fn mutated_version_6_segments_never_return_a_changed_record(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = unhex(V6_SEGMENT);
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        let originals = pinned_records_v6();
        for record in read_all(&bytes).into_iter().flatten() {
            prop_assert!(originals.contains(&record), "{record:?}");
        }
    }

    #[test]
    fn mutated_version_2_segments_never_return_a_changed_record(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = unhex(V2_SEGMENT);
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        let originals = pinned_records_v2();
        for record in read_all(&bytes).into_iter().flatten() {
            prop_assert!(originals.contains(&record), "{record:?}");
        }
    }
}
