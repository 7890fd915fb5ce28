//! `stepppo collect`, `stepppo replay`, `stepppo dataset verify|repair`: argument parsing and
//! printing over `stepppo::store`.

use std::io::{BufWriter, Write};
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use stepppo::env::{self, AgentKind};
use stepppo::store::{self, Dataset};
use stepppo::tokenizer::Tokenizer;

#[derive(Args, Debug)]
pub struct CollectArgs {
    /// Environment (see `stepppo env list`).
    #[arg(long)]
    pub env: String,
    /// Model-free agent: random or oracle.
    #[arg(long, value_parser = parse_agent)]
    pub agent: AgentKind,
    /// Trajectories to collect in total.
    #[arg(long)]
    pub episodes: u64,
    /// Same-seed trajectories per group.
    #[arg(long, default_value_t = 1)]
    pub group_size: u64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Env or protocol setting; the value is read as JSON when it parses, else as a string.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Dataset directory to create.
    #[arg(long)]
    pub out: PathBuf,
    /// Segment size at which the writer rolls to a new segment.
    #[arg(long, default_value_t = store::DEFAULT_ROLL_BYTES)]
    pub roll_bytes: u64,
}

fn parse_agent(s: &str) -> Result<AgentKind, String> {
    s.parse()
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ReplayFormat {
    /// Readable transcript per trajectory.
    Text,
    /// One JSON object per step (fields: see `stepppo::store` replay docs).
    Jsonl,
}

#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// Dataset directory.
    pub dataset: PathBuf,
    /// Only this trajectory (found through the segment index).
    #[arg(long)]
    pub traj: Option<u64>,
    #[arg(long, value_enum, default_value_t = ReplayFormat::Text)]
    pub format: ReplayFormat,
    /// Print statistics (trajectories, steps, success rate, reward, steps per trajectory, per env).
    #[arg(long)]
    pub stats: bool,
    /// With --stats: print one JSON object.
    #[arg(long, requires = "stats")]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum DatasetCommand {
    /// Check every segment of a dataset; exits non-zero listing every problem (file, offset).
    Verify { dataset: PathBuf },
    /// Truncate torn tails, rewrite damaged segments with their valid records, rebuild the manifest.
    Repair { dataset: PathBuf },
}

pub fn collect(a: CollectArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.group_size >= 1, "--group-size must be at least 1");
    let mut env_config = serde_json::Map::new();
    for pair in &a.set {
        let (key, value) =
            env::parse_set(pair).with_context(|| format!("--set `{pair}`: expected KEY=VALUE"))?;
        env_config.insert(key, value);
    }
    let cfg = store::CollectConfig {
        env: a.env,
        env_config: serde_json::Value::Object(env_config),
        agent: a.agent,
        episodes: a.episodes,
        group_size: a.group_size,
        seed: a.seed,
    };
    let tokenizer = Tokenizer::builtin();
    let opts = store::WriterOptions {
        roll_bytes: a.roll_bytes,
        metadata: cfg.metadata(&tokenizer).into_iter().collect(),
        ..store::WriterOptions::default()
    };
    let mut writer = store::DatasetWriter::create(&a.out, opts)?;
    let summary = store::collect(&cfg, &tokenizer, &mut writer)?;
    writer.seal()?;
    println!(
        "{}: {} trajectories, {} steps, {} successes",
        a.out.display(),
        summary.trajectories,
        summary.steps,
        summary.successes
    );
    Ok(())
}

fn warn_problems(dataset: &Dataset) {
    for problem in dataset.problems() {
        eprintln!("warning: {problem}");
    }
}

pub fn replay(a: ReplayArgs) -> anyhow::Result<()> {
    let dataset = Dataset::open(&a.dataset)?;
    warn_problems(&dataset);
    let stdout = std::io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    if a.stats {
        let stats = store::DatasetStats::compute(&dataset)?;
        match a.json {
            true => writeln!(out, "{}", serde_json::to_string(&stats)?)?,
            false => write!(out, "{stats}")?,
        }
        return Ok(out.flush()?);
    }
    let trajectories = match a.traj {
        Some(id) => vec![dataset
            .trajectory(id)
            .with_context(|| format!("{}: no trajectory {id}", a.dataset.display()))?],
        None => dataset.trajectories(),
    };
    for traj in &trajectories {
        match a.format {
            ReplayFormat::Text => writeln!(out, "{}", store::transcript(traj)?)?,
            ReplayFormat::Jsonl => {
                for record in store::decode_trajectory(traj)? {
                    writeln!(out, "{}", store::jsonl_line(&record)?)?;
                }
            }
        }
    }
    Ok(out.flush()?)
}

pub fn dataset(c: DatasetCommand) -> anyhow::Result<()> {
    match c {
        DatasetCommand::Verify { dataset } => {
            let report = store::verify(&dataset)?;
            for problem in &report.problems {
                println!("{problem}");
            }
            let (segments, records) = (report.segments, report.records);
            match report.problems.len() {
                0 => println!("{}: sound ({segments} segments, {records} records)", dataset.display()),
                n => anyhow::bail!(
                    "{}: {n} problem(s) ({segments} segments, {records} valid records); `stepppo dataset repair` fixes them",
                    dataset.display()
                ),
            }
            Ok(())
        }
        DatasetCommand::Repair { dataset } => {
            let report = store::repair(&dataset)?;
            for action in &report.actions {
                println!("{action}");
            }
            if report.actions.is_empty() {
                println!("{}: nothing to repair", dataset.display());
            }
            println!("{} records readable", report.records);
            Ok(())
        }
    }
}
