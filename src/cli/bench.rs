//! `stepppo bench prefix`: the prefix-reuse workloads over the four cache arms, with the
//! built-in tokenizer and a freshly initialised model (built-in size or an HF config.json),
//! printed as a table or JSON lines. `stepppo bench kernels`: the CUDA decode kernel's achieved
//! bandwidth next to a device-to-device copy, or the prefill kernels' throughput side by side
//! (feature `cuda`; flash-attention's with `flash-attn`). `stepppo bench attention`: the
//! training forward's attention, fused CPU op against the matmul path, forward + backward.

use anyhow::Context;
use clap::{Args, Subcommand};

use stepppo::model::{Model, ModelConfig};
use stepppo::rollout::engine::EngineConfig;
use stepppo::rollout::workload::{compare_arms, ArmReport, Workload};
use stepppo::tokenizer::Tokenizer;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Prefix-reuse workloads over the four cache arms (none, per_traj, group_prompt, radix).
    Prefix(PrefixArgs),
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

#[cfg(feature = "cuda")]
mod kernels {
    //! Attention over the KV pool on the GPU. Decode: bytes of K and V the kernel must read per
    //! call, divided by its time, next to the bandwidth of a plain device-to-device copy.
    //! Prefill: our paged kernel and flash-attention on the same pool and queries, their times,
    //! causal attention FLOP/s and largest difference.

    use std::time::Instant;

    use anyhow::Context;
    use candle_core::{DType, Device, Tensor};
    use stepppo::kv::{KvPool, PrefillAttention, SeqSlots};
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
        let mut cfg = model_config(&a.model, &Tokenizer::builtin())?;
        cfg.num_hidden_layers = 1;
        if let Some(hd) = a.head_dim {
            cfg.head_dim = Some(hd);
        }
        let dtype = a.dtype.dtype();
        let slots_total = a.batch * a.context;
        let mut pool = KvPool::with_dtype(&cfg, slots_total, &device, dtype)?;
        let all: Vec<u32> = pool.alloc(slots_total).context("pool allocation")?;
        let bench = Bench {
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            hd: cfg.head_dim(),
            dtype,
            device,
        };
        fill_pool(&mut pool, &all, &bench)?;
        let report = match a.prefill {
            None => decode(&pool, &all, &a, &bench)?,
            Some(new) => prefill(&mut pool, &all, new, &a, &bench)?,
        };
        if a.json {
            println!("{report}");
        } else {
            println!("{}", text(&report, &a));
        }
        Ok(())
    }

    /// The shape and device of one measurement.
    struct Bench {
        heads: usize,
        kv_heads: usize,
        hd: usize,
        dtype: DType,
        device: Device,
    }

    /// Decode: every sequence brings one token; bytes of K/V read over time, against a copy.
    fn decode(
        pool: &KvPool,
        all: &[u32],
        a: &KernelArgs,
        b: &Bench,
    ) -> anyhow::Result<serde_json::Value> {
        let seqs: Vec<SeqSlots> = all
            .chunks(a.context)
            .map(|slots| SeqSlots { slots, num_new: 1 })
            .collect();
        let scale = 1.0 / (b.hd as f32).sqrt();
        let plan = pool.plan(&seqs, scale)?;
        let q = Tensor::randn(0f32, 1.0, (a.batch, b.heads, b.hd), &b.device)?.to_dtype(b.dtype)?;
        let decode_s = time(&b.device, a.iters, || {
            Ok(pool.attend_rows(0, &q, &plan, b.heads, scale)?)
        })?;
        // What decode must read: every K and V row once.
        let kv_bytes = 2.0 * (all.len() * b.kv_heads * b.hd * b.dtype.size_in_bytes()) as f64;
        let copy_src = Tensor::zeros(all.len() * b.kv_heads * b.hd * 2, DType::BF16, &b.device)?;
        let copy_s = time(&b.device, a.iters, || Ok(copy_src.copy()?))?;
        let copy_bytes = 2.0 * (copy_src.elem_count() * 2) as f64;
        let decode_gbs = kv_bytes / decode_s / 1e9;
        let copy_gbs = copy_bytes / copy_s / 1e9;
        Ok(serde_json::json!({
            "batch": a.batch, "context": a.context, "q_heads": b.heads, "kv_heads": b.kv_heads,
            "head_dim": b.hd, "dtype": a.dtype.to_string(),
            "decode_ms": decode_s * 1e3, "decode_gb_s": decode_gbs, "copy_gb_s": copy_gbs,
            "fraction_of_copy": decode_gbs / copy_gbs,
        }))
    }

    /// Prefill: each sequence's last `new` tokens attend over its whole context, through our
    /// kernel and (built with `flash-attn`, bf16) flash-attention, the same inputs for both.
    fn prefill(
        pool: &mut KvPool,
        all: &[u32],
        new: usize,
        a: &KernelArgs,
        b: &Bench,
    ) -> anyhow::Result<serde_json::Value> {
        let seqs: Vec<SeqSlots> = all
            .chunks(a.context)
            .map(|slots| SeqSlots {
                slots,
                num_new: new,
            })
            .collect();
        let scale = 1.0 / (b.hd as f32).sqrt();
        let q = Tensor::randn(0f32, 1.0, (a.batch * new, b.heads, b.hd), &b.device)?
            .to_dtype(b.dtype)?;
        // Score and weighted-sum FLOPs of the causal part each new token sees.
        let keys_seen: usize = (0..new).map(|i| a.context - new + i + 1).sum();
        let flops = 4.0 * (a.batch * keys_seen * b.heads * b.hd) as f64;
        let mut report = serde_json::json!({
            "batch": a.batch, "context": a.context, "new": new, "q_heads": b.heads,
            "kv_heads": b.kv_heads, "head_dim": b.hd, "dtype": a.dtype.to_string(),
        });
        let mut paged_out = None;
        for kernel in [PrefillAttention::Paged, PrefillAttention::Flash] {
            if !kernel.compiled() || (kernel == PrefillAttention::Flash && b.dtype != DType::BF16) {
                continue;
            }
            pool.set_prefill_attention(kernel)?;
            let plan = pool.plan(&seqs, scale)?;
            let out = pool.attend_rows(0, &q, &plan, b.heads, scale)?;
            let s = time(&b.device, a.iters, || {
                Ok(pool.attend_rows(0, &q, &plan, b.heads, scale)?)
            })?;
            let name = kernel.name();
            report[format!("{name}_ms")] = (s * 1e3).into();
            report[format!("{name}_tflop_s")] = (flops / s / 1e12).into();
            match &paged_out {
                None => paged_out = Some(out),
                Some(paged) => {
                    let diff = (out.to_dtype(DType::F32)? - paged.to_dtype(DType::F32)?)?
                        .abs()?
                        .max_all()?
                        .to_scalar::<f32>()?;
                    report[format!("{name}_max_abs_diff_vs_paged")] = diff.into();
                }
            }
        }
        if let (Some(p), Some(f)) = (report.get("paged_ms"), report.get("flash_ms")) {
            let speedup = p.as_f64().unwrap_or(0.0) / f.as_f64().unwrap_or(f64::INFINITY);
            report["flash_speedup"] = speedup.into();
        }
        Ok(report)
    }

    /// The report as one line of text.
    fn text(r: &serde_json::Value, a: &KernelArgs) -> String {
        let f = |k: &str| r.get(k).and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
        let shape = format!(
            "batch {} × context {} ({} q / {} kv heads, head_dim {})",
            a.batch, a.context, r["q_heads"], r["kv_heads"], r["head_dim"]
        );
        match a.prefill {
            None => format!(
                "decode {}: {shape}: {:.3} ms, {:.0} GB/s; device copy {:.0} GB/s; {:.0}% of copy",
                a.dtype,
                f("decode_ms"),
                f("decode_gb_s"),
                f("copy_gb_s"),
                100.0 * f("fraction_of_copy")
            ),
            Some(new) => {
                let flash = if r.get("flash_ms").is_some() {
                    format!(
                        "flash {:.3} ms ({:.1} TFLOP/s, max |diff| {:.2e}); flash {:.2}× paged",
                        f("flash_ms"),
                        f("flash_tflop_s"),
                        f("flash_max_abs_diff_vs_paged"),
                        f("flash_speedup")
                    )
                } else {
                    "flash not run (needs the `flash-attn` feature and --dtype bf16)".into()
                };
                format!(
                    "prefill {} of {new} new tokens: {shape}: paged {:.3} ms ({:.1} TFLOP/s); {flash}",
                    a.dtype,
                    f("paged_ms"),
                    f("paged_tflop_s"),
                )
            }
        }
    }

    /// Random K/V rows in every slot, written through the scatter kernel.
    fn fill_pool(pool: &mut KvPool, slots: &[u32], b: &Bench) -> anyhow::Result<()> {
        let (kv_heads, hd, dtype, dev) = (b.kv_heads, b.hd, b.dtype, &b.device);
        for chunk in slots.chunks(1 << 16) {
            let seq = [SeqSlots {
                slots: chunk,
                num_new: chunk.len(),
            }];
            let plan = pool.plan(&seq, 1.0)?;
            let k = Tensor::randn(0f32, 1.0, (chunk.len(), kv_heads, hd), dev)?.to_dtype(dtype)?;
            let v = Tensor::randn(0f32, 1.0, (chunk.len(), kv_heads, hd), dev)?.to_dtype(dtype)?;
            pool.write_rows(0, &plan, &k, &v)?;
        }
        Ok(())
    }

    /// Mean seconds per call after a warm-up call, with the device synchronised around the loop.
    fn time(
        dev: &Device,
        iters: usize,
        mut f: impl FnMut() -> anyhow::Result<Tensor>,
    ) -> anyhow::Result<f64> {
        f()?;
        dev.synchronize()?;
        let start = Instant::now();
        for _ in 0..iters.max(1) {
            f()?;
        }
        dev.synchronize()?;
        Ok(start.elapsed().as_secs_f64() / iters.max(1) as f64)
    }
}

#[cfg(not(feature = "cuda"))]
mod kernels {
    use super::KernelArgs;

    pub fn run(a: KernelArgs) -> anyhow::Result<()> {
        Err(stepppo::device::parse_device(&a.device)
            .err()
            .map(anyhow::Error::from)
            .unwrap_or_else(|| {
                anyhow::anyhow!("`bench kernels` measures CUDA kernels: pass --device cuda")
            }))
    }
}
