//! The on-disk format stays readable: a segment written by format version 1 is pinned here byte
//! for byte; arbitrary or mutated bytes never make the reader panic.

use proptest::prelude::*;
use stepppo::store::{scan_segment, StepInfo, StepRecord, FORMAT_VERSION};

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
        },
    }
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

fn written_segment() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = stepppo::store::DatasetWriter::create(dir.path(), Default::default()).unwrap();
    writer.append(&pinned_record()).unwrap();
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
    let bytes = unhex(V1_SEGMENT);
    let scan = scan_segment(&bytes);
    assert!(scan.problems.is_empty(), "{:?}", scan.problems);
    assert_eq!(scan.format_version, 1);
    assert_eq!(scan.frames.len(), 1);
    assert_eq!(
        scan.view(&bytes, &scan.frames[0]).to_record().unwrap(),
        pinned_record()
    );
    if FORMAT_VERSION == 1 {
        assert_eq!(
            hex(&written_segment()),
            hex(&bytes),
            "format 1 changed: bump FORMAT_VERSION and keep reading 1"
        );
    }
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
}
