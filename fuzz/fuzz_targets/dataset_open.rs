//! A dataset directory built from arbitrary bytes (a little-endian u16 length, that many bytes
//! of `manifest.json`, the rest as `seg-000000.stp`): opening, every reader, skipping
//! undecodable records, `verify` and `repair` never panic; every record a reader returns after
//! the skip decodes; after a repair that succeeds the dataset verifies sound, holds only records
//! that decoded before it, and one of every (traj_id, step_index) key that did.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use stepppo::store::{repair, verify, Dataset, StepRecord, MANIFEST_FILE};

/// A directory of this process for the dataset.
fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        std::env::temp_dir().join(format!("stepppo-fuzz-dataset-{}", std::process::id()))
    })
}

fn build(data: &[u8]) -> Option<()> {
    let len = u16::from_le_bytes([*data.first()?, *data.get(1)?]) as usize;
    let manifest = data.get(2..2 + len)?;
    let _ = std::fs::remove_dir_all(dir());
    std::fs::create_dir_all(dir()).unwrap();
    std::fs::write(dir().join(MANIFEST_FILE), manifest).unwrap();
    std::fs::write(dir().join("seg-000000.stp"), &data[2 + len..]).unwrap();
    Some(())
}

/// Every record readers return after skipping the undecodable ones, sorted.
fn readable() -> Option<Vec<StepRecord>> {
    let mut dataset = Dataset::open(dir()).ok()?;
    dataset.skip_undecodable();
    let mut records: Vec<StepRecord> = dataset.records().map(|v| v.to_record().unwrap()).collect();
    for traj in dataset.trajectories() {
        std::hint::black_box(traj.is_open().unwrap());
    }
    std::hint::black_box(dataset.groups().len());
    records.sort_by(|a, b| (a.traj_id, a.step_index).cmp(&(b.traj_id, b.step_index)));
    Some(records)
}

fuzz_target!(|data: &[u8]| {
    if build(data).is_none() {
        return;
    }
    let Some(before) = readable() else { return };
    std::hint::black_box(verify(dir()).map(|r| r.problems.len()).ok());
    if repair(dir()).is_ok() {
        let report = verify(dir()).unwrap();
        assert!(report.is_sound(), "{:?}", report.problems);
        let after = readable().unwrap();
        assert!(
            after.iter().all(|r| before.contains(r)),
            "repair made up a record"
        );
        let keys = |rs: &[StepRecord]| {
            let mut keys: Vec<_> = rs.iter().map(|r| (r.traj_id, r.step_index)).collect();
            keys.dedup();
            keys
        };
        assert_eq!(
            keys(&after),
            keys(&before),
            "repair lost a record that decoded"
        );
    }
});
