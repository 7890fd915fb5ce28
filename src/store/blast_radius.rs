//! How many records one flipped byte of a segment costs (tests only): the bound the reference
//! blocks give, and the measurement behind the choice of [`codec::REFERENCE_BLOCK`] (an ignored
//! test that prints segment size against JSONL and records lost per flip for several block sizes
//! over datasets of `collect`ed random-agent episodes; see `docs/experiments/store.md`); and an
//! ignored test that counts the records lost per flipped bit of a segment header's version and
//! flags fields, with the manifest listing the segment's version and without a manifest. Its
//! datasets (`collected`) and sealed segments (`encode`) also serve `derive_probe`.

use std::collections::HashMap;
use std::path::Path;

use super::codec;
use super::collect::{collect, CollectConfig};
use super::dataset::{Dataset, DatasetWriter, WriterOptions};
use super::manifest::MANIFEST_FILE;
use super::record::StepRecord;
use super::replay::jsonl_line;
use super::segment::{scan, SegmentWriter, HEADER_LEN};
use crate::env::AgentKind;
use crate::tokenizer::Tokenizer;

/// One sealed segment of `records`, written with reference blocks of `block` frames.
pub(super) fn encode(records: &[StepRecord], block: u64) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seg-000000.stp");
    let mut writer = SegmentWriter::create(&path, false)
        .unwrap()
        .with_reference_block(block);
    for record in records {
        writer.append(record, u64::MAX).unwrap();
    }
    writer.seal().unwrap();
    std::fs::read(&path).unwrap()
}

/// Records of `bytes` that no longer decode, checking that every record that does decode is
/// the one written (damage is never returned as data).
fn lost_records(bytes: &[u8], written: &HashMap<(u64, u32), &StepRecord>) -> usize {
    let scan = scan(bytes);
    let decoded = scan.frames.iter().filter_map(|frame| {
        let record = scan.view(bytes, frame).to_record().ok()?;
        let key = (record.traj_id, record.step_index);
        assert_eq!(
            Some(&&record),
            written.get(&key),
            "a damaged record decoded"
        );
        Some(())
    });
    written.len() - decoded.count()
}

fn keyed(records: &[StepRecord]) -> HashMap<(u64, u32), &StepRecord> {
    records
        .iter()
        .map(|r| ((r.traj_id, r.step_index), r))
        .collect()
}

fn same_texts(count: u64) -> Vec<StepRecord> {
    (0..count)
        .map(|i| StepRecord {
            traj_id: i,
            obs_ids: vec![7; 4],
            env_tag: "frozen_lake".into(),
            info: crate::env::StepInfo {
                observation_text: "_P_\n_O_\n__G\n".repeat(4),
                action_text: "<answer>Up</answer>".into(),
                ..Default::default()
            },
            ..StepRecord::default()
        })
        .collect()
}

#[test]
fn a_flipped_byte_costs_at_most_one_reference_block() {
    let block = codec::REFERENCE_BLOCK;
    let records = same_texts(3 * block + 5);
    let written = keyed(&records);
    let bytes = encode(&records, block);
    let frames = scan(&bytes).frames;
    for first in [0, block as usize, 2 * block as usize] {
        let at = frames[first].offset as usize + 20;
        let mut damaged = bytes.clone();
        damaged[at] ^= 0x10;
        assert_eq!(lost_records(&damaged, &written), block as usize);
    }
    let mut worst = 0;
    for at in (HEADER_LEN..bytes.len()).step_by(7) {
        let mut damaged = bytes.clone();
        damaged[at] ^= 0x81;
        worst = worst.max(lost_records(&damaged, &written));
    }
    assert_eq!(worst, block as usize);
    // Without blocks the first frame's texts serve every later record of the window.
    let mut unbounded = encode(&records, u64::MAX);
    let at = scan(&unbounded).frames[0].offset as usize + 20;
    unbounded[at] ^= 0x10;
    assert_eq!(lost_records(&unbounded, &written), records.len());
}

fn unsynced() -> WriterOptions {
    WriterOptions {
        durable: false,
        ..WriterOptions::default()
    }
}

/// The records of `episodes` random-agent episodes of `env` (seed 0), as `stepppo collect` writes them.
pub(super) fn collected(env: &str, episodes: u64) -> Vec<StepRecord> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = CollectConfig {
        env: env.into(),
        env_config: serde_json::Value::Object(Default::default()),
        agent: AgentKind::Random,
        episodes,
        group_size: 1,
        seed: 0,
    };
    let mut writer = DatasetWriter::create(dir.path(), unsynced()).unwrap();
    collect(&cfg, &Tokenizer::builtin(), &mut writer).unwrap();
    writer.seal().unwrap();
    let dataset = Dataset::open(dir.path()).unwrap();
    let records = dataset.records().map(|v| v.to_record().unwrap());
    records.collect()
}

/// splitmix64: a deterministic sample of flip positions and masks.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Mean and maximum records lost over `flips` sampled flips past the header, and the maximum
/// over every flip of the header's bytes.
fn flip_figures(
    bytes: &[u8],
    written: &HashMap<(u64, u32), &StepRecord>,
    flips: usize,
) -> (f64, usize, usize) {
    let mut state = 26;
    let (mut total, mut max) = (0, 0);
    for _ in 0..flips {
        let at = HEADER_LEN + (splitmix(&mut state) % (bytes.len() - HEADER_LEN) as u64) as usize;
        let mut damaged = bytes.to_vec();
        damaged[at] ^= (splitmix(&mut state) % 255 + 1) as u8;
        let lost = lost_records(&damaged, written);
        total += lost;
        max = max.max(lost);
    }
    let header = (0..HEADER_LEN).map(|at| {
        let mut damaged = bytes.to_vec();
        damaged[at] ^= 0x01;
        lost_records(&damaged, written)
    });
    (total as f64 / flips as f64, max, header.max().unwrap_or(0))
}

/// Prints, per dataset and block size: segment bytes, JSONL bytes, their ratio, and records lost
/// per flipped byte (mean, max over 2,000 sampled positions; max over the 16 header bytes).
/// `cargo test --lib store::blast_radius -- --ignored --nocapture`
#[test]
#[ignore = "measurement (minutes); prints the figures of docs/experiments/store.md"]
fn records_lost_per_flipped_byte_by_reference_block() {
    println!("| dataset | block | records | segment bytes | JSONL bytes | size ratio | lost per flip: mean | max | max, header bytes |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for env in ["frozen_lake", "sokoban"] {
        let records = collected(env, 512);
        let written = keyed(&records);
        let jsonl: usize = (records.iter())
            .map(|r| jsonl_line(r, Default::default()).unwrap().len() + 1)
            .sum();
        for block in [u64::MAX, 8, 16, 32, 64, 128] {
            let bytes = encode(&records, block);
            let (mean, max, header) = flip_figures(&bytes, &written, 2000);
            let name = if block == u64::MAX {
                "none".to_string()
            } else {
                block.to_string()
            };
            println!(
                "| {env} 512 random | {name} | {} | {} | {jsonl} | {:.3} | {mean:.2} | {max} | {header} |",
                records.len(),
                bytes.len(),
                bytes.len() as f64 / jsonl as f64
            );
        }
    }
}

/// Records of the dataset in `dir` that read, checking each against the one written.
fn readable_records(dir: &Path, written: &HashMap<(u64, u32), &StepRecord>) -> usize {
    let dataset = Dataset::open(dir).unwrap();
    let records = dataset.records().filter_map(|view| view.to_record().ok());
    records
        .map(|record| {
            let key = (record.traj_id, record.step_index);
            assert_eq!(Some(&&record), written.get(&key), "a damaged record read");
        })
        .count()
}

/// Records lost per flip of each bit of the header's version and flags fields (bytes 8 to 15) of
/// the segment `seg` of the dataset in `dir`: mean and max over the 64 flips.
fn header_flip_losses(
    dir: &Path,
    seg: &Path,
    written: &HashMap<(u64, u32), &StepRecord>,
) -> (f64, usize) {
    let original = std::fs::read(seg).unwrap();
    let flips: Vec<(usize, u32)> = (8..16)
        .flat_map(|at| (0..8).map(move |bit| (at, bit)))
        .collect();
    let lost: Vec<usize> = (flips.iter())
        .map(|&(at, bit)| {
            let mut damaged = original.clone();
            damaged[at] ^= 1 << bit;
            std::fs::write(seg, &damaged).unwrap();
            written.len() - readable_records(dir, written)
        })
        .collect();
    std::fs::write(seg, &original).unwrap();
    let total: usize = lost.iter().sum();
    (
        total as f64 / lost.len() as f64,
        lost.into_iter().max().unwrap_or(0),
    )
}

/// Prints, per dataset (512 random-agent episodes in one sealed segment): records lost per flipped
/// bit of the header's version and flags fields, read through `Dataset::open` with the manifest
/// (which lists the segment's version) and with the manifest removed.
/// `cargo test --lib store::blast_radius::records_lost_per_flipped_header_bit -- --ignored --nocapture`
#[test]
#[ignore = "measurement (seconds); prints the header-flip figures of docs/experiments/store.md"]
fn records_lost_per_flipped_header_bit() {
    println!("| dataset | records | flips | with manifest: lost mean | max | no manifest: lost mean | max |");
    println!("|---|---|---|---|---|---|---|");
    for env in ["frozen_lake", "sokoban"] {
        let records = collected(env, 512);
        let written = keyed(&records);
        let dir = tempfile::tempdir().unwrap();
        let mut writer = DatasetWriter::create(dir.path(), unsynced()).unwrap();
        records.iter().for_each(|r| {
            writer.append(r).unwrap();
        });
        writer.seal().unwrap();
        let seg = dir.path().join("seg-000000.stp");
        assert_eq!(readable_records(dir.path(), &written), records.len());
        let (listed_mean, listed_max) = header_flip_losses(dir.path(), &seg, &written);
        std::fs::remove_file(dir.path().join(MANIFEST_FILE)).unwrap();
        let (bare_mean, bare_max) = header_flip_losses(dir.path(), &seg, &written);
        println!(
            "| {env} 512 random | {} | 64 | {listed_mean:.1} | {listed_max} | {bare_mean:.1} | {bare_max} |",
            records.len()
        );
    }
}
