//! StepPO against its baselines on the same FrozenLake budget (a custom harness, not criterion):
//! `step_reinforce` (the default's estimator), `step_gae`, `token_gae`, `grpo` and `gigpo` each
//! train from the embedded default config with several seeds, all starting from ONE shared
//! warm-started policy (the default's random-agent behaviour cloning, done once), with the same
//! rollout budget and the same validation seeds; the table reports final validation success
//! (mean ± std over seeds) and the first step at which validation success reached 0.5.
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
use stepppo::train::sft;
use stepppo::train::trainer::Event;
use stepppo::train::Trainer;

/// (label, overrides of the embedded default): the estimator and what it needs (the GAE arms add
/// the shared-trunk critic the critic-free default lacks).
const ARMS: [(&str, &[&str]); 5] = [
    ("step_reinforce", &[]),
    (
        "step_gae",
        &[
            "adv_estimator=step_gae",
            "critic.mode=shared",
            "ratio_type=segment",
        ],
    ),
    (
        "token_gae",
        &[
            "adv_estimator=token_gae",
            "critic.mode=shared",
            "ratio_type=token",
        ],
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
    seconds: f64,
}

fn config(sets: &[String]) -> Config {
    let cfg = Config::from_yaml_str(EMBEDDED_DEFAULT_YAML, EMBEDDED_DEFAULT_NAME, sets)
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
    trainer
        .run(max_steps, &mut |event| {
            if let Event::Validation { step, summaries } = event {
                let s = summaries.iter().map(|s| s.success).sum::<f64>()
                    / summaries.len().max(1) as f64;
                curve.push((step, s));
            }
        })
        .unwrap_or_else(|e| panic!("{e}"));
    Outcome {
        final_success: curve.last().map_or(0.0, |c| c.1),
        steps_to_half: curve.iter().find(|c| c.1 >= 0.5).map(|c| c.0),
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
        "estimator       final val success (mean ± std)   steps to 0.5 (reached/seeds)   wall s/run"
    );
    for (label, arm) in arms {
        let mut finals = Vec::new();
        let mut reached = Vec::new();
        let mut secs = Vec::new();
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
                "{label} seed {}: final {:.3}, steps to 0.5 {:?}, {:.0}s",
                42 + seed,
                out.final_success,
                out.steps_to_half,
                out.seconds
            );
            finals.push(out.final_success);
            reached.extend(out.steps_to_half.map(|s| s as f64));
            secs.push(out.seconds);
        }
        let (m, s) = mean_std(&finals);
        let to_half = if reached.is_empty() {
            "never".to_string()
        } else {
            format!("{:.1}", mean_std(&reached).0)
        };
        println!(
            "{label:<15} {m:>6.3} ± {s:<5.3}                    {to_half:>6} ({}/{seeds})                   {:.0}",
            reached.len(),
            mean_std(&secs).0
        );
    }
}
