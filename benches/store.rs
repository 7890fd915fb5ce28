//! Step store throughput against JSONL (serde_json) on the same realistic records, and a plain
//! sequential read of a file of the store's size (the physical limit of this machine).
//!
//! Records: 1000 trajectories × 8 turns, each turn 64 new observation tokens, 64 response tokens
//! with full-precision log-probs (ln of a uniform draw, as sampled log-probs are), ~200 characters of observation text and ~60 of action text.
//! Run: `cargo bench --bench store`.

use std::fs::File;
use std::hint::black_box;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use stepppo::store::{Dataset, DatasetWriter, StepInfo, StepRecord, WriterOptions};

const TRAJECTORIES: u64 = 1000;
const TURNS: u32 = 8;
const NEW_TOKENS: u32 = 64;

fn records() -> Vec<StepRecord> {
    let mut out = Vec::new();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state = stepppo::seed::splitmix64(state);
        state
    };
    for traj_id in 0..TRAJECTORIES {
        for t in 0..TURNS {
            out.push(StepRecord {
                traj_id,
                group_id: traj_id / 8,
                step_index: t,
                env_tag: "frozen_lake".into(),
                seed: traj_id / 8,
                policy_version: 12,
                context_len: t * 2 * NEW_TOKENS,
                obs_ids: (0..NEW_TOKENS).map(|_| (next() % 151_000) as u32).collect(),
                response_ids: (0..NEW_TOKENS).map(|_| (next() % 151_000) as u32).collect(),
                response_logprobs: (0..NEW_TOKENS).map(|_| (next() as f32 / u64::MAX as f32).ln()).collect(),
                reward: if t + 1 == TURNS { 1.0 } else { 0.0 },
                terminated: t + 1 == TURNS,
                truncated: false,
                state_hash: next(),
                info: StepInfo {
                    success: t + 1 == TURNS,
                    action_is_valid: true,
                    action_is_effective: t % 3 != 0,
                    format_penalty: 0.0,
                    num_actions: 1,
                    observation_text: "Turn 3:\nState:\n_P__\n_O__\n__OG\n____\nYou have 5 actions left. Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> with no extra text.".into(),
                    action_text: "<think>The goal is down and right.</think><answer>Right</answer>".into(),
                },
            });
        }
    }
    out
}

fn write_store(dir: &Path, records: &[StepRecord]) {
    let mut writer = DatasetWriter::create(dir, WriterOptions::default()).unwrap();
    for record in records {
        writer.append(record).unwrap();
    }
    writer.seal().unwrap();
}

fn write_jsonl(path: &Path, records: &[StepRecord]) {
    let file = File::create(path).unwrap();
    let mut out = BufWriter::with_capacity(1 << 20, file);
    for record in records {
        serde_json::to_writer(&mut out, record).unwrap();
        out.write_all(b"\n").unwrap();
    }
    out.into_inner().unwrap().sync_all().unwrap();
}

/// Full scan over views: every token and log-prob touched, every metadata block decoded.
fn scan_store(dir: &Path) -> (u64, f64) {
    let dataset = Dataset::open(dir).unwrap();
    let (mut tokens, mut sum) = (0u64, 0f64);
    for view in dataset.records() {
        tokens += view
            .obs_ids
            .iter()
            .chain(view.response_ids.iter())
            .map(|&t| t as u64)
            .sum::<u64>();
        sum += view.response_logprobs.iter().sum::<f32>() as f64;
        sum += view.meta().unwrap().reward as f64;
    }
    (tokens, sum)
}

fn decode_store(dir: &Path) -> usize {
    let dataset = Dataset::open(dir).unwrap();
    dataset
        .records()
        .map(|v| v.to_record().unwrap().obs_ids.len())
        .sum()
}

fn read_jsonl(path: &Path) -> usize {
    let reader = BufReader::with_capacity(1 << 20, File::open(path).unwrap());
    reader
        .lines()
        .map(|line| {
            serde_json::from_str::<StepRecord>(&line.unwrap())
                .unwrap()
                .obs_ids
                .len()
        })
        .sum()
}

fn plain_read(path: &Path) -> u64 {
    let mut file = File::open(path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut checksum = 0u64;
    loop {
        let n = file.read(&mut buf).unwrap();
        if n == 0 {
            return checksum;
        }
        checksum = checksum.wrapping_add(
            buf[..n]
                .iter()
                .step_by(4096)
                .map(|&b| b as u64)
                .sum::<u64>(),
        );
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

fn bench_store(c: &mut Criterion) {
    let records = records();
    let n = records.len() as u64;
    let tmp = tempfile::tempdir().unwrap();
    let store_dir = tmp.path().join("store");
    let jsonl_path = tmp.path().join("steps.jsonl");
    write_store(&store_dir, &records);
    write_jsonl(&jsonl_path, &records);
    let store_bytes = dir_bytes(&store_dir);
    let jsonl_bytes = std::fs::metadata(&jsonl_path).unwrap().len();
    let segment = store_dir.join("seg-000000.stp");
    eprintln!(
        "records {n}: store {store_bytes} bytes ({:.0} B/record), jsonl {jsonl_bytes} bytes ({:.0} B/record), size ratio {:.3}",
        store_bytes as f64 / n as f64,
        jsonl_bytes as f64 / n as f64,
        store_bytes as f64 / jsonl_bytes as f64
    );

    let mut group = c.benchmark_group("store");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .throughput(Throughput::Elements(n));
    group.bench_function("write_store", |b| {
        b.iter_with_setup(
            || tempfile::tempdir_in(tmp.path()).unwrap(),
            |dir| write_store(&dir.path().join("d"), &records),
        )
    });
    group.bench_function("write_jsonl", |b| {
        b.iter(|| write_jsonl(&tmp.path().join("w.jsonl"), &records))
    });
    group.bench_function("scan_store_views", |b| {
        b.iter(|| black_box(scan_store(&store_dir)))
    });
    group.bench_function("decode_store_records", |b| {
        b.iter(|| black_box(decode_store(&store_dir)))
    });
    group.bench_function("read_jsonl", |b| {
        b.iter(|| black_box(read_jsonl(&jsonl_path)))
    });
    group.bench_function("plain_read_store_size", |b| {
        b.iter(|| black_box(plain_read(&segment)))
    });
    group.finish();
}

criterion_group!(benches, bench_store);
criterion_main!(benches);
