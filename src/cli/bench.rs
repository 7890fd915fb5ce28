//! `stepppo bench prefix`: the prefix-reuse workloads over the four cache arms and radix
//! without cascade attention, with the built-in tokenizer and a freshly initialised model
//! (built-in size or an HF config.json), printed as a table or JSON lines. `stepppo bench
//! kernels`: the CUDA decode kernel's achieved bandwidth next to a device-to-device copy, or the
//! prefill kernels' throughput side by side (feature `cuda`; flash-attention's with
//! `flash-attn`). `stepppo bench attention`: the
//! training forward's attention, fused CPU op against the matmul path, forward + backward.

use anyhow::Context;
use clap::{Args, Subcommand};

use stepppo::model::{Model, ModelConfig};
use stepppo::rollout::engine::Engine;
use stepppo::rollout::engine::EngineConfig;
use stepppo::rollout::workload::{
    compare_arms, read_bandwidth, run_workload, ArmReport, DecodeReport, Workload,
};
use stepppo::tokenizer::Tokenizer;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Prefix-reuse workloads over the four cache arms (none, per_traj, group_prompt, radix),
    /// and radix without cascade attention (radix_no_cascade).
    Prefix(PrefixArgs),
    /// Decode of a group sharing one long prompt, with and without cascade attention, each
    /// beside its memory-traffic limit (the CPU's read bandwidth, or a CUDA device's copy
    /// bandwidth).
    Decode(DecodeArgs),
    /// CUDA decode-attention bandwidth against a device copy, or (`--prefill N`) prefill
    /// attention, ours next to flash-attention (needs `--features cuda` and a GPU).
    Kernels(KernelArgs),
    /// Training attention on CPU: the fused causal op against the matmul path, forward + backward.
    Attention(AttentionArgs),
}

#[derive(Args, Debug)]
pub struct AttentionArgs {
    /// Sequences in the batch.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Padded length; real lengths are spread evenly over [len/2, len] (right padding).
    #[arg(long, default_value_t = 640)]
    len: usize,
    /// Model shape (heads, kv heads, head size): `tiny`, `small` or an HF config.json.
    #[arg(long, default_value = "small")]
    model: String,
    /// Timed repetitions of each implementation (after one warm-up).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct KernelArgs {
    /// Sequences decoded together.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Context length of every sequence (its new tokens included).
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Measure prefill instead of decode: each sequence brings this many new tokens (the last
    /// of its context), run by our paged kernel and, in a build with `flash-attn`, by
    /// candle-flash-attn side by side.
    #[arg(long)]
    prefill: Option<usize>,
    /// Model shape: `tiny`, `small` or an HF config.json (default: Qwen2.5-0.5B's shape).
    #[arg(long, default_value = "configs/models/qwen2.5-0.5b.json")]
    model: String,
    /// Head dimension instead of the model's (32, 64 or 128), its head counts kept.
    #[arg(long)]
    head_dim: Option<usize>,
    /// The pool's dtype: `bf16` or `f32`.
    #[arg(long, default_value = "bf16")]
    dtype: stepppo::model::Precision,
    /// Timed repetitions.
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// `cuda` or `cuda:N`.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct DecodeArgs {
    /// Model shape: built-in `tiny` or `small`, or an HF config.json (random weights).
    #[arg(long, default_value = "small")]
    model: String,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Sequences sharing the prompt (G).
    #[arg(long, default_value_t = 16)]
    group: usize,
    /// Prompt tokens (P).
    #[arg(long, default_value_t = 4096)]
    prompt: usize,
    /// Tokens each sequence generates.
    #[arg(long, default_value_t = 64)]
    new: usize,
    /// Seed of the model weights, the prompt and sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// One JSON object per line per arm.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct PrefixArgs {
    /// One JSON object per line per workload and arm.
    #[arg(long)]
    json: bool,
    /// Model shape: built-in `tiny` or `small`, or an HF config.json (random weights).
    #[arg(long, default_value = "small")]
    model: String,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Run only these workloads (repeatable); default: all standard ones.
    #[arg(long = "workload")]
    workloads: Vec<String>,
    /// A custom workload `NAME:groups,G,T,P,O,R` (repeatable), e.g. `gpu_group:8,8,4,1024,64,64`.
    #[arg(long = "spec")]
    specs: Vec<String>,
    /// Seed of the model weights, prompts and sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Prefill attention on CUDA: `paged` (ours) or `flash` (candle-flash-attn; a build with
    /// the `flash-attn` feature and a bf16 model).
    #[arg(long, default_value = "paged")]
    prefill_attention: stepppo::kv::PrefillAttention,
}

pub fn run(c: BenchCommand) -> anyhow::Result<()> {
    match c {
        BenchCommand::Prefix(a) => prefix(a),
        BenchCommand::Decode(a) => decode(a),
        BenchCommand::Kernels(a) => kernels::run(a),
        BenchCommand::Attention(a) => attention(a),
    }
}

/// A model shape by built-in name or config.json path.
fn model_config(name: &str, tok: &Tokenizer) -> anyhow::Result<ModelConfig> {
    match ModelConfig::named(name, tok) {
        Some(cfg) => Ok(cfg),
        None => ModelConfig::from_file(name.as_ref()).with_context(|| {
            format!("--model `{name}`: expected tiny, small or an HF config.json")
        }),
    }
}

fn prefix(a: PrefixArgs) -> anyhow::Result<()> {
    let tok = Tokenizer::builtin();
    let cfg = model_config(&a.model, &tok)?;
    let device = stepppo::device::parse_device(&a.device)?;
    let started = std::time::Instant::now();
    let model = Model::new(&cfg, a.seed, &device)?;
    eprintln!(
        "initialised {} on {} in {:.1} s",
        a.model,
        a.device,
        started.elapsed().as_secs_f64()
    );
    let mut workloads = if a.specs.is_empty() || !a.workloads.is_empty() {
        selected(&a.workloads)?
    } else {
        Vec::new()
    };
    for spec in &a.specs {
        workloads.push(parse_spec(spec)?);
    }
    if !a.json {
        println!("{}", ArmReport::table_header());
    }
    let mut print = |r: &ArmReport| {
        if a.json {
            println!("{}", serde_json::to_string(r).expect("a report serialises"));
        } else {
            println!("{}", r.table_row());
        }
    };
    for w in &workloads {
        compare_arms(
            &model,
            &tok,
            w,
            &EngineConfig {
                prefill_attention: a.prefill_attention,
                ..EngineConfig::default()
            },
            a.seed,
            &mut print,
        )
        .with_context(|| format!("workload `{}`", w.name))?;
    }
    Ok(())
}

fn decode(a: DecodeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.group > 0 && a.prompt > 0 && a.new > 1,
        "--group and --prompt must be positive, --new at least 2"
    );
    let tok = Tokenizer::builtin();
    let cfg = model_config(&a.model, &tok)?;
    let device = stepppo::device::parse_device(&a.device)?;
    let model = Model::new(&cfg, a.seed, &device)?;
    let name = format!("g{}_p{}", a.group, a.prompt);
    let w = Workload::new(&name, 1, a.group, 1, a.prompt, 1, a.new);
    let bandwidth = match device.is_cpu() {
        true => read_bandwidth(),
        false => stepppo::kv::kernel_bench::copy_bandwidth(&device)?,
    };
    for cascade_attention in [true, false] {
        let engine_cfg = EngineConfig {
            cascade_attention,
            ..EngineConfig::default()
        };
        let mut engine = Engine::for_model(&model, engine_cfg)?;
        let run = run_workload(&mut engine, &model, &tok, &w, a.seed)?;
        let r = DecodeReport::new(&w, &model, &run, cascade_attention, bandwidth);
        if a.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            println!(
                "{name} {} cascade: decode {:.0} tokens/s over {:.2} s; limit {:.0} tokens/s \
                 ({:.2}×) from {:.1} MB weights + {:.1} MB K/V read at {:.1} GB/s",
                if cascade_attention { "with" } else { "without" },
                r.tokens_per_s,
                r.decode_s,
                r.traffic_limit_tokens_per_s,
                r.tokens_per_s / r.traffic_limit_tokens_per_s,
                r.weight_bytes / 1e6,
                r.kv_bytes / 1e6,
                r.bandwidth / 1e9,
            );
        }
    }
    Ok(())
}

fn attention(a: AttentionArgs) -> anyhow::Result<()> {
    use candle_core::{Device, Tensor, Var};
    use stepppo::model::attention::TrainingAttention;

    anyhow::ensure!(
        a.batch > 0 && a.len > 1 && a.iters > 0,
        "--batch, --len and --iters must be positive (--len ≥ 2)"
    );
    let cfg = model_config(&a.model, &Tokenizer::builtin())?;
    let (heads, kv, d) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim(),
    );
    let real: Vec<Vec<u32>> = (0..a.batch)
        .map(|b| {
            let n = a.len / 2 + (a.len - a.len / 2) * (b + 1) / a.batch;
            (0..a.len).map(|t| u32::from(t < n)).collect()
        })
        .collect();
    let var = |h: usize| Var::randn(0f32, 1.0, (a.batch, h, a.len, d), &Device::Cpu);
    let (q, k, v) = (var(heads)?, var(kv)?, var(kv)?);
    let scale = 1.0 / (d as f64).sqrt();
    let mut millis = Vec::new();
    for imp in [TrainingAttention::Matmul, TrainingAttention::Fused] {
        let run = || -> anyhow::Result<()> {
            let out: Tensor = imp.forward(&q, &k, &v, &real, scale)?;
            out.sum_all()?.backward()?;
            Ok(())
        };
        run()?;
        let start = std::time::Instant::now();
        for _ in 0..a.iters {
            run()?;
        }
        millis.push(start.elapsed().as_secs_f64() * 1e3 / a.iters as f64);
    }
    // Score and value products of the full T×T square (matmul path) and of the causal triangle.
    let full = (a.batch * heads * a.len * a.len * d) as f64;
    let causal = full * (a.len + 1) as f64 / (2 * a.len) as f64;
    let report = serde_json::json!({
        "batch": a.batch, "len": a.len, "heads": heads, "kv_heads": kv, "head_dim": d,
        "matmul_ms": millis[0], "fused_ms": millis[1], "speedup": millis[0] / millis[1],
        "flop_ratio": full / causal,
    });
    if a.json {
        println!("{report}");
    } else {
        println!(
            "attention fwd+bwd, batch {} × len {} (heads {heads}/{kv}, head_dim {d}): matmul {:.1} ms, fused {:.1} ms, speedup {:.2}× (the causal triangle alone would give {:.2}× at equal FLOP rate)",
            a.batch, a.len, millis[0], millis[1], millis[0] / millis[1], full / causal
        );
    }
    Ok(())
}

/// `NAME:groups,G,T,P,O,R` → a workload.
fn parse_spec(spec: &str) -> anyhow::Result<Workload> {
    let bad = || format!("--spec `{spec}`: expected NAME:groups,G,T,P,O,R with positive integers");
    let (name, numbers) = spec.split_once(':').with_context(bad)?;
    let n: Vec<usize> = numbers
        .split(',')
        .map(|x| x.trim().parse::<usize>().ok().filter(|&v| v > 0))
        .collect::<Option<_>>()
        .with_context(bad)?;
    anyhow::ensure!(n.len() == 6 && !name.is_empty(), bad());
    Ok(Workload::new(name, n[0], n[1], n[2], n[3], n[4], n[5]))
}

fn selected(names: &[String]) -> anyhow::Result<Vec<Workload>> {
    let all = Workload::standard();
    if names.is_empty() {
        return Ok(all);
    }
    names
        .iter()
        .map(|n| {
            all.iter().find(|w| &w.name == n).cloned().with_context(|| {
                let known: Vec<&str> = all.iter().map(|w| w.name.as_str()).collect();
                format!("--workload `{n}`: unknown (known: {})", known.join(", "))
            })
        })
        .collect()
}

mod kernels {
    //! `bench kernels`: the pool's attention kernels timed on the GPU ([`kernel_bench`]), printed
    //! as one line or one JSON object.

    use stepppo::kv::kernel_bench::{self, KernelShape};
    use stepppo::tokenizer::Tokenizer;

    use super::{model_config, KernelArgs};

    pub fn run(a: KernelArgs) -> anyhow::Result<()> {
        let device = stepppo::device::parse_device(&a.device)?;
        anyhow::ensure!(
            device.is_cuda(),
            "`bench kernels` measures CUDA kernels: pass --device cuda"
        );
        if let Some(n) = a.prefill {
            anyhow::ensure!(
                (1..=a.context).contains(&n),
                "--prefill {n}: between 1 and --context {}",
                a.context
            );
        }
        let cfg = model_config(&a.model, &Tokenizer::builtin())?;
        let shape = KernelShape {
            batch: a.batch,
            context: a.context,
            q_heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: a.head_dim.unwrap_or(cfg.head_dim()),
            dtype: a.dtype.dtype(),
            iters: a.iters,
        };
        let mut report = serde_json::json!({
            "batch": a.batch, "context": a.context, "q_heads": shape.q_heads,
            "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "dtype": a.dtype.to_string(),
        });
        let line = match a.prefill {
            None => {
                let d = kernel_bench::decode(&shape, &device)?;
                extend(&mut report, serde_json::to_value(&d)?);
                format!(
                    "decode {}: {}: {:.3} ms, {:.0} GB/s; device copy {:.0} GB/s; {:.0}% of copy",
                    a.dtype,
                    shape_text(&shape),
                    d.decode_ms,
                    d.decode_gb_s,
                    d.copy_gb_s,
                    100.0 * d.fraction_of_copy
                )
            }
            Some(new) => {
                let p = kernel_bench::prefill(&shape, new, &device)?;
                let mut parts = Vec::new();
                for k in &p.kernels {
                    let name = k.kernel;
                    report[format!("{name}_ms")] = k.ms.into();
                    report[format!("{name}_tflop_s")] = k.tflop_s.into();
                    if name != "paged" {
                        let diff = format!("{name}_max_abs_diff_vs_paged");
                        report[diff] = k.max_abs_diff_vs_paged.into();
                    }
                    parts.push(format!(
                        "{name} {:.3} ms ({:.1} TFLOP/s, max |diff| {:.2e})",
                        k.ms, k.tflop_s, k.max_abs_diff_vs_paged
                    ));
                }
                report["new"] = new.into();
                if let (Some(p), Some(f)) = (report.get("paged_ms"), report.get("flash_ms")) {
                    let speedup = p.as_f64().unwrap_or(0.0) / f.as_f64().unwrap_or(f64::INFINITY);
                    report["flash_speedup"] = speedup.into();
                    parts.push(format!("flash {speedup:.2}× paged"));
                } else {
                    parts.push(
                        "flash not run (needs the `flash-attn` feature and --dtype bf16)".into(),
                    );
                }
                format!(
                    "prefill {} of {new} new tokens: {}: {}",
                    a.dtype,
                    shape_text(&shape),
                    parts.join("; ")
                )
            }
        };
        if a.json {
            println!("{report}");
        } else {
            println!("{line}");
        }
        Ok(())
    }

    fn shape_text(s: &KernelShape) -> String {
        format!(
            "batch {} × context {} ({} q / {} kv heads, head_dim {})",
            s.batch, s.context, s.q_heads, s.kv_heads, s.head_dim
        )
    }

    fn extend(report: &mut serde_json::Value, more: serde_json::Value) {
        if let (Some(out), serde_json::Value::Object(more)) = (report.as_object_mut(), more) {
            out.extend(more);
        }
    }
}
