//! StepPO against its baselines on the same budget (a custom harness, not criterion):
//! `step_gae` (the default: step-level GAE on the asymmetric state critic), `step_reinforce`,
//! `token_gae`, `grpo` and `gigpo` each train from the embedded default config (FrozenLake), or the
//! config file `LEARNING_CONFIG` names (e.g. `configs/sokoban_steppo.yaml`), with several seeds,
//! all starting from ONE shared warm-started policy (the config's random-agent behaviour cloning,
//! done once), with the same rollout budget and the same validation seeds; the table reports final
//! validation success (mean ± std over seeds, and per seed), the first steps at which validation
//! success reached 0.5 and 0.8, the critic arms' explained variance pooled over their last 20 steps
//! (1 − Σ rows · residual variance / Σ rows · return variance, with the tabular ceiling's mean
//! beside it), and the wall time per run.
//!
//! `cargo bench --bench learning` runs it; without `--bench` (e.g. under `cargo test`) it does
//! nothing. Budget knobs (environment): `LEARNING_STEPS` (training steps per run, default the
//! config's `max_steps`), `LEARNING_SEEDS` (default 3), `LEARNING_EVAL_STEPS` (default 5),
//! `LEARNING_SETS` (extra `;`-separated `key=value` overrides for every run), `LEARNING_ARMS`
//! (comma-separated labels of the arms to run, default all).

use std::time::Instant;
use stepppo::config::{Config, EMBEDDED_DEFAULT_NAME, EMBEDDED_DEFAULT_YAML};
use stepppo::env::AgentKind;
use stepppo::tokenizer::Tokenizer;
use stepppo::train::run::trainer::Event;
use stepppo::train::warm_start::sft;
use stepppo::train::Trainer;

/// (label, overrides of the embedded default): the estimator and what it needs. The default is
/// `step_gae` on the state critic (an MLP on the env's planning facts of the whole map); `token_gae`
/// keeps that critic, the critic-free arms drop it.
const ARMS: [(&str, &[&str]); 5] = [
    ("step_gae", &[]),
    (
        "step_reinforce",
        &["adv_estimator=step_reinforce", "critic.mode=none"],
    ),
    (
        "token_gae",
        &["adv_estimator=token_gae", "ratio_type=token"],
    ),
    (
        "grpo",
        &[
            "adv_estimator=grpo",
            "critic.mode=none",
            "ratio_type=token",
            "whiten_advantages=false",
        ],
    ),
    (
        "gigpo",
        &[
            "adv_estimator=gigpo",
            "critic.mode=none",
            "ratio_type=token",
            "whiten_advantages=false",
        ],
    ),
];

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

struct Outcome {
    final_success: f64,
    steps_to_half: Option<u64>,
    steps_to_08: Option<u64>,
    /// The critic's explained variance pooled over the last [`EV_WINDOW`] steps and the mean
    /// tabular ceiling over them; `None` without a critic.
    critic_ev: Option<(f64, f64)>,
    seconds: f64,
}

/// Steps the critic's explained variance is pooled over.
const EV_WINDOW: usize = 20;

/// Per step: rows, return variance, residual variance, ceiling (NaN when not logged).
type CriticRow = (f64, f64, f64, f64);

fn critic_row(scalars: &stepppo::train::Scalars) -> Option<CriticRow> {
    let get = |k: &str| scalars.get(k).copied();
    Some((
        get("critic/rows")?,
        get("critic/return_var")?,
        get("critic/vf_residual_var")?,
        get("critic/vf_explained_var_ceiling").unwrap_or(f64::NAN),
    ))
}

/// Pooled explained variance and mean ceiling of the last [`EV_WINDOW`] rows.
fn pooled_ev(rows: &[CriticRow]) -> Option<(f64, f64)> {
    let last = &rows[rows.len().saturating_sub(EV_WINDOW)..];
    let total: f64 = last.iter().map(|r| r.0 * r.1).sum();
    if last.is_empty() || total <= 0.0 {
        return None;
    }
    let residual: f64 = last.iter().map(|r| r.0 * r.2).sum();
    let ceilings: Vec<f64> = last.iter().map(|r| r.3).filter(|c| c.is_finite()).collect();
    let ceiling = ceilings.iter().sum::<f64>() / ceilings.len().max(1) as f64;
    Some((1.0 - residual / total, ceiling))
}

/// The bench's config: `LEARNING_CONFIG`'s file, or the embedded default, with `sets` applied.
fn config(sets: &[String]) -> Config {
    let cfg = match std::env::var("LEARNING_CONFIG") {
        Ok(path) => {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("LEARNING_CONFIG {path}: {e}"));
            Config::from_yaml_str(&text, &path, sets)
        }
        Err(_) => Config::from_yaml_str(EMBEDDED_DEFAULT_YAML, EMBEDDED_DEFAULT_NAME, sets),
    }
    .unwrap_or_else(|e| panic!("{e}"));
    if cfg.cpu_threads > 0 && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", cfg.cpu_threads.to_string());
    }
    cfg
}

/// The default's warm start, once: random-agent transcripts cloned into the built-in model.
fn warm_start(dir: &std::path::Path, extra: &[String]) -> f64 {
    let cfg = config(extra);
    let start = Instant::now();
    let records = sft::agent_transcripts(
        &cfg,
        &Tokenizer::builtin(),
        AgentKind::Random,
        cfg.sft.episodes,
        7,
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .records;
    let report = sft::clone_into(&cfg, &records, dir).unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "warm start: {} steps, loss {:.3} → {:.3}",
        report.steps, report.first_loss, report.final_loss
    );
    start.elapsed().as_secs_f64()
}

fn train_once(sets: &[String], run_dir: &std::path::Path) -> Outcome {
    let cfg = config(sets);
    let start = Instant::now();
    let max_steps = cfg.max_steps as u64;
    let mut trainer = Trainer::create(cfg, run_dir).unwrap_or_else(|e| panic!("{e}"));
    let mut curve: Vec<(u64, f64)> = Vec::new();
    let mut critic_rows: Vec<CriticRow> = Vec::new();
    trainer
        .run(max_steps, &mut |event| match event {
            Event::Validation { step, summaries } => {
                let s = summaries.iter().map(|s| s.success).sum::<f64>()
                    / summaries.len().max(1) as f64;
                curve.push((step, s));
            }
            Event::Step { scalars, .. } => critic_rows.extend(critic_row(scalars)),
            _ => {}
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let first_at = |bar: f64| curve.iter().find(|c| c.1 >= bar).map(|c| c.0);
    Outcome {
        final_success: curve.last().map_or(0.0, |c| c.1),
        steps_to_half: first_at(0.5),
        steps_to_08: first_at(0.8),
        critic_ev: pooled_ev(&critic_rows),
        seconds: start.elapsed().as_secs_f64(),
    }
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, var.sqrt())
}

/// The arms named in `LEARNING_ARMS` (all when unset); an unknown label, or a value naming no
/// arm, stops the bench.
fn selected_arms() -> Vec<(&'static str, &'static [&'static str])> {
    let Ok(wanted) = std::env::var("LEARNING_ARMS") else {
        return ARMS.to_vec();
    };
    let labels: Vec<&str> = ARMS.iter().map(|a| a.0).collect();
    let arms: Vec<_> = wanted
        .split(',')
        .map(str::trim)
        .filter(|w| !w.is_empty())
        .map(|w| {
            *ARMS
                .iter()
                .find(|(label, _)| *label == w)
                .unwrap_or_else(|| {
                    panic!(
                        "LEARNING_ARMS: unknown arm `{w}` (arms: {})",
                        labels.join(", ")
                    )
                })
        })
        .collect();
    assert!(
        !arms.is_empty(),
        "LEARNING_ARMS names no arm (arms: {})",
        labels.join(", ")
    );
    arms
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    stepppo::device::prepare_cpu_process();
    let seeds = env_usize("LEARNING_SEEDS").unwrap_or(3);
    let eval_steps = env_usize("LEARNING_EVAL_STEPS").unwrap_or(5);
    let extra: Vec<String> = std::env::var("LEARNING_SETS")
        .unwrap_or_default()
        .split(';')
        .filter(|s| !s.trim().is_empty())
        .map(str::to_string)
        .collect();
    let arms = selected_arms();
    let root = tempfile::tempdir().expect("a temporary directory");
    let base = root.path().join("warm-start");
    let secs = warm_start(&base, &extra);
    println!("shared warm start: {secs:.0}s");
    println!(
        "estimator        final val success (mean ± std; per seed)   steps to 0.5 / 0.8 (reached)   critic EV, last {EV_WINDOW} (ceiling)   wall s/run"
    );
    for (label, arm) in arms {
        let mut outcomes = Vec::new();
        for seed in 0..seeds as u64 {
            let mut sets: Vec<String> = arm.iter().map(|s| s.to_string()).collect();
            sets.push(format!("seed={}", 42 + seed));
            sets.push(format!("eval_steps={eval_steps}"));
            sets.push("save_steps=0".into());
            sets.push(format!("pretrain={}", base.display()));
            sets.push("sft.steps=0".into());
            if let Some(steps) = env_usize("LEARNING_STEPS") {
                sets.push(format!("max_steps={steps}"));
            }
            sets.extend(extra.iter().cloned());
            let out = train_once(&sets, &root.path().join(format!("{label}-{seed}")));
            eprintln!(
                "{label} seed {}: final {:.3}, steps to 0.5 {:?}, to 0.8 {:?}, critic EV {:?}, {:.0}s",
                42 + seed,
                out.final_success,
                out.steps_to_half,
                out.steps_to_08,
                out.critic_ev,
                out.seconds
            );
            outcomes.push(out);
        }
        println!("{}", table_row(label, &outcomes));
    }
}

/// One arm's line of the table.
fn table_row(label: &str, outcomes: &[Outcome]) -> String {
    let finals: Vec<f64> = outcomes.iter().map(|o| o.final_success).collect();
    let (m, s) = mean_std(&finals);
    let per_seed: Vec<String> = finals.iter().map(|f| format!("{f:.3}")).collect();
    let steps_to = |pick: &dyn Fn(&Outcome) -> Option<u64>| {
        let reached: Vec<f64> = outcomes.iter().filter_map(pick).map(|s| s as f64).collect();
        if reached.is_empty() {
            format!("never (0/{})", outcomes.len())
        } else {
            let mean = mean_std(&reached).0;
            format!("{mean:.1} ({}/{})", reached.len(), outcomes.len())
        }
    };
    let evs: Vec<(f64, f64)> = outcomes.iter().filter_map(|o| o.critic_ev).collect();
    let ev = if evs.is_empty() {
        "—".to_string()
    } else {
        let each: Vec<String> = evs
            .iter()
            .map(|(ev, ceiling)| format!("{ev:.2} ({ceiling:.2})"))
            .collect();
        each.join(" / ")
    };
    let secs: Vec<f64> = outcomes.iter().map(|o| o.seconds).collect();
    format!(
        "{label:<16} {m:.3} ± {s:.3}; {}   {} / {}   {ev}   {:.0}",
        per_seed.join(" / "),
        steps_to(&|o| o.steps_to_half),
        steps_to(&|o| o.steps_to_08),
        mean_std(&secs).0
    )
}
