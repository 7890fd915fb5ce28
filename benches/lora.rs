//! LoRA against full fine-tuning on the CPU, each with and without bf16 mixed precision (`+bf16`)
//! and activation checkpointing (`+ckpt`): one actor update's time and the process's peak memory, the trained parameters and
//! their optimizer state, and the checkpoint's size; and, on the 90M shape, generation with the adapters merged into the weights against kept beside them,
//! with the cost of one merge (what a merged rollout pays after each update).
//!
//! Shapes: a 90M-parameter Qwen2 (hidden 896, 6 layers, 14 / 2 heads, MLP 4,864, the built-in
//! vocabulary) at 4 × 256 tokens, and the Qwen2.5-0.5B shape (`configs/models/qwen2.5-0.5b.json`,
//! vocabulary 151,936, tied head) at 2 × 256; random weights, the second half of each sequence
//! its response, the PPO loss with an entropy term, gradient clipping at 1 and AdamW. LoRA: rank
//! 16, alpha 32, on all seven projections. Each (shape, arm) runs in a child process of its own,
//! so its peak RSS (`VmHWM`) is its own; beside it, the peak `stepppo plan` predicts for the case
//! ([`stepppo::train::learner::memory_plan`]) and its error.
//!
//! `cargo bench --bench lora [-- FILTER]` (FILTER picks shapes by name); `STEPPPO_BENCH_RUNS`
//! sets the timed updates (default 3, after one warm-up); `STEPPPO_BENCH_THREADS` the compute
//! threads (default 1); `STEPPPO_BENCH_ARMS` the arms (default all eight: `full full+ckpt
//! full+bf16 full+bf16+ckpt lora …`).

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use stepppo::algo::config::{LossConfig, OptimizerConfig};
use stepppo::algo::{policy_loss, AdamW};
use stepppo::model::{
    AdapterRollout, Adapters, LoraSpec, Model, ModelConfig, PaddedBatch, Precision,
};
use stepppo::rollout::engine::{CacheMode, Engine, EngineConfig, GenRequest};
use stepppo::rollout::sampling::SamplingParams;
use stepppo::tokenizer::Tokenizer;
use stepppo::train::learner::memory_plan::{MemoryPlan, PlanDevice, PlanShape, TrainedModel};

/// Set in a child: `SHAPE ARM`, the case it measures.
const CASE_VAR: &str = "STEPPPO_LORA_CASE";
const RUNS_VAR: &str = "STEPPPO_BENCH_RUNS";
const THREADS_VAR: &str = "STEPPPO_BENCH_THREADS";
const ARMS_VAR: &str = "STEPPPO_BENCH_ARMS";
const LR: f64 = 1e-5;
/// Generation case: prompts × prompt tokens, new tokens.
const GEN: (usize, usize, usize) = (8, 256, 64);

fn shapes() -> Vec<(&'static str, ModelConfig, usize, usize)> {
    let vocab = Tokenizer::builtin().vocab_size();
    let mut qwen_90m = ModelConfig::small(vocab);
    qwen_90m.hidden_size = 896;
    qwen_90m.num_hidden_layers = 6;
    qwen_90m.num_attention_heads = 14;
    qwen_90m.num_key_value_heads = 2;
    qwen_90m.intermediate_size = 4864;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/qwen2.5-0.5b.json");
    let qwen_05b = ModelConfig::from_file(&path).unwrap();
    vec![
        ("qwen2_90m_4x256", qwen_90m, 4, 256),
        ("qwen2.5_0.5b_2x256", qwen_05b, 2, 256),
    ]
}

fn lora_spec() -> LoraSpec {
    LoraSpec {
        rank: 16,
        alpha: 32.0,
        dropout: 0.0,
        target_modules: vec!["all-linear".into()],
    }
}

/// A child's figures.
#[derive(Serialize, Deserialize)]
struct Report {
    update_ms: f64,
    peak_rss_mb: f64,
    /// The memory plan's peak of the same update.
    planned_peak_mb: f64,
    trained_params: usize,
    checkpoint_mb: f64,
    /// Generation (90M only): merged and unmerged decode tokens/s, one merge's milliseconds.
    generation: Option<(f64, f64, f64)>,
}

fn model_for(cfg: &ModelConfig, lora: bool) -> Model {
    let mut model = Model::new(cfg, 7, &Device::Cpu).unwrap();
    if lora {
        let adapters = Adapters::fresh(cfg, &lora_spec(), 11, &Device::Cpu, "bench").unwrap();
        model.attach_adapters(adapters).unwrap();
    }
    model
}

/// One PPO update of `model` on `batch` sequences of `len` tokens (second half the response).
fn update(model: &Model, opt: &mut AdamW, batch: usize, len: usize) -> f64 {
    let dev = Device::Cpu;
    let vocab = model.config().vocab_size.min(4096) as u32;
    let seqs: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..len)
                .map(|t| ((b * 7919 + t * 104_729) as u32) % vocab)
                .collect()
        })
        .collect();
    let padded = PaddedBatch::right_padded(&seqs, 0, &dev).unwrap();
    let response = len / 2;
    let positions: Vec<u32> = (0..batch)
        .flat_map(|b| (len - response - 1..len - 1).map(move |t| (b * len + t) as u32))
        .collect();
    let targets: Vec<u32> = positions
        .iter()
        .map(|&p| seqs[p as usize / len][p as usize % len + 1])
        .collect();
    let (logp, entropy) = model
        .logprobs_entropy_at(
            &padded.input_ids,
            &padded.attention_mask,
            &Tensor::new(positions.as_slice(), &dev).unwrap(),
            &Tensor::new(targets.as_slice(), &dev).unwrap(),
            1.0,
            None,
        )
        .unwrap();
    let shape = (batch, response);
    let (logp, entropy) = (
        logp.reshape(shape).unwrap(),
        entropy.reshape(shape).unwrap(),
    );
    let old = (logp.detach() - 0.01).unwrap();
    let adv: Vec<f32> = (0..batch * response)
        .map(|i| if i % 3 == 0 { 1.0 } else { -0.5 })
        .collect();
    let adv = Tensor::from_vec(adv, shape, &dev).unwrap();
    let mask = old.ones_like().unwrap();
    let cfg = LossConfig {
        entropy_loss_coef: 0.001,
        ..LossConfig::default()
    };
    let (loss, _) = policy_loss(&logp, &old, &adv, &mask, None, &entropy, &cfg).unwrap();
    let grads = stepppo::model::backward(&loss).unwrap();
    opt.step(&grads, LR, Some(1.0)).unwrap();
    loss.to_dtype(DType::F64).unwrap().to_scalar().unwrap()
}

/// Decode tokens/s of greedy generation from `GEN`'s prompts: the time of the whole generation
/// less that of its prefill (the same prompts with one new token).
fn decode_rate(model: &Model) -> f64 {
    let (n, prompt_len, new) = GEN;
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|b| {
            (0..prompt_len)
                .map(|t| ((b * 31 + t * 17) % 200 + 3) as u32)
                .collect()
        })
        .collect();
    let run = |new: usize| {
        let cfg = EngineConfig {
            cache_mode: CacheMode::None,
            num_slots: n * (prompt_len + new) + 64,
            ..EngineConfig::default()
        };
        let mut engine = Engine::for_model(model, cfg).unwrap();
        let requests: Vec<GenRequest> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| GenRequest::plain(p.clone(), SamplingParams::greedy(), i as u64, new))
            .collect();
        let start = Instant::now();
        engine
            .generate(model, &Tokenizer::builtin(), &requests)
            .unwrap();
        start.elapsed().as_secs_f64()
    };
    let prefill = run(1);
    (n * (new - 1)) as f64 / (run(new) - prefill)
}

fn peak_rss_mb() -> f64 {
    stepppo::device::memory_peak(&Device::Cpu).map_or(f64::NAN, |b| b as f64 / (1u64 << 20) as f64)
}

/// The memory plan's peak (MiB) of one update of `batch` × `len` tokens, half of them scored.
fn planned_peak_mb(
    cfg: &ModelConfig,
    (lora, checkpointing, precision): (bool, bool, Precision),
    batch: usize,
    len: usize,
) -> f64 {
    let shape = PlanShape {
        policy: TrainedModel {
            config: cfg.clone(),
            lora: lora.then(lora_spec),
            is_critic: false,
            shares_policy_weights: false,
        },
        critic: None,
        device: PlanDevice::Cpu,
        batch_tokens: batch * len,
        logit_rows: batch * (len / 2),
        sequence_tokens: len,
        activation_checkpointing: checkpointing,
        precision,
        rollout_precision: Precision::F32,
        kv_slots: 0,
        extra_policy_copies: 0,
        ranks: 1,
        sharding: Default::default(),
    };
    MemoryPlan::of(&shape).peak() as f64 / (1u64 << 20) as f64
}

fn dir_mb(dir: &Path) -> f64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len() as f64)
        .sum::<f64>()
        / 1e6
}

fn child(shape: &str, arm: &str) -> Report {
    let (_, cfg, batch, len) = shapes().into_iter().find(|s| s.0 == shape).unwrap();
    let lora = arm.starts_with("lora");
    let checkpointing = arm.contains("+ckpt");
    let precision = if arm.contains("+bf16") {
        Precision::Bf16
    } else {
        Precision::F32
    };
    let mut model = model_for(&cfg, lora);
    model.set_activation_checkpointing(checkpointing);
    model.set_precision(precision);
    let vars = model.trainable_vars();
    let trained_params = vars.iter().map(|(_, v)| v.elem_count()).sum();
    let mut opt = AdamW::new(vars, &OptimizerConfig::default()).unwrap();
    let runs: usize = std::env::var(RUNS_VAR)
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    update(&model, &mut opt, batch, len);
    let mut ms: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            update(&model, &mut opt, batch, len);
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    let peak_rss_mb = peak_rss_mb();
    let planned_peak_mb = planned_peak_mb(&cfg, (lora, checkpointing, precision), batch, len);
    let ckpt = tempfile::tempdir().unwrap();
    model.save(ckpt.path(), None).unwrap();
    let checkpoint_mb = dir_mb(ckpt.path());
    let generation = (arm == "lora" && shape.starts_with("qwen2_90m")).then(|| {
        let start = Instant::now();
        model.set_adapter_rollout(AdapterRollout::Merged).unwrap();
        let merge_ms = start.elapsed().as_secs_f64() * 1e3;
        let merged = decode_rate(&model);
        model.set_adapter_rollout(AdapterRollout::Unmerged).unwrap();
        (merged, decode_rate(&model), merge_ms)
    });
    Report {
        update_ms: ms[ms.len() / 2],
        peak_rss_mb,
        planned_peak_mb,
        trained_params,
        checkpoint_mb,
        generation,
    }
}

fn main() {
    let threads: usize = std::env::var(THREADS_VAR)
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(1);
    if let Ok(case) = std::env::var(CASE_VAR) {
        stepppo::device::prepare_cpu_process();
        let (shape, arm) = case.split_once(' ').unwrap();
        println!(
            "RESULT {}",
            serde_json::to_string(&child(shape, arm)).unwrap()
        );
        return;
    }
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let arms = std::env::var(ARMS_VAR).unwrap_or_else(|_| {
        "full full+ckpt full+bf16 full+bf16+ckpt lora lora+ckpt lora+bf16 lora+bf16+ckpt".into()
    });
    println!("LoRA rank 16 (alpha 32, all seven projections) against full fine-tuning, {threads} thread(s)");
    println!(
        "| shape | arm | update ms | peak RSS MB | planned peak MB (error) | trained params | checkpoint MB | decode tok/s merged / unmerged | one merge ms |"
    );
    println!("|---|---|--:|--:|--:|--:|--:|--:|--:|");
    for (name, ..) in shapes() {
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        for arm in arms.split_whitespace() {
            let out = Command::new(std::env::current_exe().unwrap())
                .env(CASE_VAR, format!("{name} {arm}"))
                .env("RAYON_NUM_THREADS", threads.to_string())
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            let Some(json) = text.lines().find_map(|l| l.strip_prefix("RESULT ")) else {
                println!(
                    "| {name} | {arm} | failed: {} |",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                continue;
            };
            let r: Report = serde_json::from_str(json).unwrap();
            let (generation, merge) = match r.generation {
                Some((m, u, ms)) => (format!("{m:.0} / {u:.0}"), format!("{ms:.1}")),
                None => ("–".into(), "–".into()),
            };
            println!(
                "| {name} | {arm} | {:.0} | {:.0} | {:.0} ({:+.1} %) | {} | {:.2} | {generation} | {merge} |",
                r.update_ms,
                r.peak_rss_mb,
                r.planned_peak_mb,
                100.0 * (r.planned_peak_mb / r.peak_rss_mb - 1.0),
                r.trained_params,
                r.checkpoint_mb
            );
        }
    }
}
