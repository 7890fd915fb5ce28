//! Step store throughput and size against JSONL (serde_json) on the same realistic records, and a
//! plain sequential write and read of a file of the store's size (the physical limits of this
//! machine).
//!
//! Records: real FrozenLake episodes (default config) played through `stepppo::env` by the random
//! agent, in groups of 8 same-seed trajectories (group g: env seed `seed::derive(1, [g])`, member
//! m: agent seed `seed::derive(env_seed, [m])`), until 8000 steps. Each step keeps the env's
//! reward, flags, state hash and its real observation and action texts; its token arrays are 64
//! observation tokens and 64 response tokens drawn uniformly from a 151 000-id vocabulary, with
//! full-precision log-probs (ln of a uniform draw, as sampled log-probs are).
//! Writes are measured twice: into the OS page cache (both writers end with a flush to the OS, no
//! fsync; the store with `durable: false`) and durably (both end with fsync).
//! Run: `cargo bench --bench store`.

use std::fs::File;
use std::hint::black_box;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use stepppo::env::{self, Agent, AgentKind};
use stepppo::seed;
use stepppo::store::{Dataset, DatasetWriter, StepRecord, WriterOptions};

const RECORDS: usize = 8000;
const GROUP_SIZE: u64 = 8;
const NEW_TOKENS: u32 = 64;
const VOCAB: u64 = 151_000;

fn records() -> Vec<StepRecord> {
    let mut session = env::build_session("frozen_lake", &serde_json::json!({})).unwrap();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state = seed::splitmix64(state);
        state
    };
    let mut out = Vec::with_capacity(RECORDS);
    for traj_id in 0.. {
        let group_id = traj_id / GROUP_SIZE;
        let env_seed = seed::derive(1, &[group_id]);
        let mut agent = Agent::new(
            AgentKind::Random,
            seed::derive(env_seed, &[traj_id % GROUP_SIZE]),
        );
        session.reset(env_seed).unwrap();
        for step_index in 0u32.. {
            if out.len() == RECORDS {
                return out;
            }
            let state_hash = session.state_hash();
            let response = agent.respond(&session).unwrap();
            let outcome = session.act(&response).unwrap();
            out.push(StepRecord {
                traj_id,
                group_id,
                step_index,
                env_tag: session.env().tag().to_string(),
                seed: env_seed,
                policy_version: 12,
                context_len: step_index * 2 * NEW_TOKENS,
                obs_ids: (0..NEW_TOKENS).map(|_| (next() % VOCAB) as u32).collect(),
                response_ids: (0..NEW_TOKENS).map(|_| (next() % VOCAB) as u32).collect(),
                response_logprobs: (0..NEW_TOKENS)
                    .map(|_| (next() as f32 / u64::MAX as f32).ln())
                    .collect(),
                reward: outcome.reward,
                terminated: outcome.terminated,
                truncated: outcome.truncated,
                state_hash,
                info: outcome.info,
                critic_state: Vec::new(),
                admissible_actions: Vec::new(),
            });
            if outcome.next_user_message.is_none() {
                break;
            }
        }
    }
    out
}

fn write_store(dir: &Path, records: &[StepRecord], durable: bool) {
    let opts = WriterOptions {
        durable,
        ..WriterOptions::default()
    };
    let mut writer = DatasetWriter::create(dir, opts).unwrap();
    for record in records {
        writer.append(record).unwrap();
    }
    writer.seal().unwrap();
}

fn write_jsonl(path: &Path, records: &[StepRecord], durable: bool) {
    let file = File::create(path).unwrap();
    let mut out = BufWriter::with_capacity(1 << 20, file);
    for record in records {
        serde_json::to_writer(&mut out, record).unwrap();
        out.write_all(b"\n").unwrap();
    }
    let file = out.into_inner().unwrap();
    if durable {
        file.sync_all().unwrap();
    }
}

/// Full scan over views: every token and log-prob touched, every metadata block decoded in
/// place (texts resolved to slices of the segment; their lengths are summed so none is skipped).
fn scan_store(dir: &Path) -> (u64, f64) {
    let dataset = Dataset::open(dir).unwrap();
    let (mut tokens, mut sum) = (0u64, 0f64);
    for view in dataset.records() {
        tokens += view
            .obs_ids
            .iter()
            .chain(view.response_ids.iter())
            .map(|t| t as u64)
            .sum::<u64>();
        sum += lane_sum(&view.response_logprobs) as f64;
        let meta = view.meta_view().unwrap();
        sum += meta.reward as f64;
        tokens +=
            (meta.env_tag.len() + meta.observation_text.len() + meta.action_text.len()) as u64;
    }
    (tokens, sum)
}

/// Sum of `xs` in eight independent lanes (vectorisable, as numpy's pairwise sum is), not one
/// serial chain of dependent additions that would time the adder's latency instead of the read.
fn lane_sum(xs: &[f32]) -> f32 {
    let chunks = xs.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    let lanes = chunks.fold([0f32; 8], |mut acc, c| {
        acc.iter_mut().zip(c).for_each(|(a, x)| *a += x);
        acc
    });
    lanes.iter().sum::<f32>() + tail
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

/// Writes `bytes` into a new file in 1 MiB writes (page cache, no fsync): the physical floor of
/// the page-cache write benchmarks.
fn plain_write(path: &Path, bytes: &[u8]) {
    let mut file = File::create(path).unwrap();
    for chunk in bytes.chunks(1 << 20) {
        file.write_all(chunk).unwrap();
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
    write_store(&store_dir, &records, true);
    write_jsonl(&jsonl_path, &records, true);
    let text_bytes: usize = records
        .iter()
        .map(|r| r.info.observation_text.len() + r.info.action_text.len())
        .sum();
    let trajectories = records.last().map_or(0, |r| r.traj_id + 1);
    eprintln!(
        "{trajectories} trajectories, {:.1} steps each, {:.0} text bytes per record",
        records.len() as f64 / trajectories as f64,
        text_bytes as f64 / records.len() as f64
    );
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
    for (name, durable) in [("page_cache", false), ("durable", true)] {
        group.bench_function(format!("write_store_{name}"), |b| {
            b.iter_with_setup(
                || tempfile::tempdir_in(tmp.path()).unwrap(),
                |dir| {
                    write_store(&dir.path().join("d"), &records, durable);
                    dir // removed outside the timing
                },
            )
        });
        group.bench_function(format!("write_jsonl_{name}"), |b| {
            b.iter_with_setup(
                || tempfile::tempdir_in(tmp.path()).unwrap(),
                |dir| {
                    write_jsonl(&dir.path().join("w.jsonl"), &records, durable);
                    dir
                },
            )
        });
    }
    let segment_bytes = std::fs::read(&segment).unwrap();
    group.bench_function("plain_write_store_size", |b| {
        b.iter_with_setup(
            || tempfile::tempdir_in(tmp.path()).unwrap(),
            |dir| {
                plain_write(&dir.path().join("plain"), &segment_bytes);
                dir
            },
        )
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
