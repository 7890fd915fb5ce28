//! The actor update step of stepppo next to the same step in PyTorch, on the same weights and
//! inputs: forward, log-probs and entropies at the response positions (the LM head on those
//! positions only), the PPO loss (token ratio, clip 0.2 / 0.28, `seq-mean-token-mean`, entropy
//! coefficient 0.001), backward, gradient clipping at 1.0 and an AdamW step.
//!
//! Shapes: the built-in `small` model at 8 × 128 and 16 × 640 tokens, and a 90M-parameter Qwen2
//! (hidden 896, 6 layers, 14 / 2 heads, MLP 4,864, the built-in vocabulary) at 4 × 256, and
//! Qwen2.5-0.5B's shape (`configs/models/qwen2.5-0.5b.json`: 24 layers, its 151,936-token
//! vocabulary) at 2 × 256; each at 1 and 2 threads. The second half of every sequence is its response. For each shape the bench
//! writes the model as an HF directory and the inputs as JSON, then runs one child process per
//! (shape, threads, side) so each gets its own thread pool: this binary for stepppo, and
//! `scripts/torch_update_step.py` (transformers `Qwen2ForCausalLM`, SDPA attention,
//! `torch.set_num_threads`) for PyTorch, found through `STEPPPO_TORCH_PYTHON` or `python3`; the
//! PyTorch side is skipped with a message where torch or transformers is missing. Both sides
//! report the first step's loss, which must agree, and the median of the timed steps. stepppo's
//! side runs under the `stepppo` binary's process settings ([`stepppo::device::prepare_cpu_process`]:
//! freed memory kept in the heap, candle's idle pool workers parked soon).
//!
//! Next to the two, the step's limit on this machine: its matrix products' FLOPs (forward, and
//! twice that backward, once where only LoRA's adapters train, plus a second forward under
//! checkpointing; the attention's causal half; the LM head at the response positions) divided
//! by the fastest rate either library reaches on the shape's largest product (`[tokens, hidden]
//! × [hidden, intermediate]` in the arm's dtype, measured in each child at its thread count). No step can
//! be faster than that, whatever its non-product work costs; `limit speed` is PyTorch's time over
//! it, the most any update could gain on PyTorch here.
//!
//! On a GPU (`STEPPPO_BENCH_DEVICE=cuda`) the shapes are Qwen2.5-0.5B's at 16 × 1,024 tokens and
//! Qwen2.5-3B's (`configs/models/qwen2.5-3b.json`) at 8 × 1,024, one row a case (threads do not
//! apply), PyTorch on the same GPU. `STEPPPO_BENCH_ARMS` picks what is trained, each arm a case
//! of its own: `full` (every weight, f32; the CPU default), `+bf16` (bf16 products, f32 master
//! weights and optimizer; PyTorch: `torch.autocast` bf16), `+ckpt` (activation checkpointing;
//! PyTorch: transformers' gradient checkpointing), `lora` (rank-16 adapters on all seven
//! projections, alpha 32, the base frozen; PyTorch: the same adapters, B zero so the first loss
//! agrees); the GPU default is `full+bf16 full+bf16+ckpt lora+bf16+ckpt`. Each side also reports
//! the peak memory of its timed steps (stepppo: [`stepppo::device::memory_peak`]; PyTorch:
//! `torch.cuda.max_memory_allocated`, or the peak resident set on the CPU).
//!
//! `cargo bench --bench training [-- FILTER]` (FILTER picks shapes by name);
//! `STEPPPO_BENCH_RUNS` sets the timed steps per case (default 5, after one warm-up step);
//! `STEPPPO_BENCH_DIR` keeps the cases' directories there (for a profiler: run this binary with
//! `STEPPPO_TRAINING_CASE=DIR/SHAPE`) instead of a temporary directory. `speed` is stepppo's
//! tokens/s over PyTorch's.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use stepppo::algo::config::{LossConfig, OptimizerConfig};
use stepppo::algo::{policy_loss, AdamW};
use stepppo::model::{Adapters, LoraSpec, Model, ModelConfig, PaddedBatch, Precision};
use stepppo::tokenizer::Tokenizer;

/// Set in a child process: the model directory whose case it times (stepppo's side).
const CASE_VAR: &str = "STEPPPO_TRAINING_CASE";
/// Set in a child process: the arm it times.
const ARM_VAR: &str = "STEPPPO_TRAINING_ARM";
const DEVICE_VAR: &str = "STEPPPO_BENCH_DEVICE";
const ARMS_VAR: &str = "STEPPPO_BENCH_ARMS";
const RUNS_VAR: &str = "STEPPPO_BENCH_RUNS";
const DIR_VAR: &str = "STEPPPO_BENCH_DIR";
const PYTHON_VAR: &str = "STEPPPO_TORCH_PYTHON";
const SCRIPT: &str = "scripts/torch_update_step.py";
/// Qwen2.5-0.5B's shape (its own vocabulary, tied embeddings).
const QWEN_05B: &str = "configs/models/qwen2.5-0.5b.json";
const QWEN_3B: &str = "configs/models/qwen2.5-3b.json";
const THREADS: [usize; 2] = [1, 2];
const GPU_ARMS: &str = "full+bf16 full+bf16+ckpt lora+bf16+ckpt";
/// The adapters of `lora` arms (the PyTorch script builds the same).
const LORA_RANK: usize = 16;
const LORA_ALPHA: f64 = 32.0;

/// What a case trains and how: LoRA or every weight, bf16 products, activation checkpointing.
#[derive(Clone, Copy, Debug)]
struct Arm {
    lora: bool,
    bf16: bool,
    checkpointing: bool,
}

impl Arm {
    /// `full` or `lora`, then any of `+bf16` and `+ckpt`.
    fn parse(name: &str) -> Arm {
        let mut parts = name.split('+');
        let lora = match parts.next() {
            Some("full") => false,
            Some("lora") => true,
            _ => panic!("{ARMS_VAR}: arm {name:?} must start with full or lora"),
        };
        let mut arm = Arm {
            lora,
            bf16: false,
            checkpointing: false,
        };
        for flag in parts {
            match flag {
                "bf16" => arm.bf16 = true,
                "ckpt" => arm.checkpointing = true,
                _ => panic!("{ARMS_VAR}: arm {name:?}: unknown part {flag:?} (bf16, ckpt)"),
            }
        }
        arm
    }

    fn dtype(self) -> DType {
        if self.bf16 {
            DType::BF16
        } else {
            DType::F32
        }
    }
}
const ENTROPY_COEF: f32 = 0.001;
const LR: f64 = 1e-5;

/// One benchmark shape: a model and the batch it is trained on.
struct Shape {
    name: &'static str,
    cfg: ModelConfig,
    batch: usize,
    len: usize,
}

/// The CPU's four shapes, or two real sizes on a GPU.
fn shapes(on_cpu: bool) -> Vec<Shape> {
    let shape_file = |file: &str| ModelConfig::from_file(Path::new(file)).expect(file);
    if !on_cpu {
        return vec![
            Shape {
                name: "qwen2.5_0.5b_16x1024",
                cfg: shape_file(QWEN_05B),
                batch: 16,
                len: 1024,
            },
            Shape {
                name: "qwen2.5_3b_8x1024",
                cfg: shape_file(QWEN_3B),
                batch: 8,
                len: 1024,
            },
        ];
    }
    let vocab = Tokenizer::builtin().vocab_size();
    let mut qwen_90m = ModelConfig::small(vocab);
    qwen_90m.hidden_size = 896;
    qwen_90m.num_hidden_layers = 6;
    qwen_90m.num_attention_heads = 14;
    qwen_90m.num_key_value_heads = 2;
    qwen_90m.intermediate_size = 4864;
    vec![
        Shape {
            name: "small_8x128",
            cfg: ModelConfig::small(vocab),
            batch: 8,
            len: 128,
        },
        Shape {
            name: "small_16x640",
            cfg: ModelConfig::small(vocab),
            batch: 16,
            len: 640,
        },
        Shape {
            name: "qwen2_90m_4x256",
            cfg: qwen_90m,
            batch: 4,
            len: 256,
        },
        Shape {
            name: "qwen2.5_0.5b_2x256",
            cfg: shape_file(QWEN_05B),
            batch: 2,
            len: 256,
        },
    ]
}

/// What both sides read: token ids, the response positions (flat into `[B, T]`) and their
/// targets, old log-probs and advantages `[B, R]`, and the optimiser's settings.
#[derive(Serialize, Deserialize)]
struct Inputs {
    input_ids: Vec<Vec<u32>>,
    positions: Vec<u32>,
    targets: Vec<u32>,
    old_logprobs: Vec<Vec<f32>>,
    advantages: Vec<Vec<f32>>,
    clip_low: f32,
    clip_high: f32,
    entropy_coef: f32,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    max_grad_norm: f64,
    runs: usize,
    /// `(m, k, n)` of the product whose rate each child measures.
    probe: (usize, usize, usize),
}

/// A child's report: the first step's loss, the timed steps' median, their peak memory and the
/// best rate of the probe product.
#[derive(Serialize, Deserialize)]
struct Report {
    first_loss: f64,
    median_ms: f64,
    peak_mib: Option<f64>,
    product_gflops: f64,
}

/// How often each child times the probe product; the best rate counts.
const PROBE_RUNS: usize = 5;

impl Shape {
    /// FLOPs of the matrix products of one update step of `arm`: the forward's (every
    /// projection at every token, the attention's scores and mixing over the causal half, the
    /// LM head at the response positions); as many again backward for the inputs' gradient, and
    /// for the weights' where every weight trains (LoRA's adapters are negligible); a second
    /// forward under activation checkpointing.
    fn product_flops(&self, arm: Arm) -> f64 {
        let c = &self.cfg;
        let (h, i, d) = (c.hidden_size, c.intermediate_size, c.head_dim());
        let (heads, kv) = (c.num_attention_heads, c.num_key_value_heads);
        let tokens = (self.batch * self.len) as f64;
        let weights_per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * i;
        let projections = 2.0 * tokens * (c.num_hidden_layers * weights_per_layer) as f64;
        let causal_pairs = (self.len * (self.len + 1) / 2 * self.batch) as f64;
        let attention = 2.0 * 2.0 * causal_pairs * (heads * d * c.num_hidden_layers) as f64;
        let head = 2.0 * (self.batch * (self.len / 2)) as f64 * (h * c.vocab_size) as f64;
        let passes = 2 + usize::from(!arm.lora) + usize::from(arm.checkpointing);
        passes as f64 * (projections + attention + head)
    }

    /// The probe product: the largest of the step, `[tokens, hidden] × [hidden, intermediate]`.
    fn probe(&self) -> (usize, usize, usize) {
        (
            self.batch * self.len,
            self.cfg.hidden_size,
            self.cfg.intermediate_size,
        )
    }
}

/// The best GFLOP/s of `PROBE_RUNS` products `[m, k] × [k, n]` in candle, in `dtype`.
fn probe_gflops((m, k, n): (usize, usize, usize), dev: &Device, dtype: DType) -> f64 {
    let operand = |rows, cols| {
        Tensor::rand(-1f32, 1f32, (rows, cols), dev)
            .and_then(|t| t.to_dtype(dtype))
            .unwrap()
    };
    let (a, b) = (operand(m, k), operand(k, n));
    let _ = a.matmul(&b).unwrap();
    dev.synchronize().unwrap();
    (0..PROBE_RUNS)
        .map(|_| {
            let start = Instant::now();
            let _ = a.matmul(&b).unwrap();
            dev.synchronize().unwrap();
            2.0 * (m * k * n) as f64 / start.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// A reproducible value in [0, 1) from two integers.
fn hash01(a: usize, b: usize) -> f32 {
    let mut x = (a as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (b as u64 + 0x632B_E59B);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    (x >> 40) as f32 / (1u64 << 24) as f32
}

fn inputs(shape: &Shape, runs: usize) -> Inputs {
    let (b_sz, len, vocab) = (shape.batch, shape.len, shape.cfg.vocab_size);
    let input_ids: Vec<Vec<u32>> = (0..b_sz)
        .map(|b| {
            (0..len)
                .map(|t| (hash01(b, t) * vocab as f32) as u32 % vocab as u32)
                .collect()
        })
        .collect();
    let response = len / 2;
    let start = len - response - 1;
    let mut positions = Vec::new();
    let mut targets = Vec::new();
    for (b, row) in input_ids.iter().enumerate() {
        for t in start..start + response {
            positions.push((b * len + t) as u32);
            targets.push(row[t + 1]);
        }
    }
    let uniform = -(vocab as f32).ln();
    let old_logprobs = (0..b_sz)
        .map(|b| {
            (0..response)
                .map(|r| uniform + 0.6 * (hash01(b + 1000, r) - 0.5))
                .collect()
        })
        .collect();
    let advantages = (0..b_sz)
        .map(|b| vec![2.0 * hash01(b, 7777) - 1.0; response])
        .collect();
    let loss = loss_config();
    let opt = OptimizerConfig::default();
    Inputs {
        input_ids,
        positions,
        targets,
        old_logprobs,
        advantages,
        clip_low: loss.clip_low(),
        clip_high: loss.clip_high(),
        entropy_coef: loss.entropy_loss_coef,
        lr: LR,
        betas: opt.betas,
        eps: opt.eps,
        weight_decay: opt.weight_decay,
        max_grad_norm: opt.max_grad_norm.expect("the default clips"),
        runs,
        probe: shape.probe(),
    }
}

fn loss_config() -> LossConfig {
    LossConfig {
        pg_clip_high: Some(0.28),
        entropy_loss_coef: ENTROPY_COEF,
        ..LossConfig::default()
    }
}

/// The tensors of one update on the device.
struct StepTensors {
    batch: PaddedBatch,
    positions: Tensor,
    targets: Tensor,
    old: Tensor,
    adv: Tensor,
    mask: Tensor,
}

impl StepTensors {
    fn new(x: &Inputs, dev: &Device) -> Self {
        let rows = |v: &[Vec<f32>]| {
            let (r, c) = (v.len(), v[0].len());
            Tensor::from_vec(v.concat(), (r, c), dev).unwrap()
        };
        let old = rows(&x.old_logprobs);
        Self {
            batch: PaddedBatch::right_padded(&x.input_ids, 0, dev).unwrap(),
            positions: Tensor::new(x.positions.as_slice(), dev).unwrap(),
            targets: Tensor::new(x.targets.as_slice(), dev).unwrap(),
            adv: rows(&x.advantages),
            mask: old.ones_like().unwrap(),
            old,
        }
    }
}

/// One actor update; returns its loss.
fn update_step(model: &Model, opt: &mut AdamW, x: &StepTensors, max_norm: f64) -> f64 {
    let (logp, entropy) = model
        .logprobs_entropy_at(
            &x.batch.input_ids,
            &x.batch.attention_mask,
            &x.positions,
            &x.targets,
            1.0,
            None,
        )
        .unwrap();
    let shape = x.old.shape();
    let (logp, entropy) = (
        logp.reshape(shape).unwrap(),
        entropy.reshape(shape).unwrap(),
    );
    let cfg = loss_config();
    let (loss, _) = policy_loss(&logp, &x.old, &x.adv, &x.mask, None, &entropy, &cfg).unwrap();
    let grads = stepppo::model::backward(&loss).unwrap();
    opt.step(&grads, LR, Some(max_norm)).unwrap();
    let loss = loss.to_dtype(DType::F64).unwrap().to_scalar().unwrap();
    // The optimizer's last kernels too, on a device that runs them asynchronously.
    x.old.device().synchronize().unwrap();
    loss
}

/// The case's model on `dev`, trained as `arm` says.
fn model_for(dir: &Path, arm: Arm, dev: &Device) -> Model {
    let mut model = Model::load(dir, dev).unwrap();
    if arm.lora {
        let spec = LoraSpec {
            rank: LORA_RANK,
            alpha: LORA_ALPHA,
            dropout: 0.0,
            target_modules: vec!["all-linear".into()],
        };
        let adapters = Adapters::fresh(model.config(), &spec, 11, dev, "bench").unwrap();
        model.attach_adapters(adapters).unwrap();
    }
    model.set_activation_checkpointing(arm.checkpointing);
    model.set_precision(if arm.bf16 {
        Precision::Bf16
    } else {
        Precision::F32
    });
    model
}

/// The child's work: load the case's model and inputs, time `runs` steps after one warm-up,
/// and the peak memory of the timed steps.
fn time_stepppo(dir: &Path, arm: Arm, dev: &Device) -> Report {
    let x: Inputs =
        serde_json::from_slice(&std::fs::read(dir.join("inputs.json")).unwrap()).unwrap();
    let model = model_for(dir, arm, dev);
    let mut opt = AdamW::new(model.trainable_vars(), &OptimizerConfig::default()).unwrap();
    let tensors = StepTensors::new(&x, dev);
    let first_loss = update_step(&model, &mut opt, &tensors, x.max_grad_norm);
    stepppo::device::reset_memory_peak(dev);
    let mut ms: Vec<f64> = (0..x.runs)
        .map(|_| {
            let start = Instant::now();
            update_step(&model, &mut opt, &tensors, x.max_grad_norm);
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    let peak_mib = stepppo::device::memory_peak(dev).map(|b| b as f64 / (1u64 << 20) as f64);
    Report {
        first_loss,
        median_ms: median(&mut ms),
        peak_mib,
        product_gflops: probe_gflops(x.probe, dev, arm.dtype()),
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The Python interpreter to use, if it imports torch and transformers (else why not).
fn torch_python() -> Result<String, String> {
    let python = std::env::var(PYTHON_VAR).unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", "import torch, transformers"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if ok {
        Ok(python)
    } else {
        Err(format!(
            "`{python}` cannot import torch and transformers (set {PYTHON_VAR} to a Python that can)"
        ))
    }
}

/// The PyTorch script: under the crate's source directory, or (for a bench binary copied to
/// another machine) under the working directory.
fn script_path() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join(SCRIPT);
    if built.exists() {
        built
    } else {
        PathBuf::from(SCRIPT)
    }
}

/// Runs one side of a case in a child process with `threads` threads and parses its report;
/// a child that fails (an out-of-memory, a missing library) gives the end of what it printed.
fn run_child(mut cmd: Command, threads: usize) -> Result<Report, String> {
    let out = cmd
        .env("RAYON_NUM_THREADS", threads.to_string())
        .env("OMP_NUM_THREADS", threads.to_string())
        .output()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().find_map(|l| l.strip_prefix("RESULT ")) {
        Some(json) if out.status.success() => serde_json::from_str(json).map_err(|e| e.to_string()),
        _ => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(4).collect();
            Err(format!(
                "{} ({})",
                out.status,
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            ))
        }
    }
}

/// The device the bench runs on (`STEPPPO_BENCH_DEVICE`: `cpu`, the default, `cuda` or `cuda:N`).
fn device_name() -> String {
    std::env::var(DEVICE_VAR).unwrap_or_else(|_| "cpu".into())
}

fn main() {
    let on_cpu = device_name().trim().eq_ignore_ascii_case("cpu");
    if let Ok(dir) = std::env::var(CASE_VAR) {
        // Before any other thread exists (a CUDA device starts its own).
        stepppo::device::prepare_cpu_process();
        let dev = stepppo::device::parse_device(&device_name())
            .unwrap_or_else(|e| panic!("{DEVICE_VAR}: {e}"));
        let arm = Arm::parse(&std::env::var(ARM_VAR).expect("a child is given its arm"));
        let report = time_stepppo(Path::new(&dir), arm, &dev);
        println!("RESULT {}", serde_json::to_string(&report).unwrap());
        return;
    }
    let default_arms = if on_cpu { "full" } else { GPU_ARMS };
    let arms = std::env::var(ARMS_VAR).unwrap_or_else(|_| default_arms.into());
    let threads: &[usize] = if on_cpu { &THREADS } else { &[1] };
    arms.split_whitespace().for_each(|arm| {
        Arm::parse(arm);
    });
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let runs = std::env::var(RUNS_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let python = torch_python();
    if let Err(why) = &python {
        println!("PyTorch side skipped: {why}");
    }
    let temp = tempfile::tempdir().unwrap();
    let root = std::env::var(DIR_VAR).map_or(temp.path().to_path_buf(), PathBuf::from);
    println!(
        "{:<20} {:<15} {:>3} {:>12} {:>12} {:>12} {:>12} {:>7} {:>10} {:>7} {:>11} {:>11} {:>10} {:>10}",
        "shape",
        "arm",
        "thr",
        "stepppo ms",
        "stepppo tok/s",
        "torch ms",
        "torch tok/s",
        "speed",
        "limit ms",
        "limit",
        "loss",
        "torch loss",
        "peak MiB",
        "torch MiB"
    );
    for shape in shapes(on_cpu) {
        if !filter.is_empty() && !filter.iter().any(|f| shape.name.contains(f.as_str())) {
            continue;
        }
        let dir = prepare(&shape, runs, &root);
        for arm in arms.split_whitespace() {
            for &threads in threads {
                bench_case(&shape, &dir, (arm, threads), python.as_ref().ok());
            }
        }
    }
}

/// Writes the shape's model directory and inputs; returns the directory.
fn prepare(shape: &Shape, runs: usize, root: &Path) -> PathBuf {
    let dir = root.join(shape.name);
    let model = Model::new(&shape.cfg, 0, &Device::Cpu).unwrap();
    model.save(&dir, None).unwrap();
    let x = inputs(shape, runs);
    std::fs::write(dir.join("inputs.json"), serde_json::to_vec(&x).unwrap()).unwrap();
    dir
}

fn bench_case(shape: &Shape, dir: &Path, (arm, threads): (&str, usize), python: Option<&String>) {
    let mut ours = Command::new(std::env::current_exe().unwrap());
    ours.env(CASE_VAR, dir).env(ARM_VAR, arm);
    let ours = match run_child(ours, threads) {
        Ok(report) => report,
        Err(why) => {
            println!(
                "{:<20} {arm:<15} {threads:>3} stepppo failed: {why}",
                shape.name
            );
            return;
        }
    };
    let parsed = Arm::parse(arm);
    let device = device_name();
    let theirs = python.and_then(|py| {
        let mut cmd = Command::new(py);
        cmd.arg(script_path()).arg(dir).arg(threads.to_string());
        cmd.args(["--device", &device, "--arm", arm]);
        run_child(cmd, threads)
            .map_err(|why| {
                println!(
                    "{:<20} {arm:<15} {threads:>3} PyTorch failed: {why}",
                    shape.name
                )
            })
            .ok()
    });
    let tokens = (shape.batch * shape.len) as f64;
    let rate = |ms: f64| tokens / (ms / 1e3);
    let fmt = |v: Option<f64>, digits: usize| v.map_or("-".into(), |v| format!("{v:.digits$}"));
    let best_gflops = theirs.as_ref().map_or(ours.product_gflops, |t| {
        t.product_gflops.max(ours.product_gflops)
    });
    let limit_ms = shape.product_flops(parsed) / (best_gflops * 1e9) * 1e3;
    println!(
        "{:<20} {:<15} {:>3} {:>12.1} {:>12.0} {:>12} {:>12} {:>7} {:>10.1} {:>7} {:>11.6} {:>11} {:>10} {:>10}",
        shape.name,
        arm,
        threads,
        ours.median_ms,
        rate(ours.median_ms),
        fmt(theirs.as_ref().map(|t| t.median_ms), 1),
        fmt(theirs.as_ref().map(|t| rate(t.median_ms)), 0),
        fmt(theirs.as_ref().map(|t| t.median_ms / ours.median_ms), 2),
        limit_ms,
        fmt(theirs.as_ref().map(|t| t.median_ms / limit_ms), 2),
        ours.first_loss,
        fmt(theirs.as_ref().map(|t| t.first_loss), 6),
        fmt(ours.peak_mib, 0),
        fmt(theirs.as_ref().and_then(|t| t.peak_mib), 0),
    );
    println!(
        "{:<20} {:<15} {:>3} products at {:.1} GFLOP/s (stepppo) / {} GFLOP/s (PyTorch) on {:?}; {:.1} GFLOP per step",
        "",
        "",
        "",
        ours.product_gflops,
        fmt(theirs.as_ref().map(|t| t.product_gflops), 1),
        shape.probe(),
        shape.product_flops(parsed) / 1e9,
    );
}
