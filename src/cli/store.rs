//! `stepppo collect`, `stepppo replay`, `stepppo dataset verify|repair`: argument parsing and
//! printing over `stepppo::store`.

use std::io::{BufWriter, Write};
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use stepppo::store::{self, Dataset};

#[derive(Args, Debug)]
pub struct CollectArgs {}

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

pub fn collect(_a: CollectArgs) -> anyhow::Result<()> {
    anyhow::bail!("`stepppo collect` is not built yet (issue 3)")
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
