//! A learning check: a change that stops RL from learning fails `cargo test`, not only a
//! benchmark run. `configs/bandit_grpo.yaml` (GRPO, the built-in `small` model after its random
//! warm start) on a two-armed bandit whose arms pay deterministically (the better arm 1, the other
//! 0), 15 RL steps. Validation samples at temperature 1 on 128 held-out seeds, so its success is
//! the policy's probability of pulling the better arm.
//!
//! The thresholds come from the spread over seeds 1–8 (release build, 2026-11-28, 2-core Zen 3):
//! the base (step 0) lies at 0.31–0.73, step 15 at 0.82–0.95 (mean 0.89, std 0.04), the rise
//! 0.23–0.59. The test runs seed 1 (base 0.44, step 15 0.82) and asks for ≥ 0.72 at step 15 and a
//! rise of ≥ 0.2: a learner that does not move stays near its base, one that moves the wrong way
//! falls below it.

use std::process::Command;
use stepppo::train::run::metrics::read_jsonl;

const STEPS: u64 = 15;
const MIN_FINAL: f64 = 0.72;
const MIN_RISE: f64 = 0.2;

/// Sampled better-arm rate at validation `step` of the run in `run`.
fn success_at(run: &std::path::Path, step: u64) -> f64 {
    let rows = read_jsonl(&run.join("metrics.jsonl")).unwrap();
    rows.iter()
        .filter(|(s, _)| *s == step)
        .find_map(|(_, m)| m.get("val/Bandit/success").copied())
        .unwrap_or_else(|| panic!("metrics.jsonl has no val/Bandit/success at step {step}"))
}

#[test]
fn grpo_learns_the_better_arm_of_a_bandit() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let steps = format!("max_steps={STEPS}");
    let sets = [
        "seed=1",
        &steps,
        "eval_steps=15",
        "save_steps=0",
        "custom_envs.Bandit.env_config.hi_arm_hiscore_prob=1.0",
        "custom_envs.Bandit.env_config.lo_arm_score=0.0",
    ];
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stepppo"));
    cmd.args(["train", "--config", "configs/bandit_grpo.yaml", "--out"])
        .arg(&run);
    for set in sets {
        cmd.args(["--set", set]);
    }
    let out = cmd.output().expect("the stepppo binary runs");
    assert!(
        out.status.success(),
        "stepppo train: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (base, last) = (success_at(&run, 0), success_at(&run, STEPS));
    assert!(
        last >= MIN_FINAL && last - base >= MIN_RISE,
        "GRPO on the bandit went {base:.3} → {last:.3} in {STEPS} steps; seeds 1–8 reach \
         0.82–0.95 with a rise of 0.23–0.59 (this test asks for ≥ {MIN_FINAL} and a rise of \
         ≥ {MIN_RISE})"
    );
}
