//! The group-tree training forward (`tree_forward`) against the padded per-trajectory forward:
//! forward + backward of the response tokens' log-probs (the update's policy pass) of the built-in
//! `small` model on
//! - `long_prompt`: one group of 8 trajectories under a 1,024-token prompt, each then 4 steps of
//!   64 tokens (16 observation + 48 response) of its own, in one mini-batch;
//! - `hotpotqa`: the rollout batch of `configs/hotpotqa_steppo.yaml` (8 groups × 4 random-agent
//!   episodes of its HotpotQA env, `concat`), in the update's mini-batches of 8 uniformly
//!   shuffled trajectories (one epoch: 4 mini-batches);
//! - `hotpotqa_mb32`: the same 32 trajectories in one mini-batch.
//!
//! Arms: `padded` (today's forward), `packed` (the tree layout with nothing shared: no padding)
//! and `tree`. The table gives the tokens of the sequences, the positions each arm computes (the
//! padded arm's padding included), the time of one forward + backward over the workload's mini-batches (median
//! of 5 after a warm-up) and the peak resident memory (VmHWM) of a process that runs that arm
//! only, next to the token ratio (tokens / tokens after sharing); criterion then times both arms.
//! `cargo bench --bench tree_forward`.

use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

use candle_core::{Device, Tensor};
use criterion::Criterion;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use stepppo::env::AgentKind;
use stepppo::model::checkpoint::builtin_policy;
use stepppo::model::{Model, PaddedBatch, TrainInput, TreeBatch};
use stepppo::store::{collect, CollectConfig, Dataset, DatasetWriter, StepRecord, WriterOptions};
use stepppo::tokenizer::Tokenizer;
use stepppo::train::learner::batch::{pack, pad, trajectories, PackedBatch};
use stepppo::train::learner::prefix_tree::PrefixTree;

/// Set in a child process: the `workload/arm` it measures alone.
const ARM_VAR: &str = "TREE_FORWARD_ARM";
const WORKLOADS: [&str; 3] = ["long_prompt", "hotpotqa", "hotpotqa_mb32"];
/// `padded`: today's forward; `packed`: the tree layout with nothing shared (each sequence a root:
/// the padding removed only); `tree`: each group's common prefix shared.
const ARMS: [&str; 3] = ["padded", "packed", "tree"];
const TIMED_RUNS: usize = 5;

/// Step records and the mini-batches (lists of sequences) they are trained in.
struct Workload {
    records: Vec<StepRecord>,
    mini_batches: Vec<Vec<Vec<usize>>>,
}

fn workload(name: &str, tok: &Tokenizer) -> Workload {
    match name {
        "long_prompt" => long_prompt(tok.vocab_size() as u32),
        "hotpotqa" => hotpotqa(tok, 8),
        "hotpotqa_mb32" => hotpotqa(tok, 32),
        _ => panic!("no workload {name}"),
    }
}

/// One group of 8: a 1,024-token prompt, then 4 steps of 16 observation + 48 response tokens.
fn long_prompt(vocab: u32) -> Workload {
    let token =
        |salt: u64, i: usize| ((salt * 7919 + i as u64 * 37) % u64::from(vocab - 8)) as u32 + 4;
    let mut records = Vec::new();
    for traj in 0..8u64 {
        let mut context = 0;
        for step in 0..4u32 {
            let obs: Vec<u32> = match step {
                0 => (0..1024).map(|i| token(0, i)).collect(),
                _ => (0..16).map(|i| token(100 + u64::from(step), i)).collect(),
            };
            let salt = 1000 + traj * 10 + u64::from(step);
            let response: Vec<u32> = (0..48).map(|i| token(salt, i)).collect();
            let n = (obs.len() + response.len()) as u32;
            records.push(StepRecord {
                traj_id: traj,
                step_index: step,
                context_len: context,
                obs_ids: obs,
                response_logprobs: vec![0.0; response.len()],
                response_ids: response,
                ..StepRecord::default()
            });
            context += n;
        }
    }
    let all = trajectories(&records);
    Workload {
        records,
        mini_batches: vec![all],
    }
}

/// 32 random-agent episodes of the HotpotQA env of `configs/hotpotqa_steppo.yaml` in groups of
/// 4, shuffled into mini-batches of `mini_batch` trajectories as the update draws them.
fn hotpotqa(tok: &Tokenizer, mini_batch: usize) -> Workload {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cfg = CollectConfig {
        env: "hotpotqa".into(),
        env_config: serde_json::json!({
            "world": "generated", "world_seed": 0, "world_size": 400,
            "split": "train", "corpus": "distractor", "max_turns": 4
        }),
        agent: AgentKind::Random,
        episodes: 32,
        group_size: 4,
        seed: 42,
    };
    let options = WriterOptions {
        durable: false,
        ..WriterOptions::default()
    };
    let mut writer = DatasetWriter::create(dir.path(), options).expect("a dataset");
    collect(&cfg, tok, &mut writer).expect("episodes");
    writer.seal().expect("sealed");
    let dataset = Dataset::open(dir.path()).expect("the dataset");
    let records: Vec<StepRecord> = dataset
        .records()
        .map(|v| v.to_record().expect("a record"))
        .collect();
    let all = trajectories(&records);
    let mut order: Vec<usize> = (0..all.len()).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(0));
    let mini_batches = order
        .chunks(mini_batch)
        .map(|c| c.iter().map(|&s| all[s].clone()).collect())
        .collect();
    Workload {
        records,
        mini_batches,
    }
}

/// One mini-batch on the device: the model input, the scored positions and their targets.
struct Prepared {
    input: TrainInput,
    positions: Tensor,
    targets: Tensor,
    /// Positions the forward computes.
    computed: usize,
}

fn prepare(w: &Workload, arm: &str, dev: &Device) -> (Vec<Prepared>, usize) {
    let mut tokens = 0;
    let batches = w
        .mini_batches
        .iter()
        .map(|seqs| {
            let p = pack(&w.records, seqs).expect("packed");
            tokens += p.inputs.iter().map(Vec::len).sum::<usize>();
            let groups: Vec<u64> = seqs.iter().map(|s| w.records[s[0]].group_id).collect();
            prepare_batch(&p, &groups, arm, dev)
        })
        .collect();
    (batches, tokens)
}

fn prepare_batch(p: &PackedBatch, groups: &[u64], arm: &str, dev: &Device) -> Prepared {
    let t = p.seq_len;
    let targets = p.token_targets();
    let (input, positions, computed) = match arm {
        "padded" => {
            let (ids, mask) = pad(&p.inputs, t, 0);
            let shape = (p.inputs.len(), t);
            let input = TrainInput::Padded(PaddedBatch {
                input_ids: Tensor::from_vec(ids, shape, dev).unwrap(),
                attention_mask: Tensor::from_vec(mask, shape, dev).unwrap(),
            });
            (input, p.token_index.clone(), p.inputs.len() * t)
        }
        _ => {
            let alone: Vec<u64> = (0..groups.len() as u64).collect();
            let tree = PrefixTree::new(p, if arm == "tree" { groups } else { &alone });
            let positions = p.token_index.iter().map(|&i| tree.packed(i)).collect();
            let computed = tree.ids.len();
            let batch = TreeBatch::new(&tree.ids, tree.segments, dev).unwrap();
            (TrainInput::Tree(batch), positions, computed)
        }
    };
    Prepared {
        input,
        positions: Tensor::new(positions.as_slice(), dev).unwrap(),
        targets: Tensor::new(targets.as_slice(), dev).unwrap(),
        computed,
    }
}

/// Forward + backward of the scored tokens' log-probs over every mini-batch.
fn fwd_bwd(model: &Model, batches: &[Prepared]) {
    for b in batches {
        let hidden = model.hidden(&b.input).unwrap();
        let (logp, _) = model
            .head_logprobs_entropy(&hidden, &b.positions, &b.targets, 1.0, None)
            .unwrap();
        black_box(logp.sum_all().unwrap().backward().unwrap());
    }
}

/// Peak resident set of this process, in MiB.
fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(f64::NAN);
    kb / 1024.0
}

/// The child's work: one arm of one workload, timed, then its figures on one line.
fn measure(spec: &str) {
    let (name, arm) = spec.split_once('/').expect("workload/arm");
    let (model, tok) = builtin_policy(&Device::Cpu).unwrap();
    let w = workload(name, &tok);
    let tree_tokens: usize = prepare(&w, "tree", &Device::Cpu)
        .0
        .iter()
        .map(|b| b.computed)
        .sum();
    let (batches, tokens) = prepare(&w, arm, &Device::Cpu);
    fwd_bwd(&model, &batches);
    let mut times: Vec<f64> = (0..TIMED_RUNS)
        .map(|_| {
            let start = Instant::now();
            fwd_bwd(&model, &batches);
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let computed: usize = batches.iter().map(|b| b.computed).sum();
    println!(
        "{tokens} {computed} {tree_tokens} {:.1} {:.0}",
        times[TIMED_RUNS / 2],
        peak_rss_mib()
    );
}

/// Runs each arm of each workload in a process of its own and prints the table.
fn table() {
    let exe = std::env::current_exe().expect("this bench's path");
    println!("| workload | arm | tokens | positions computed | token ratio | fwd+bwd ms | speedup | peak RSS MiB |");
    println!("|---|---|---|---|---|---|---|---|");
    for name in WORKLOADS {
        let mut padded_ms = f64::NAN;
        for arm in ARMS {
            let out = Command::new(&exe)
                .env(ARM_VAR, format!("{name}/{arm}"))
                .output()
                .expect("the arm's process");
            let line = String::from_utf8_lossy(&out.stdout);
            let f: Vec<f64> = line
                .split_whitespace()
                .map(|x| x.parse().expect("a figure"))
                .collect();
            let [tokens, computed, tree_tokens, ms, rss] = f[..] else {
                panic!(
                    "{name}/{arm}: {line} {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            };
            if arm == "padded" {
                padded_ms = ms;
            }
            println!(
                "| {name} | {arm} | {tokens} | {computed} | {:.2}× | {ms:.1} | {:.2}× | {rss:.0} |",
                tokens / tree_tokens,
                padded_ms / ms
            );
        }
    }
}

fn bench(c: &mut Criterion) {
    let (model, tok) = builtin_policy(&Device::Cpu).unwrap();
    for name in WORKLOADS {
        let w = workload(name, &tok);
        let mut group = c.benchmark_group(format!("tree_forward/{name}"));
        group.sample_size(10);
        for arm in ARMS {
            let (batches, _) = prepare(&w, arm, &Device::Cpu);
            group.bench_function(arm, |b| b.iter(|| fwd_bwd(&model, &batches)));
        }
        group.finish();
    }
}

fn main() {
    if let Ok(spec) = std::env::var(ARM_VAR) {
        return measure(&spec);
    }
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    table();
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
