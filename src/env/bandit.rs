//! Bandit: RAGEN's two-armed, single-turn bandit with named arms. The low-risk arm pays a fixed
//! `lo_arm_score`; the high-risk arm pays `hi_arm_hiscore` with probability `hi_arm_hiscore_prob`,
//! else `hi_arm_loscore`. Success means pulling the high-risk arm (the higher mean).
//!
//! Differences from RAGEN / the paper:
//! - `lo_arm_score` defaults to 0.1 as RAGEN's code; the paper says 0.15.
//! - Which arm is listed first is drawn per reset seed with probability 1/2 (RAGEN swaps the
//!   arm indices the same way); arms are chosen by name only (no numeric ids).
//! - The prompt is condensed: the instruction states the rules, the state lists the two arms.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{bad_value, env_rng, Action, ActionSpace, Env, EnvError, EnvInfo, Transition};

/// The bandit's own keys (`env_type: bandit`): RAGEN's two-armed, single-turn bandit. The
/// low-risk arm pays `lo_arm_score`; the high-risk arm pays `hi_arm_hiscore` with probability
/// `hi_arm_hiscore_prob`, else `hi_arm_loscore`. Success means pulling the high-risk arm (the
/// higher mean). Which arm is listed first is drawn per reset seed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(default)]
pub struct BanditConfig {
    /// Name of the low-risk arm, the action that pulls it: non-empty, without `||`.
    pub lo_arm_name: String,
    /// Name of the high-risk arm: non-empty, without `||`, different from `lo_arm_name`
    /// (compared case-insensitively).
    pub hi_arm_name: String,
    /// Fixed payout of the low-risk arm (RAGEN code 0.1, paper 0.15).
    pub lo_arm_score: f32,
    /// Payout of the high-risk arm when it does not pay `hi_arm_hiscore`.
    pub hi_arm_loscore: f32,
    /// Payout of the high-risk arm with probability `hi_arm_hiscore_prob`.
    pub hi_arm_hiscore: f32,
    /// Probability that the high-risk arm pays `hi_arm_hiscore`, in [0, 1].
    pub hi_arm_hiscore_prob: f64,
}

impl Default for BanditConfig {
    fn default() -> Self {
        BanditConfig {
            lo_arm_name: "phoenix".into(),
            hi_arm_name: "dragon".into(),
            lo_arm_score: 0.1,
            hi_arm_loscore: 0.0,
            hi_arm_hiscore: 1.0,
            hi_arm_hiscore_prob: 0.25,
        }
    }
}

/// The bandit env.
pub struct BanditEnv {
    cfg: BanditConfig,
    /// Arm names in the order shown this episode.
    arms: [String; 2],
    /// What the last pull showed, if any.
    outcome: Option<String>,
    rng: ChaCha8Rng,
}

impl BanditEnv {
    /// A bandit with the keys of `cfg`; errors when an arm name or `hi_arm_hiscore_prob` is invalid.
    pub fn new(cfg: BanditConfig) -> Result<Self, EnvError> {
        let (lo, hi) = (cfg.lo_arm_name.trim(), cfg.hi_arm_name.trim());
        if lo.is_empty() || lo.contains("||") {
            return Err(bad_value(
                "bandit",
                "lo_arm_name",
                "must be a non-empty name without ||",
            ));
        }
        if hi.is_empty() || hi.contains("||") || hi.eq_ignore_ascii_case(lo) {
            return Err(bad_value(
                "bandit",
                "hi_arm_name",
                "must be a non-empty name without || that differs from lo_arm_name",
            ));
        }
        if !(0.0..=1.0).contains(&cfg.hi_arm_hiscore_prob) {
            return Err(bad_value(
                "bandit",
                "hi_arm_hiscore_prob",
                "must be in [0, 1]",
            ));
        }
        let arms = [lo.to_string(), hi.to_string()];
        Ok(BanditEnv {
            cfg,
            arms,
            outcome: None,
            rng: env_rng(0, 0),
        })
    }

    fn hi_arm(&self) -> &str {
        self.cfg.hi_arm_name.trim()
    }
}

impl Env for BanditEnv {
    fn tag(&self) -> &str {
        "bandit"
    }

    fn reset(&mut self, seed: u64) -> Result<String, EnvError> {
        self.rng = env_rng(seed, 1);
        let (lo, hi) = (self.cfg.lo_arm_name.trim(), self.cfg.hi_arm_name.trim());
        self.arms = if self.rng.random_bool(0.5) {
            [hi.to_string(), lo.to_string()]
        } else {
            [lo.to_string(), hi.to_string()]
        };
        self.outcome = None;
        Ok(self.state_text())
    }

    fn step(&mut self, action: &Action) -> Result<Transition, EnvError> {
        let arm = match action {
            Action::Move(name) if self.outcome.is_none() => self
                .arms
                .iter()
                .find(|a| a.eq_ignore_ascii_case(name))
                .cloned(),
            _ => None,
        };
        let Some(arm) = arm else {
            return Ok(Transition {
                observation: self.state_text(),
                reward: 0.0,
                terminated: self.outcome.is_some(),
                truncated: false,
                info: EnvInfo::default(),
            });
        };
        let is_hi = arm == self.hi_arm();
        let reward = if !is_hi {
            self.cfg.lo_arm_score
        } else if self.rng.random_bool(self.cfg.hi_arm_hiscore_prob) {
            self.cfg.hi_arm_hiscore
        } else {
            self.cfg.hi_arm_loscore
        };
        self.outcome = Some(format!("{arm}: {reward} points"));
        Ok(Transition {
            observation: self.state_text(),
            reward,
            terminated: true,
            truncated: false,
            info: EnvInfo {
                success: is_hi,
                action_is_valid: true,
                action_is_effective: true,
                metrics: Vec::new(),
            },
        })
    }

    fn instruction(&self) -> String {
        "Bandit: pull one of two arms once. Each arm's reward distribution is related to its name; pick the arm that pays more on average.".to_string()
    }

    fn state_text(&self) -> String {
        match &self.outcome {
            Some(outcome) => outcome.clone(),
            None => format!("Arms: {}, {}", self.arms[0], self.arms[1]),
        }
    }

    fn action_space(&self) -> ActionSpace {
        ActionSpace::Named(self.arms.to_vec())
    }

    fn max_steps(&self) -> usize {
        1
    }

    fn oracle_action(&self) -> Result<Action, EnvError> {
        Ok(Action::Move(self.hi_arm().to_string()))
    }

    fn random_action(&self, rng: &mut ChaCha8Rng) -> Result<Action, EnvError> {
        Ok(Action::Move(self.arms[rng.random_range(0..2)].clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arm_order_varies_with_the_seed_and_names_match_case_insensitively() {
        let mut env = BanditEnv::new(BanditConfig::default()).unwrap();
        let firsts: std::collections::BTreeSet<String> =
            (0..20).map(|s| env.reset(s).unwrap()).collect();
        assert_eq!(firsts.len(), 2, "{firsts:?}");
        env.reset(0).unwrap();
        let t = env.step(&Action::Move("DRAGON".into())).unwrap();
        assert!(t.terminated && t.info.success);
        assert!(t.reward == 0.0 || t.reward == 1.0);
        env.reset(0).unwrap();
        let t = env.step(&Action::Move("Phoenix".into())).unwrap();
        assert!(!t.info.success && (t.reward - 0.1).abs() < 1e-6);
    }

    #[test]
    fn high_arm_pays_with_the_configured_probability() {
        let mut env = BanditEnv::new(BanditConfig::default()).unwrap();
        let n = 4000;
        let wins: f32 = (0..n)
            .map(|s| {
                env.reset(s).unwrap();
                env.step(&Action::Move("dragon".into())).unwrap().reward
            })
            .sum();
        let rate = wins / n as f32;
        assert!((rate - 0.25).abs() < 0.03, "{rate}");
    }
}
