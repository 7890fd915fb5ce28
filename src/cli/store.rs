//! `stepppo collect`, `stepppo replay`, `stepppo dataset verify|repair`: argument parsing and
//! printing over `stepppo::store`; `replay --advantages` re-scores a dataset with
//! `stepppo::algo` (critic values from `--critic`, else zero values, said on stderr).
//!
//! `replay` reads what a damaged dataset still holds: records that do not decode are skipped,
//! and stderr says how many and where (file and byte offset of the first few) along with the
//! damage found at open; it exits 0 unless `--strict` is given and something was damaged.
//! A trajectory that lost a step that way is marked incomplete, and `--stats` / `--advantages`
//! leave it out and say so, as they do with open trajectories.

use std::collections::HashMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::Device;
use clap::{Args, Subcommand, ValueEnum};
use stepppo::algo::{self, AdvantageConfig};
use stepppo::env::{self, AgentKind};
use stepppo::interchange;
use stepppo::model::Critic;
use stepppo::store::{self, Dataset, Trajectory};
use stepppo::tokenizer::Tokenizer;
use stepppo::train::learner::scoring::score_records;
use stepppo::view::Source;

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
    /// Env or protocol setting; the value is read as YAML, as `train --set` reads it (`3`,
    /// `true`, `[a, b]`, else a string).
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
    /// Output format: `text` by default, `jsonl` (the only one) with --advantages.
    #[arg(long, value_enum)]
    pub format: Option<ReplayFormat>,
    /// Tokenizer directory (or `builtin`) that decodes each step's new context tokens in the text
    /// transcript; default: the run's own when DATASET is a run's `dataset/`, else the built-in.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Print statistics (trajectories, steps, success rate, reward, steps per trajectory, per env).
    #[arg(long, conflicts_with = "advantages")]
    pub stats: bool,
    /// Leave out trajectories with no terminal step yet (still being written, or cut short);
    /// by default they are printed and marked (`open` in the text header, `"open": true` in
    /// JSONL). Statistics and --advantages always leave them out and say how many, and so they
    /// do with incomplete trajectories (a step lost to damage; marked `incomplete: step N
    /// missing` in the text header, `"incomplete": true, "missing_step": N` in JSONL).
    #[arg(long)]
    pub skip_open: bool,
    /// With --stats: print one JSON object.
    #[arg(long, requires = "stats")]
    pub json: bool,
    #[command(flatten)]
    pub scoring: ScoringArgs,
    /// Exit non-zero when the dataset is damaged (any problem found at open, any record
    /// skipped because it does not decode), after printing what is readable.
    #[arg(long)]
    pub strict: bool,
}

/// Re-scoring a dataset with an advantage estimator (`replay --advantages`, `dataset export
/// --advantages`).
#[derive(Args, Debug, Default)]
pub struct ScoringArgs {
    /// Re-score the dataset with this advantage estimator (`adv_estimator` names: step_gae,
    /// token_gae, grpo, reinforce, dr_grpo, rloo, gigpo, step_reinforce, ...): replay prints one
    /// JSONL row per step (traj_id, group_id, step_index, reward, value, advantage_raw,
    /// advantage, return); export adds those columns.
    #[arg(long)]
    pub advantages: Option<String>,
    /// Discount γ (`gamma`).
    #[arg(long, requires = "advantages")]
    pub gamma: Option<f32>,
    /// GAE λ (`lambd`).
    #[arg(long, requires = "advantages")]
    pub lam: Option<f32>,
    /// Any other `AdvantageConfig` key, dotted for nested ones (e.g.
    /// `reward_normalization.method=mean`); the value is read as YAML, as `train --set` reads it.
    #[arg(long = "set", value_name = "KEY=VALUE", requires = "advantages")]
    pub set: Vec<String>,
    /// Critic directory (HF layout; a policy directory gets a fresh value head): values at each
    /// step's last pre-response token. Without it, critic-based estimators use zero values.
    #[arg(long, requires = "advantages")]
    pub critic: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum DatasetCommand {
    /// Check every segment of a dataset; exits non-zero listing every problem (file, offset).
    Verify { dataset: PathBuf },
    /// Truncate torn tails, rewrite damaged segments with their valid records, rebuild the manifest.
    Repair { dataset: PathBuf },
    /// Write a dataset as a Parquet file: one row per step, typed columns (pandas, polars,
    /// DuckDB, pyarrow and HF datasets read it; columns: docs/guides/datasets.md).
    Export(ExportArgs),
    /// Create a dataset from a Parquet file of `dataset export`, or from OpenAI chat-format
    /// JSONL (one conversation per line, one step per assistant message).
    Import(ImportArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ExportFormat {
    Parquet,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum CompressionArg {
    Zstd,
    Snappy,
    None,
}

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Dataset directory.
    pub dataset: PathBuf,
    /// File to write (through `OUT.partial`, renamed when complete).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, value_enum, default_value = "parquet")]
    pub format: ExportFormat,
    /// Add `obs_text` and `response_text`: each step's new context tokens and its response decoded.
    #[arg(long)]
    pub text: bool,
    /// Tokenizer directory (or `builtin`) that decodes --text; default: the run's own when DATASET
    /// is a run's `dataset/`, else the built-in one with the dataset's words.
    #[arg(long, requires = "text")]
    pub tokenizer: Option<PathBuf>,
    /// Page compression.
    #[arg(long, value_enum, default_value = "zstd")]
    pub compression: CompressionArg,
    /// Close a row group once its encoded size reaches this many MiB (what a reader holds at once).
    #[arg(long, default_value_t = 64)]
    pub row_group_mib: usize,
    #[command(flatten)]
    pub scoring: ScoringArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ImportFormat {
    /// A file written by `stepppo dataset export`.
    Parquet,
    /// OpenAI chat-format JSONL: `{"messages": [...], "tools": [...], "reward": R}` per line.
    ChatJsonl,
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// File to import.
    pub input: PathBuf,
    /// Dataset directory to create (must not exist).
    #[arg(long)]
    pub out: PathBuf,
    /// Input format; default: from the extension (`.parquet`; `.jsonl`, `.json`).
    #[arg(long, value_enum)]
    pub format: Option<ImportFormat>,
    /// Checkpoint directory (or `builtin`) whose chat template tokenises chat logs (required for
    /// chat-jsonl); for Parquet, token ids are checked against its vocabulary (default: the
    /// vocabulary size the file's metadata records).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Env tag of imported conversations whose line names none (`env`).
    #[arg(long, default_value = stepppo::interchange::DEFAULT_CHAT_ENV_TAG)]
    pub env_tag: String,
    /// Fail on the first conversation that cannot be imported instead of skipping it.
    #[arg(long)]
    pub strict: bool,
}

pub fn collect(a: CollectArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.group_size >= 1, "--group-size must be at least 1");
    let mut env_config = serde_json::Value::Object(serde_json::Map::new());
    for pair in &a.set {
        stepppo::config::apply_set(&mut env_config, pair)?;
    }
    let cfg = store::CollectConfig {
        env: a.env,
        env_config,
        agent: a.agent,
        episodes: a.episodes,
        group_size: a.group_size,
        seed: a.seed,
    };
    let tokenizer = Tokenizer::builtin_with_words(&env::builtin_words(&cfg.env, &cfg.env_config)?);
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

/// Problems printed one per line before the rest are only counted.
const SHOWN_PROBLEMS: usize = 10;
/// Skipped records whose location is printed.
const SHOWN_SKIPPED: usize = 5;

/// Prints the damage found at open (the first few problems) and the records skipped because
/// they do not decode (how many, and where the first few are) to stderr.
fn warn_damage(dataset: &Dataset, skipped: &[store::Problem]) {
    let found = dataset.problems().len() - skipped.len();
    for problem in dataset.problems()[..found].iter().take(SHOWN_PROBLEMS) {
        eprintln!("warning: {problem}");
    }
    if found > SHOWN_PROBLEMS {
        eprintln!(
            "warning: ... and {} more problems (`stepppo dataset verify {}` lists every one)",
            found - SHOWN_PROBLEMS,
            dataset.dir().display()
        );
    }
    if skipped.is_empty() {
        return;
    }
    eprintln!(
        "warning: skipped {} records that do not decode; the first at:",
        skipped.len()
    );
    for problem in skipped.iter().take(SHOWN_SKIPPED) {
        eprintln!("warning:   {problem}");
    }
}

pub fn replay(a: ReplayArgs) -> anyhow::Result<()> {
    let mut dataset = Dataset::open(&a.dataset)?;
    let skipped = dataset.skip_undecodable();
    warn_damage(&dataset, &skipped);
    let stdout = std::io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    replay_output(&dataset, &a, &mut out)?;
    let problems = dataset.problems().len();
    anyhow::ensure!(
        !a.strict || problems == 0,
        "{}: damaged ({problems} problem(s), {} records skipped) and --strict was given",
        a.dataset.display(),
        skipped.len()
    );
    Ok(())
}

fn replay_output(dataset: &Dataset, a: &ReplayArgs, out: &mut impl Write) -> anyhow::Result<()> {
    if a.stats {
        let stats = store::DatasetStats::compute(dataset)?;
        match a.json {
            true => writeln!(out, "{}", serde_json::to_string(&stats)?)?,
            false => write!(out, "{stats}")?,
        }
        return Ok(out.flush()?);
    }
    if a.scoring.advantages.is_some() {
        return replay_advantages(dataset, a, out);
    }
    let format = a.format.unwrap_or(ReplayFormat::Text);
    let tokenizer = match format {
        ReplayFormat::Text => Some(dataset_tokenizer(&a.dataset, a.tokenizer.as_deref())?),
        ReplayFormat::Jsonl => None,
    };
    let trajectories = match a.traj {
        Some(id) => vec![dataset
            .trajectory(id)
            .with_context(|| format!("{}: no trajectory {id}", a.dataset.display()))?],
        None => dataset.trajectories(),
    };
    for traj in &trajectories {
        let marks = store::Completeness::of(traj)?;
        if marks.open && a.skip_open {
            continue;
        }
        match format {
            ReplayFormat::Text => {
                writeln!(out, "{}", store::transcript(traj, tokenizer.as_ref())?)?
            }
            ReplayFormat::Jsonl => {
                for record in store::decode_trajectory(traj)? {
                    writeln!(out, "{}", store::jsonl_line(&record, marks)?)?;
                }
            }
        }
    }
    Ok(out.flush()?)
}

/// The tokenizer that decodes a dataset's tokens: `choice` (a directory or `builtin`), else the
/// run's own when `dataset` is a run's `dataset/`, else the built-in one with the dataset's words.
fn dataset_tokenizer(dataset: &Path, choice: Option<&Path>) -> anyhow::Result<Tokenizer> {
    if let Some(choice) = choice {
        return load_tokenizer(choice);
    }
    let run = dataset
        .parent()
        .filter(|p| dataset.ends_with("dataset") && p.join("dataset").is_dir());
    let source = Source::locate(run.unwrap_or(dataset))?;
    Ok(source.tokenizer()?)
}

/// `--tokenizer DIR|builtin`.
fn load_tokenizer(choice: &Path) -> anyhow::Result<Tokenizer> {
    match choice == Path::new("builtin") {
        true => Ok(Tokenizer::builtin()),
        false => {
            Tokenizer::from_dir(choice).with_context(|| format!("--tokenizer {}", choice.display()))
        }
    }
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
        DatasetCommand::Export(a) => export(a),
        DatasetCommand::Import(a) => import(a),
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

/// `AdvantageConfig` from its defaults, `--advantages`, `--gamma`, `--lam` and every `--set`,
/// applied in that order (`--set lam=…` is `lambd`); an error names the option and the key.
fn advantage_config(estimator: &str, a: &ScoringArgs) -> anyhow::Result<AdvantageConfig> {
    let mut overrides = vec![(
        format!("--advantages {estimator}"),
        format!("adv_estimator={estimator}"),
    )];
    if let Some(gamma) = a.gamma {
        overrides.push((format!("--gamma {gamma}"), format!("gamma={gamma}")));
    }
    if let Some(lam) = a.lam {
        overrides.push((format!("--lam {lam}"), format!("lambd={lam}")));
    }
    for pair in &a.set {
        let arg = match pair.strip_prefix("lam=") {
            Some(value) => format!("lambd={value}"),
            None => pair.clone(),
        };
        overrides.push((format!("--set `{pair}`"), arg));
    }
    let mut tree = serde_json::to_value(AdvantageConfig::default())?;
    for (option, arg) in overrides {
        stepppo::config::apply_set(&mut tree, &arg).with_context(|| option.clone())?;
        let key = arg
            .split_once('=')
            .map_or(arg.as_str(), |(key, _)| key.trim());
        serde_json::from_value::<AdvantageConfig>(tree.clone())
            .map_err(|e| anyhow::anyhow!("{option}: key `{key}`: {e}"))?;
    }
    let cfg: AdvantageConfig = serde_json::from_value(tree)?;
    cfg.validate()?;
    Ok(cfg)
}

/// Trajectories shown before the rest of those left out are only counted.
const SHOWN_INCOMPLETE: usize = 5;

/// The trajectories of `dataset` that are neither open nor missing a step; says on stderr how
/// many of each were left out (and which steps the first few incomplete ones miss).
fn complete_trajectories(dataset: &Dataset) -> anyhow::Result<Vec<Trajectory<'_>>> {
    let (mut open, mut incomplete) = (0, Vec::new());
    let mut kept = Vec::new();
    for traj in dataset.trajectories() {
        let marks = store::Completeness::of(&traj)?;
        match marks.missing_step {
            Some(step) => incomplete.push(format!("trajectory {} step {step}", traj.traj_id)),
            None if marks.open => open += 1,
            None => kept.push(traj),
        }
    }
    if open > 0 {
        eprintln!("note: {open} open trajectories (no terminal step yet) left out: their returns are not final");
    }
    if !incomplete.is_empty() {
        let first = &incomplete[..incomplete.len().min(SHOWN_INCOMPLETE)];
        eprintln!(
            "note: {} incomplete trajectories (a step lost to damage) left out: their returns are those of a shorter episode; missing: {}{}",
            incomplete.len(),
            first.join(", "),
            if incomplete.len() > first.len() { ", ..." } else { "" }
        );
    }
    Ok(kept)
}

/// Scores every complete trajectory of `dataset` as `--advantages` asks: the rows in trajectory
/// order (a note on stderr when zero values stand in for a critic).
fn score_steps(dataset: &Dataset, a: &ScoringArgs) -> anyhow::Result<Vec<algo::ReplayRow>> {
    let estimator = a.advantages.as_deref().unwrap_or_default();
    let cfg = advantage_config(estimator, a)?;
    let mut records = Vec::new();
    for traj in &complete_trajectories(dataset)? {
        records.extend(store::decode_trajectory(traj)?);
    }
    let critic = match &a.critic {
        Some(dir) => Some(
            Critic::load(dir, &Device::Cpu, 0)
                .with_context(|| format!("--critic {}", dir.display()))?,
        ),
        None => None,
    };
    let export =
        score_records(&records, &cfg, critic.as_ref()).with_context(|| match &a.critic {
            Some(dir) => format!("--advantages {estimator} with --critic {}", dir.display()),
            None => format!("--advantages {estimator}"),
        })?;
    if export.zero_values {
        eprintln!(
            "note: `{estimator}` reads critic values and no --critic was given: every value is 0"
        );
    }
    Ok(export.rows)
}

fn replay_advantages(
    dataset: &Dataset,
    a: &ReplayArgs,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        !matches!(a.format, Some(ReplayFormat::Text)),
        "--advantages prints JSONL rows: use `--format jsonl` (or no --format)"
    );
    let rows = score_steps(dataset, &a.scoring)?;
    if let Some(id) = a.traj {
        anyhow::ensure!(
            rows.iter().any(|r| r.traj_id == id),
            "{}: no trajectory {id} to score (open and incomplete trajectories are left out)",
            a.dataset.display()
        );
    }
    let selected = rows
        .iter()
        .filter(|r| a.traj.is_none_or(|id| r.traj_id == id));
    for row in selected {
        writeln!(out, "{}", serde_json::to_string(row)?)?;
    }
    Ok(out.flush()?)
}

fn export(a: ExportArgs) -> anyhow::Result<()> {
    let ExportFormat::Parquet = a.format;
    let mut dataset = Dataset::open(&a.dataset)?;
    let skipped = dataset.skip_undecodable();
    warn_damage(&dataset, &skipped);
    let tokenizer = match a.text {
        true => Some(dataset_tokenizer(&a.dataset, a.tokenizer.as_deref())?),
        false => None,
    };
    let scores = match a.scoring.advantages {
        Some(_) => Some(
            score_steps(&dataset, &a.scoring)?
                .into_iter()
                .map(|r| {
                    let scores = interchange::StepScores {
                        value: r.value,
                        advantage_raw: r.advantage_raw,
                        advantage: r.advantage,
                        ret: r.ret,
                    };
                    ((r.traj_id, r.step_index), scores)
                })
                .collect::<HashMap<_, _>>(),
        ),
        None => None,
    };
    let opts = interchange::ExportOptions {
        compression: match a.compression {
            CompressionArg::Zstd => interchange::ParquetCompression::Zstd,
            CompressionArg::Snappy => interchange::ParquetCompression::Snappy,
            CompressionArg::None => interchange::ParquetCompression::None,
        },
        row_group_bytes: a.row_group_mib.max(1) << 20,
        text: tokenizer.as_ref(),
        scores: scores.as_ref(),
    };
    let summary = interchange::export_parquet(&dataset, &a.out, &opts)?;
    println!(
        "{}: {} rows in {} row groups, {} bytes",
        a.out.display(),
        summary.rows,
        summary.row_groups,
        summary.bytes
    );
    Ok(())
}

fn import(a: ImportArgs) -> anyhow::Result<()> {
    let format = match a.format {
        Some(f) => f,
        None => match a.input.extension().and_then(|e| e.to_str()) {
            Some("parquet") => ImportFormat::Parquet,
            Some("jsonl" | "json") => ImportFormat::ChatJsonl,
            _ => anyhow::bail!(
                "{}: cannot tell the format from the extension; give --format parquet or --format chat-jsonl",
                a.input.display()
            ),
        },
    };
    let summary = match format {
        ImportFormat::Parquet => {
            let vocab_size = match &a.tokenizer {
                Some(choice) => Some(load_tokenizer(choice)?.vocab_size()),
                None => None,
            };
            let opts = interchange::ImportOptions {
                vocab_size,
                roll_bytes: None,
            };
            interchange::import_parquet(&a.input, &a.out, &opts)?
        }
        ImportFormat::ChatJsonl => {
            let choice = a.tokenizer.as_deref().context(
                "--tokenizer DIR|builtin: the checkpoint whose chat template tokenises the conversations",
            )?;
            let tokenizer = load_tokenizer(choice)?;
            let mut description = serde_json::json!({
                "kind": "builtin", "vocab_size": tokenizer.vocab_size(), "eos_id": tokenizer.eos_id(),
            });
            if choice != Path::new("builtin") {
                let dir = std::fs::canonicalize(choice)
                    .with_context(|| format!("--tokenizer {}", choice.display()))?;
                description["kind"] = "hf".into();
                description[store::TOKENIZER_DIR_KEY] = dir.display().to_string().into();
            }
            let opts = interchange::ChatImportOptions {
                tokenizer: &tokenizer,
                env_tag: a.env_tag.clone(),
                strict: a.strict,
                roll_bytes: None,
                metadata: [("tokenizer".to_string(), description)].into(),
            };
            interchange::import_chat_jsonl(&a.input, &a.out, &opts)?
        }
    };
    for why in summary.skipped.iter().take(SHOWN_PROBLEMS) {
        eprintln!("skipped: {}: {why}", a.input.display());
    }
    if summary.skipped.len() > SHOWN_PROBLEMS {
        eprintln!(
            "skipped: ... and {} more (--strict stops at the first)",
            summary.skipped.len() - SHOWN_PROBLEMS
        );
    }
    println!(
        "{}: {} trajectories, {} records{}",
        a.out.display(),
        summary.trajectories,
        summary.records,
        match summary.skipped.len() {
            0 => String::new(),
            n => format!(" ({n} skipped)"),
        }
    );
    Ok(())
}
