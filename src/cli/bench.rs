//! `stepppo bench prefix`: the prefix-reuse workloads over the four cache arms, with the
//! built-in tokenizer and a freshly initialised built-in model, printed as a table or JSON lines.

use anyhow::Context;
use candle_core::Device;
use clap::{Args, Subcommand};

use stepppo::model::{Model, ModelConfig};
use stepppo::rollout::engine::EngineConfig;
use stepppo::rollout::workload::{compare_arms, ArmReport, Workload};
use stepppo::tokenizer::Tokenizer;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Prefix-reuse workloads over the four cache arms (none, per_traj, group_prompt, radix).
    Prefix(PrefixArgs),
}

#[derive(Args, Debug)]
pub struct PrefixArgs {
    /// One JSON object per line per workload and arm.
    #[arg(long)]
    json: bool,
    /// Built-in model size (`tiny` or `small`).
    #[arg(long, default_value = "small")]
    model: String,
    /// Run only these workloads (repeatable); default: all.
    #[arg(long = "workload")]
    workloads: Vec<String>,
    /// Seed of the model weights, prompts and sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(c: BenchCommand) -> anyhow::Result<()> {
    match c {
        BenchCommand::Prefix(a) => prefix(a),
    }
}

fn prefix(a: PrefixArgs) -> anyhow::Result<()> {
    let tok = Tokenizer::builtin();
    let cfg = ModelConfig::named(&a.model, &tok)
        .with_context(|| format!("--model `{}`: expected tiny or small", a.model))?;
    let model = Model::new(&cfg, a.seed, &Device::Cpu)?;
    let workloads = selected(&a.workloads)?;
    if !a.json {
        println!("{}", header());
    }
    for w in &workloads {
        let rows = compare_arms(&model, &tok, w, &EngineConfig::default(), a.seed)
            .with_context(|| format!("workload `{}`", w.name))?;
        for r in &rows {
            if a.json {
                println!("{}", serde_json::to_string(r)?);
            } else {
                println!("{}", table_row(r));
            }
        }
    }
    Ok(())
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

fn header() -> String {
    format!(
        "{:<18} {:<12} {:>3} {:>2} {:>9} {:>9} {:>9} {:>6} {:>9} {:>9} {:>8} {:>7} {:>7}",
        "workload",
        "arm",
        "G",
        "T",
        "requested",
        "prefilled",
        "cached",
        "hit",
        "min X",
        "stateless",
        "wall_s",
        "speedup",
        "flop×"
    )
}

fn table_row(r: &ArmReport) -> String {
    format!(
        "{:<18} {:<12} {:>3} {:>2} {:>9} {:>9} {:>9} {:>5.1}% {:>9} {:>9} {:>8.3} {:>6.2}× {:>6.2}×",
        r.workload,
        r.arm,
        r.group_size,
        r.turns,
        r.prompt_tokens,
        r.tokens_prefilled,
        r.tokens_from_cache,
        100.0 * r.hit_ratio,
        r.theoretical_min,
        r.stateless_total,
        r.wall_s,
        r.speedup_vs_none,
        r.flop_ratio_vs_none
    )
}
