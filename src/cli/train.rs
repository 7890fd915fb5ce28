//! `stepppo train`, `eval`, `sft`, `plot`: argument parsing and printing over `stepppo::train`.

use anyhow::Context;
use clap::Args;
use std::path::{Path, PathBuf};
use stepppo::config::{Config, DeviceKind, GatewayConfig};
use stepppo::serve::{self, ApiKey, GatewayOptions, API_KEY_ENV};
use stepppo::store::Dataset;
use stepppo::train::run::checkpoint;
use stepppo::train::run::eval::{self, TagSummary};
use stepppo::train::run::gateway::GatewayTrainer;
use stepppo::train::run::plot::plot_run;
use stepppo::train::run::progress::Progress;
use stepppo::train::run::run_dir;
use stepppo::train::run::trainer::Event;
use stepppo::train::warm_start::sft;
use stepppo::train::Trainer;

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Run config (YAML); the embedded FrozenLake StepPO default when omitted.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override any config key: `--set a.b=value` (repeatable; value read as YAML).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Run directory (default: the config's `output_dir`, else `runs/<exp_name>`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Continue the run in the run directory from its latest checkpoint, under the run's own
    /// config: `--set` may change only `max_steps`, `eval_steps`, `save_steps`, `cpu_threads`,
    /// `activation_checkpointing`, `output_dir` and `gateway.listen`, and a `--config` must match
    /// the run's.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Start over in a run directory that already holds a run: removes that run's checkpoints,
    /// dataset, metrics and config (other files in the directory are kept).
    #[arg(long)]
    overwrite: bool,
}

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// A checkpoint directory, a `ckpt-latest` pointer, a run directory, an HF-layout model
    /// directory (e.g. the output of `stepppo sft`) or a PEFT LoRA adapter directory.
    #[arg(long)]
    checkpoint: PathBuf,
    /// A PEFT LoRA adapter directory to apply to the checkpoint's policy or the model directory.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Config whose validation envs to use (default: the one stored in the checkpoint; for a
    /// model directory, the embedded default).
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Validation episodes per env tag (default: the config's val_env_manager).
    #[arg(long)]
    episodes: Option<usize>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct SftArgs {
    /// A stored step dataset (e.g. from `stepppo collect --agent oracle`).
    #[arg(long)]
    dataset: PathBuf,
    /// Where to write the trained model (HF layout: config.json, model.safetensors, tokenizer.json).
    #[arg(long)]
    out: PathBuf,
    /// Config naming the initial model (`pretrain`, `builtin_size`, `seed`) and the `sft` section.
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Clone only the trajectories that ended in success (filtered behaviour cloning, e.g. of a
    /// training run's own rollouts in `<run>/dataset`).
    #[arg(long)]
    successful_only: bool,
}

#[derive(Args, Debug)]
pub struct PlotArgs {
    /// Run directory holding metrics.jsonl.
    run: PathBuf,
}

fn load_config(path: Option<&Path>, sets: &[String]) -> anyhow::Result<Config> {
    let cfg = match path {
        Some(p) => Config::load(p, sets)?,
        None => Config::from_yaml_str(
            stepppo::config::EMBEDDED_DEFAULT_YAML,
            stepppo::config::EMBEDDED_DEFAULT_NAME,
            sets,
        )?,
    };
    stepppo::device::set_cpu_threads(cfg.cpu_threads);
    Ok(cfg)
}

pub fn train(a: TrainArgs) -> anyhow::Result<()> {
    let (cfg, run_dir) = run_config(&a)?;
    let cuda = (cfg.device == DeviceKind::Cuda).then(stepppo::dist::local_rank);
    let dist = stepppo::dist::join_world(cuda)?;
    if dist.rank() != 0 {
        return train_rank(a, cfg, &run_dir, dist);
    }
    let max_steps = cfg.max_steps as u64;
    eprintln!(
        "stepppo train: {} ({:?}, {:?}) → {}{}",
        cfg.exp_name,
        cfg.adv_estimator,
        cfg.context,
        run_dir.display(),
        match dist.size() {
            1 => String::new(),
            n => format!(" on {n} ranks ({})", dist.backend()),
        }
    );
    if !a.resume && cfg.sft.steps > 0 {
        eprintln!(
            "warm start: {} steps of behaviour cloning on {} {} episodes…",
            cfg.sft.steps, cfg.sft.episodes, cfg.sft.agent
        );
    }
    let mut trainer = if a.resume {
        Trainer::resume_rank(cfg, &run_dir, dist)?
    } else {
        if a.overwrite {
            check_pretrain_survives_overwrite(&cfg, &run_dir)?;
            run_dir::prepare_fresh(&run_dir, true)?;
        }
        Trainer::create_rank(cfg, &run_dir, dist)?
    };
    report_run(&mut trainer, max_steps, &run_dir)
}

/// `--overwrite` clears the run directory's own entries before the policy is loaded, so a
/// `pretrain` inside it (such as its `warm_start/`) would be gone by then: refused.
fn check_pretrain_survives_overwrite(cfg: &Config, run_dir: &Path) -> anyhow::Result<()> {
    let (Ok(model), Ok(dir)) = (
        Path::new(&cfg.pretrain).canonicalize(),
        run_dir.canonicalize(),
    ) else {
        return Ok(());
    };
    anyhow::ensure!(
        !model.starts_with(&dir),
        "pretrain `{}` lies inside the run directory {} that --overwrite would clear first; \
         copy it elsewhere, or write the new run to another --out",
        cfg.pretrain,
        run_dir.display()
    );
    Ok(())
}

/// The run's config and directory: given (`--config`, `--set`, `--out`) or, for `--resume`, the
/// run's own.
fn run_config(a: &TrainArgs) -> anyhow::Result<(Config, PathBuf)> {
    Ok(if a.resume {
        resume_config(a)?
    } else {
        let cfg = load_config(a.config.as_deref(), &a.sets)?;
        let run_dir = a.out.clone().unwrap_or_else(|| cfg.run_dir());
        (cfg, run_dir)
    })
}

/// A rank other than 0: trains its share and writes nothing (rank 0 reports and saves).
fn train_rank(
    a: TrainArgs,
    cfg: Config,
    run_dir: &Path,
    dist: std::sync::Arc<dyn stepppo::dist::Collective>,
) -> anyhow::Result<()> {
    let max_steps = cfg.max_steps as u64;
    let mut trainer = if a.resume {
        Trainer::resume_rank(cfg, run_dir, dist)?
    } else {
        Trainer::create_rank(cfg, run_dir, dist)?
    };
    trainer.run(max_steps, &mut |_| {})?;
    Ok(())
}

/// Trains until `max_steps` with the progress bar and log lines, then plots the run.
/// Serves the gateway and learns from the sessions outside agents close through it.
fn train_from_gateway(
    trainer: &mut Trainer,
    gateway: &GatewayConfig,
    max_steps: u64,
    on_event: &mut dyn FnMut(Event),
) -> anyhow::Result<()> {
    anyhow::ensure!(
        trainer.world().1 == 1,
        "key `gateway`: training from the gateway runs in one process (launched on {} ranks)",
        trainer.world().1
    );
    let (host, port) = gateway
        .listen
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
        .with_context(|| {
            format!(
                "key `gateway.listen`: `{}` is not host:port",
                gateway.listen
            )
        })?;
    let cfg = trainer.config().clone();
    let max_context = trainer
        .policy()
        .config()
        .max_position_embeddings
        .min(cfg.cache.kv_slots);
    let mut opts = GatewayOptions::new(&gateway.served_model_name, max_context, cfg.seed);
    opts.host = host;
    opts.port = port;
    opts.api_key = ApiKey::from_flag_or_env(None)
        .map_err(|e| anyhow::anyhow!("key `gateway`: {API_KEY_ENV}: {e}"))?;
    opts.max_body_bytes = gateway.max_body_bytes;
    opts.worker.tool_call_penalty = gateway.tool_call_penalty;
    opts.worker.default_max_tokens = gateway.default_max_tokens;
    opts.worker.session_ttl = std::time::Duration::from_secs(gateway.session_ttl_s);
    let served = serve::start(&opts)?;
    eprintln!(
        "gateway: http://{}/v1 serving `{}`; an update every {} groups of {} closed sessions",
        served.addr(),
        opts.model_name,
        cfg.train_env_manager.groups(),
        cfg.train_env_manager.group_size
    );
    trainer.begin(on_event)?;
    let until = max_steps.min(cfg.max_steps as u64);
    if trainer.state().step >= until {
        return Ok(());
    }
    let mut backend = GatewayTrainer::new(trainer, until, on_event);
    served.serve(&mut backend)
}

fn report_run(trainer: &mut Trainer, max_steps: u64, run_dir: &Path) -> anyhow::Result<()> {
    let reached = trainer.state().step;
    if reached >= max_steps {
        eprintln!(
            "{} already reached step {reached} of max_steps {max_steps}: nothing to train; \
             raise it to continue (--resume --set max_steps=N)",
            run_dir.display()
        );
        return Ok(());
    }
    let start = std::time::Instant::now();
    let progress = Progress::new(max_steps, trainer.state().step);
    let mut last_val: Option<f64> = None;
    let mut on_event = |event: Event| match event {
        Event::WarmStart(r) => {
            if let Some(c) = &r.copy {
                let checks: Vec<String> = c
                    .checks
                    .iter()
                    .map(|(steps, p)| format!("{p:.3} at {steps}"))
                    .collect();
                progress.println(format!(
                    "copy pre-training: {} steps in {:.1}s, loss {:.3} → {:.3}, held-out copy probability {:.3}{}",
                    c.steps,
                    c.seconds,
                    c.first_loss,
                    c.final_loss,
                    c.held_out_copy_probability,
                    if checks.is_empty() {
                        String::new()
                    } else {
                        format!(" (checks: {})", checks.join(", "))
                    }
                ));
                if let Some(target) = c.missed_target() {
                    progress.println(format!(
                        "warning: copy pre-training stopped at sft.copy.max_steps {} below \
                         sft.copy.until_probability {target}: the model did not learn to copy, \
                         and a task that copies names from its context will likely fail from \
                         this warm start (another seed or a higher max_steps may form it)",
                        c.steps
                    ));
                }
            }
            if r.steps > 0 {
                progress.println(format!(
                    "warm start: {} steps on {} trajectories in {:.1}s, loss {:.3} → {:.3}{}",
                    r.steps,
                    r.trajectories,
                    r.seconds,
                    r.first_loss,
                    r.final_loss,
                    r.value_loss.map_or(String::new(), |(first, last)| format!(
                        ", value loss {first:.4} → {last:.4}"
                    ))
                ));
            }
        }
        Event::Step { step, scalars } => {
            let mean_of = |suffix: &str| {
                let xs: Vec<f64> = scalars
                    .iter()
                    .filter(|(k, _)| k.starts_with("env/") && k.ends_with(suffix))
                    .map(|(_, v)| *v)
                    .collect();
                xs.iter().sum::<f64>() / xs.len().max(1) as f64
            };
            let step_s = scalars.get("time/step").copied().unwrap_or(0.0);
            progress.update(
                step,
                mean_of("/success"),
                mean_of("/reward"),
                last_val,
                step_s,
            );
        }
        Event::Validation { step, summaries } => {
            let mean =
                summaries.iter().map(|s| s.success).sum::<f64>() / summaries.len().max(1) as f64;
            last_val = Some(mean);
            progress.println(format!(
                "[{:>7.1}s] step {step} validation: {}",
                start.elapsed().as_secs_f64(),
                summaries
                    .iter()
                    .map(|s| format!(
                        "{} success {:.3} reward {:.3} valid {:.3}",
                        s.tag, s.success, s.reward, s.action_is_valid
                    ))
                    .collect::<Vec<_>>()
                    .join("; ")
            ));
        }
        Event::Warning(w) => progress.println(format!("warning: {w}")),
        Event::Checkpoint(dir) => progress.println(format!("checkpoint {}", dir.display())),
    };
    match trainer.config().gateway.clone() {
        Some(gateway) => train_from_gateway(trainer, &gateway, max_steps, &mut on_event)?,
        None => trainer.run(max_steps, &mut on_event)?,
    }
    progress.finish();
    let svg = plot_run(run_dir)?;
    eprintln!(
        "done in {:.1}s: metrics {}, plot {}, latest checkpoint {}",
        start.elapsed().as_secs_f64(),
        run_dir.join("metrics.jsonl").display(),
        svg.display(),
        run_dir.join(checkpoint::LATEST).display()
    );
    Ok(())
}

/// The config and directory of a resumed run: the run's own config from its latest checkpoint,
/// with `--set` applied; a `--config` given too must describe the same run. Keys outside the
/// ones a resume may change are refused by [`Trainer::resume`], naming them.
fn resume_config(a: &TrainArgs) -> anyhow::Result<(Config, PathBuf)> {
    let run_dir = match &a.out {
        Some(dir) => dir.clone(),
        None => load_config(a.config.as_deref(), &[])?.run_dir(),
    };
    let ckpt = run_dir::checkpoint_to_resume(&run_dir)?;
    if let Some(path) = &a.config {
        let given = Config::load(path, &a.sets)?;
        let stored = run_dir::checkpoint_config(&ckpt, &a.sets)?;
        let file = path.display().to_string();
        stepppo::config::check_resume(&stored, &given, &file)?;
    }
    let cfg = run_dir::checkpoint_config(&ckpt, &a.sets)?;
    stepppo::device::set_cpu_threads(cfg.cpu_threads);
    Ok((cfg, run_dir))
}

pub fn eval(a: EvalArgs) -> anyhow::Result<()> {
    let (policy_dir, mut cfg) = match checkpoint::resolve(&a.checkpoint) {
        Ok(ckpt) => {
            let cfg = match &a.config {
                Some(p) => load_config(Some(p), &a.sets)?,
                None => stored_config(&ckpt, &a.sets)?,
            };
            (ckpt.join("policy"), cfg)
        }
        Err(_) if is_model_dir(&a.checkpoint) => (
            a.checkpoint.clone(),
            load_config(a.config.as_deref(), &a.sets)?,
        ),
        Err(e) => return Err(e.into()),
    };
    if let Some(n) = a.episodes {
        let m = &mut cfg.val_env_manager;
        m.group_size = 1;
        m.num_groups_partition = vec![n; m.tags.len()];
        cfg.complete_counts();
    }
    let summaries = eval::evaluate_policy(&policy_dir, a.adapter.as_deref(), &cfg)?;
    print_summaries(&summaries, a.json)
}

/// An HF-layout model directory: `config.json` plus single-file or sharded safetensors weights
/// (a run directory without checkpoints also holds a `config.json`, but no weights), or a PEFT
/// adapter directory.
fn is_model_dir(dir: &Path) -> bool {
    dir.join("config.json").is_file()
        && (dir.join("model.safetensors").is_file()
            || dir.join("model.safetensors.index.json").is_file())
        || dir
            .join(stepppo::model::lora::ADAPTER_CONFIG_FILE)
            .is_file()
}

/// The config a checkpoint was trained with, with `--set` overrides applied.
fn stored_config(ckpt: &Path, sets: &[String]) -> anyhow::Result<Config> {
    let cfg = run_dir::checkpoint_config(ckpt, sets)?;
    stepppo::device::set_cpu_threads(cfg.cpu_threads);
    Ok(cfg)
}

fn print_summaries(summaries: &[TagSummary], json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(summaries)?);
        return Ok(());
    }
    println!(
        "{:<20} {:>8} {:>8} {:>8} {:>7} {:>7}",
        "tag", "episodes", "success", "reward", "steps", "valid"
    );
    for s in summaries {
        println!(
            "{:<20} {:>8} {:>8.3} {:>8.3} {:>7.2} {:>7.3}",
            s.tag, s.episodes, s.success, s.reward, s.steps, s.action_is_valid
        );
    }
    for s in summaries {
        let plain: Vec<String> = s
            .plain_env_scores()
            .map(|(k, v)| format!("{k} {v:.3}"))
            .collect();
        if !plain.is_empty() {
            println!("{}: {}", s.tag, plain.join(", "));
        }
        for (group, em, share) in s.group_scores() {
            let episodes = (share * s.episodes as f64).round() as usize;
            println!("  em of {group}: {em:.3} ({episodes} episodes that acted)");
        }
    }
    Ok(())
}

pub fn sft(a: SftArgs) -> anyhow::Result<()> {
    let cfg = load_config(a.config.as_deref(), &a.sets)?;
    let dataset = Dataset::open(&a.dataset)?;
    let records: Vec<_> = dataset
        .records()
        .map(|v| v.to_record())
        .collect::<Result<_, _>>()
        .with_context(|| format!("{}: reading records", a.dataset.display()))?;
    let records = if a.successful_only {
        let solved = sft::successful_trajectories(records);
        anyhow::ensure!(
            !solved.is_empty(),
            "{}: --successful-only: no trajectory in the dataset reached the goal",
            a.dataset.display()
        );
        solved
    } else {
        records
    };
    let report = sft::clone_into(&cfg, &records, &a.out)?;
    println!(
        "behaviour cloning: {} steps on {} sequences, loss {:.3} → {:.3}; model written to {}",
        report.steps,
        report.trajectories,
        report.first_loss,
        report.final_loss,
        a.out.display()
    );
    Ok(())
}

pub fn plot(a: PlotArgs) -> anyhow::Result<()> {
    let svg = plot_run(&a.run)?;
    println!("{}", svg.display());
    Ok(())
}
