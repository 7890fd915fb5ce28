//! Serde configuration of the algorithm module: credit assignment ([`AdvantageConfig`]),
//! StarPO-S filtering ([`FilterConfig`]), PPO/critic losses ([`LossConfig`]) and the optimiser
//! ([`OptimizerConfig`]). Field names follow ROLL (`adv_estimator`, `lambd`, `pg_clip`, ...);
//! every struct rejects unknown keys and has documented defaults. It does not own the trainer's
//! YAML file, which embeds these structs.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::AlgoError;

/// Which credit-assignment method turns rewards (and values) into advantages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Estimator {
    /// StepPO: GAE over interaction steps, the critic read at each step's start; needs a critic.
    #[default]
    StepGae,
    /// PPO baseline: GAE over the generated tokens of the trajectory; needs a critic. `gae`
    /// (ROLL's name) is accepted too.
    #[serde(alias = "gae")]
    TokenGae,
    /// StarPO / ROLL `reinforce`: trajectory score normalised by `reward_normalization` (GRPO
    /// with the default normalisation). `grpo` is accepted too.
    #[serde(alias = "grpo")]
    Reinforce,
    /// Dr.GRPO: trajectory score minus its group mean (no std division).
    DrGrpo,
    /// Leave-one-out baseline within the trajectory group.
    Rloo,
    /// REINFORCE++: per-token discounted return, token-weighted batch whitening.
    ReinforcePlusPlus,
    /// REINFORCE++ with a group-mean baseline on the trajectory score, then batch whitening.
    ReinforcePlusPlusBaseline,
    /// GiGPO: episode advantage + ω · anchor-state step advantage.
    Gigpo,
    /// Discounted step returns normalised by `reward_normalization`.
    StepReinforce,
}

impl Estimator {
    /// Whether the estimator reads critic values.
    pub fn needs_critic(self) -> bool {
        matches!(self, Estimator::StepGae | Estimator::TokenGae)
    }

    /// The keys of `reward_normalization` this estimator reads (none: it normalises no rewards;
    /// GiGPO's own normalisation is `gigpo.mode`).
    pub fn reward_normalization_keys(self) -> &'static [&'static str] {
        match self {
            Estimator::Reinforce | Estimator::StepReinforce => &["grouping", "method"],
            Estimator::DrGrpo | Estimator::Rloo | Estimator::ReinforcePlusPlusBaseline => {
                &["grouping"]
            }
            Estimator::StepGae
            | Estimator::TokenGae
            | Estimator::ReinforcePlusPlus
            | Estimator::Gigpo => &[],
        }
    }

    /// Where the critic is trained for this estimator (`None` when there is no critic).
    pub fn critic_target(self) -> Option<CriticTarget> {
        match self {
            Estimator::StepGae => Some(CriticTarget::StepStart),
            Estimator::TokenGae => Some(CriticTarget::AllResponseTokens),
            _ => None,
        }
    }
}

/// Positions at which the critic's value loss is applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CriticTarget {
    /// Only the last token before a step's response (StepPO `value_mask[:, 0]`).
    StepStart,
    /// Every response token (token-level GAE).
    AllResponseTokens,
}

/// Which rows share normalisation statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Grouping {
    /// The trajectory group (`group_id`: same task and seed) — GRPO.
    #[default]
    TrajGroupId,
    /// Same environment tag (`env_tag`).
    Tags,
    /// The whole batch.
    Batch,
    /// ROLL `state_group_id`: same `state_hash` within a trajectory group (for trajectory-level
    /// scores, the state at step 0).
    State,
}

/// How a group's values are normalised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum NormMethod {
    /// Unchanged.
    Identity,
    /// x − mean.
    Mean,
    /// (x − mean)/(std + 1e-6); a group with ≤ 1 member or std ≤ 1e-6 becomes all zeros.
    #[default]
    MeanStd,
    /// Same as `mean_std` (ROLL's name for it; ROLL no longer clamps it to [−1, 3]).
    AsymClip,
}

/// `reward_normalization` (ROLL): how the critic-free estimators normalise trajectory scores
/// (`reinforce`) or discounted step returns (`step_reinforce`) within groups of rows; `dr_grpo`,
/// `rloo` and `reinforce_plus_plus_baseline` take their baseline groups from `grouping`. A key the
/// run's estimator does not read is an error ([`Estimator::reward_normalization_keys`]): the
/// other estimators normalise no rewards. `traj_group_id` with `train_env_manager.group_size: 1`
/// makes every advantage of `reinforce` or `step_reinforce` zero, so it is an error unless
/// `method` is `identity`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RewardNormalization {
    /// Which rows share normalisation statistics (default `traj_group_id`).
    pub grouping: Option<Grouping>,
    /// How a group's values are normalised (default `mean_std`).
    pub method: Option<NormMethod>,
}

impl RewardNormalization {
    /// The grouping in effect (`traj_group_id` unless written).
    pub fn grouping(&self) -> Grouping {
        self.grouping.unwrap_or_default()
    }

    /// The method in effect (`mean_std` unless written).
    pub fn method(&self) -> NormMethod {
        self.method.unwrap_or_default()
    }
}

/// GiGPO group normalisation mode (verl-agent names; `mean`/`mean_std` accepted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum GigpoMode {
    /// F_norm = 1: the advantage is x − group mean. `mean` is accepted too.
    #[default]
    #[serde(alias = "mean")]
    MeanNorm,
    /// F_norm = std + 1e-6 (zero advantages for groups with std ≤ 1e-6). `mean_std` is accepted
    /// too.
    #[serde(alias = "mean_std")]
    MeanStdNorm,
}

/// `gigpo`: GiGPO's settings (`adv_estimator: gigpo`). A step's advantage is
/// `episode_weight` · A^E + `step_weight` · A^S: A^E normalises the trajectory scores within the
/// trajectory group, A^S the discounted step returns (γ = `step_reward_gamma`) within
/// anchor-state groups, the steps of one trajectory group that start from the same state.
/// Singleton groups get 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct GigpoConfig {
    /// Weight of the episode-level advantage; finite.
    pub episode_weight: f32,
    /// ω, weight of the step-level advantage; finite.
    pub step_weight: f32,
    /// How each group's values are normalised: (x − mean) / F_norm.
    pub mode: GigpoMode,
    /// When set, in [0, 1]: states whose observation texts have a Ratcliff/Obershelp similarity
    /// ≥ this threshold share a step group (paper: 0.9 for search QA); unset: states share a
    /// group when their `state_hash` is equal.
    pub similarity_threshold: Option<f32>,
}

impl Default for GigpoConfig {
    fn default() -> Self {
        Self {
            episode_weight: 1.0,
            step_weight: 1.0,
            mode: GigpoMode::MeanNorm,
            similarity_threshold: None,
        }
    }
}

/// Credit assignment settings (ROLL names).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdvantageConfig {
    /// The credit-assignment method (default `step_gae`).
    pub adv_estimator: Estimator,
    /// Discount across steps (step_gae), tokens (token_gae, reinforce++), or steps for `ret` of
    /// the score-based estimators. Default 1.0.
    pub gamma: f32,
    /// GAE λ (ROLL spelling; `lam` accepted). Default 1.0 (verl/StepPO).
    #[serde(alias = "lam")]
    pub lambd: f32,
    /// Whiten the estimator's advantages. `None` = the method's own default (on for step_gae,
    /// token_gae and the REINFORCE++ pair, off for the others).
    pub whiten_advantages: Option<bool>,
    /// Clamp advantages to ±c after whitening.
    pub advantage_clip: Option<f32>,
    /// Clamp rewards to ±c (after normalisation for the score-based estimators, the raw step
    /// rewards for the GAE/REINFORCE++ ones).
    pub reward_clip: Option<f32>,
    /// How the score-based estimators normalise rewards within groups; a key the estimator
    /// does not read is an error.
    pub reward_normalization: RewardNormalization,
    /// γ of the discounted step returns of `gigpo` and `step_reinforce` (default 0.95).
    pub step_reward_gamma: f32,
    /// GiGPO's weights and step grouping, read when `adv_estimator` is `gigpo`.
    pub gigpo: GigpoConfig,
    /// Caps at 0 the final advantage of every step whose response did not parse
    /// (`action_is_valid` false). Such a step left the env where it was, so it earns no credit for
    /// what the trajectory did next; without the cap a malformed answer in a successful
    /// trajectory is reinforced, rare tokens and all.
    pub clamp_invalid_advantages: bool,
}

impl Default for AdvantageConfig {
    fn default() -> Self {
        Self {
            adv_estimator: Estimator::StepGae,
            gamma: 1.0,
            lambd: 1.0,
            whiten_advantages: None,
            advantage_clip: None,
            reward_clip: None,
            reward_normalization: RewardNormalization::default(),
            step_reward_gamma: 0.95,
            gigpo: GigpoConfig::default(),
            clamp_invalid_advantages: false,
        }
    }
}

/// StarPO-S uncertainty filter ordering.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FilterType {
    /// Keep the groups with the largest in-group reward std.
    #[default]
    Std,
    /// Keep the groups with the smallest in-group reward std.
    StdRev,
}

/// StarPO-S `rollout_filter_ratio` / `rollout_filter_type`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FilterConfig {
    /// Which groups are kept: the highest (`std`) or lowest (`std_rev`) in-group reward std.
    #[serde(rename = "type")]
    pub filter_type: FilterType,
    /// Fraction of groups kept, in (0, 1]; 1.0 (default) turns the filter off.
    pub keep_ratio: f32,
}

impl Default for FilterConfig {
    fn default() -> Self {
        Self {
            filter_type: FilterType::Std,
            keep_ratio: 1.0,
        }
    }
}

/// One importance ratio per token, or one length-normalised ratio per step row (GSPO).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RatioType {
    /// One importance ratio π / π_old per token (PPO).
    #[default]
    Token,
    /// One length-normalised ratio per sequence (per step in the `window` layout): the
    /// geometric mean of its tokens' ratios (GSPO-token).
    Segment,
}

/// How token losses become one scalar (verl/ROLL `loss_agg_mode`). A row is a sequence of the
/// mini-batch (a trajectory in the `concat` layout, a step in `window`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum LossAggMode {
    /// The mean over every scored token of the mini-batch.
    #[serde(rename = "token-mean")]
    TokenMean,
    /// Each row's token sum, averaged over rows.
    #[serde(rename = "seq-mean-token-sum")]
    SeqMeanTokenSum,
    /// Each row's token mean, averaged over rows.
    #[default]
    #[serde(rename = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// Each row's token sum divided by the mini-batch's mask width, averaged over rows
    /// (Dr.GRPO).
    #[serde(rename = "seq-mean-token-sum-norm")]
    SeqMeanTokenSumNorm,
}

/// KL estimator of log π_θ − log π_ref.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// k1: lr = log π_θ − log π_ref (verl `kl`, which is accepted too).
    #[serde(alias = "kl")]
    K1,
    /// k3: exp(−lr) + lr − 1, clamped to [−10, 10] (verl `low_var_kl`, which is accepted too).
    #[default]
    #[serde(alias = "low_var_kl")]
    K3,
}

/// Whether the KL penalty is a loss term or subtracted from token rewards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlMode {
    /// + coef · agg(KL) (ROLL `use_kl_loss` / `kl_loss_coef`).
    #[default]
    Loss,
    /// r_t −= coef · KL_t (ROLL `add_token_level_kl` / `init_kl_coef`).
    Reward,
}

/// KL to a reference policy; `coef` 0 (default) disables it and needs no reference model.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KlConfig {
    /// Weight of the KL term; ≥ 0, and 0 (default) turns the KL off.
    pub coef: f32,
    /// How the per-token KL is estimated (default k3).
    pub estimator: KlEstimator,
    /// Whether the KL joins the loss or is charged to the token rewards.
    pub mode: KlMode,
}

/// PPO actor and critic loss settings (ROLL defaults).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossConfig {
    /// One ratio per token (PPO) or one length-normalised ratio per sequence (GSPO).
    pub ratio_type: RatioType,
    /// Symmetric clip ε (default 0.2).
    pub pg_clip: f32,
    /// ε_low; `None` = `pg_clip`.
    pub pg_clip_low: Option<f32>,
    /// ε_high; `None` = `pg_clip` (StarPO-S / DAPO: 0.28).
    pub pg_clip_high: Option<f32>,
    /// Dual-clip PPO: a negative-advantage token's loss is also bounded by
    /// [`LossConfig::dual_clip_bound`] · |A|.
    pub dual_clip_loss: bool,
    /// Dual-clip bound c; `None` = ROLL's 1 + 2·pg_clip (verl uses 3.0).
    pub dual_clip_c: Option<f32>,
    /// How token losses become one scalar, for the actor and the critic.
    pub loss_agg_mode: LossAggMode,
    /// Constant L of `seq-mean-token-sum-norm`; `None` = the mask width.
    pub loss_norm_len: Option<usize>,
    /// KL penalty against the reference policy (off by default).
    pub kl: KlConfig,
    /// Weight of the entropy bonus subtracted from the actor loss (0 = off).
    pub entropy_loss_coef: f32,
    /// Weight λ of the unlikelihood term on negative-advantage tokens (0 = off); see
    /// [`crate::algo::policy_loss`].
    pub negative_unlikelihood_coef: f32,
    /// Critic value clip c_v (verl 0.5); `None` = unclipped.
    pub value_clip: Option<f32>,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            ratio_type: RatioType::Token,
            pg_clip: 0.2,
            pg_clip_low: None,
            pg_clip_high: None,
            dual_clip_loss: false,
            dual_clip_c: None,
            loss_agg_mode: LossAggMode::SeqMeanTokenMean,
            loss_norm_len: None,
            kl: KlConfig::default(),
            entropy_loss_coef: 0.0,
            negative_unlikelihood_coef: 0.0,
            value_clip: None,
        }
    }
}

impl LossConfig {
    /// ε_low in effect: `pg_clip_low`, else `pg_clip`.
    pub fn clip_low(&self) -> f32 {
        self.pg_clip_low.unwrap_or(self.pg_clip)
    }

    /// ε_high in effect: `pg_clip_high`, else `pg_clip`.
    pub fn clip_high(&self) -> f32 {
        self.pg_clip_high.unwrap_or(self.pg_clip)
    }

    /// Dual-clip bound c in effect: `dual_clip_c`, else 1 + 2·`pg_clip`.
    pub fn dual_clip_bound(&self) -> f32 {
        self.dual_clip_c.unwrap_or(1.0 + 2.0 * self.pg_clip)
    }
}

/// Learning-rate schedule after warmup.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// The learning rate stays where the warm-up left it.
    #[default]
    Constant,
    /// Cosine decay to 0 at the run's last update.
    Cosine,
}

/// AdamW, clipping and schedule (actor and critic have separate learning rates).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    /// The actor's learning rate; > 0.
    pub lr: f64,
    /// The critic's learning rate; > 0.
    pub critic_lr: f64,
    /// AdamW (β1, β2), each in [0, 1).
    pub betas: (f64, f64),
    /// AdamW ε added to the denominator; > 0.
    pub eps: f64,
    /// AdamW weight decay; ≥ 0.
    pub weight_decay: f64,
    /// Updates of linear learning-rate warm-up (0 = none).
    pub warmup_steps: usize,
    /// Learning-rate schedule after the warm-up.
    pub schedule: Schedule,
    /// Global gradient-norm bound; `None` = no clipping.
    pub max_grad_norm: Option<f64>,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            lr: 1e-6,
            critic_lr: 1e-5,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            warmup_steps: 0,
            schedule: Schedule::Constant,
            max_grad_norm: Some(1.0),
        }
    }
}

fn check(ok: bool, key: &str, reason: &str) -> Result<(), AlgoError> {
    if ok {
        Ok(())
    } else {
        Err(AlgoError::InvalidConfig {
            key: key.to_string(),
            reason: reason.to_string(),
        })
    }
}

fn positive_opt(v: Option<f32>, key: &str) -> Result<(), AlgoError> {
    check(
        v.is_none_or(|c| c > 0.0 && c.is_finite()),
        key,
        "must be a positive number",
    )
}

impl AdvantageConfig {
    /// Checks value ranges; errors name the offending key.
    pub fn validate(&self) -> Result<(), AlgoError> {
        check(
            (0.0..=1.0).contains(&self.gamma),
            "gamma",
            "must lie in [0, 1]",
        )?;
        check(
            (0.0..=1.0).contains(&self.lambd),
            "lambd",
            "must lie in [0, 1]",
        )?;
        check(
            (0.0..=1.0).contains(&self.step_reward_gamma),
            "step_reward_gamma",
            "must lie in [0, 1]",
        )?;
        self.check_reward_normalization_is_read()?;
        positive_opt(self.advantage_clip, "advantage_clip")?;
        positive_opt(self.reward_clip, "reward_clip")?;
        check(
            self.gigpo
                .similarity_threshold
                .is_none_or(|t| (0.0..=1.0).contains(&t)),
            "gigpo.similarity_threshold",
            "must lie in [0, 1]",
        )?;
        check(
            self.gigpo.episode_weight.is_finite(),
            "gigpo.episode_weight",
            "must be finite",
        )?;
        check(
            self.gigpo.step_weight.is_finite(),
            "gigpo.step_weight",
            "must be finite",
        )
    }
}

impl AdvantageConfig {
    /// An error naming `reward_normalization.<key>` when the estimator does not read that key:
    /// a setting that would change nothing is refused, not ignored.
    fn check_reward_normalization_is_read(&self) -> Result<(), AlgoError> {
        let written = [
            ("grouping", self.reward_normalization.grouping.is_some()),
            ("method", self.reward_normalization.method.is_some()),
        ];
        let reads = self.adv_estimator.reward_normalization_keys();
        if let Some((key, _)) = written.iter().find(|(k, w)| *w && !reads.contains(k)) {
            let estimator = serde_json::to_value(self.adv_estimator)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            let reason = if reads.is_empty() {
                format!("{estimator} normalises no rewards; remove reward_normalization")
            } else {
                format!(
                    "{estimator} reads only reward_normalization.{}",
                    reads.join(", ")
                )
            };
            return check(false, &format!("reward_normalization.{key}"), &reason);
        }
        Ok(())
    }
}

impl FilterConfig {
    /// Checks that `keep_ratio` lies in (0, 1]; the error names the key.
    pub fn validate(&self) -> Result<(), AlgoError> {
        check(
            self.keep_ratio > 0.0 && self.keep_ratio <= 1.0,
            "filter.keep_ratio",
            "must lie in (0, 1]",
        )
    }
}

impl LossConfig {
    /// Checks the clip ranges, the dual-clip bound, `loss_norm_len`, `kl.coef` and `value_clip`;
    /// errors name the offending key.
    pub fn validate(&self) -> Result<(), AlgoError> {
        check(self.pg_clip > 0.0, "pg_clip", "must be positive")?;
        positive_opt(self.pg_clip_low, "pg_clip_low")?;
        positive_opt(self.pg_clip_high, "pg_clip_high")?;
        check(self.dual_clip_bound() > 1.0, "dual_clip_c", "must exceed 1")?;
        check(
            self.loss_norm_len != Some(0),
            "loss_norm_len",
            "must be positive",
        )?;
        check(self.kl.coef >= 0.0, "kl.coef", "must be non-negative")?;
        positive_opt(self.value_clip, "value_clip")
    }
}

impl OptimizerConfig {
    /// Checks the learning rates, betas, eps, weight decay and `max_grad_norm`; errors name the
    /// offending key.
    pub fn validate(&self) -> Result<(), AlgoError> {
        check(self.lr > 0.0, "optimizer.lr", "must be positive")?;
        check(
            self.critic_lr > 0.0,
            "optimizer.critic_lr",
            "must be positive",
        )?;
        let (b1, b2) = self.betas;
        check(
            (0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2),
            "optimizer.betas",
            "must lie in [0, 1)",
        )?;
        check(self.eps > 0.0, "optimizer.eps", "must be positive")?;
        check(
            self.weight_decay >= 0.0,
            "optimizer.weight_decay",
            "must be non-negative",
        )?;
        check(
            self.max_grad_norm.is_none_or(|m| m > 0.0),
            "optimizer.max_grad_norm",
            "must be positive",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roll_names_and_aliases_parse() {
        let cfg: AdvantageConfig = serde_json::from_str(
            r#"{"adv_estimator":"gae","lam":0.95,"reward_normalization":{"grouping":"batch","method":"mean"}}"#,
        )
        .unwrap();
        assert_eq!(cfg.adv_estimator, Estimator::TokenGae);
        assert_eq!(cfg.lambd, 0.95);
        assert_eq!(cfg.reward_normalization.grouping(), Grouping::Batch);
        let grpo: AdvantageConfig = serde_json::from_str(r#"{"adv_estimator":"grpo"}"#).unwrap();
        assert_eq!(grpo.adv_estimator, Estimator::Reinforce);
        let loss: LossConfig =
            serde_json::from_str(r#"{"loss_agg_mode":"seq-mean-token-sum-norm"}"#).unwrap();
        assert_eq!(loss.loss_agg_mode, LossAggMode::SeqMeanTokenSumNorm);
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_name() {
        let err = serde_json::from_str::<LossConfig>(r#"{"pg_clipp":0.2}"#).unwrap_err();
        assert!(err.to_string().contains("pg_clipp"), "{err}");
        let err = serde_json::from_str::<FilterConfig>(r#"{"ratio":0.5}"#).unwrap_err();
        assert!(err.to_string().contains("ratio"), "{err}");
    }

    #[test]
    fn validation_names_the_key() {
        let cfg = AdvantageConfig {
            gamma: 1.5,
            ..Default::default()
        };
        assert!(cfg.validate().unwrap_err().to_string().contains("gamma"));
        let f = FilterConfig {
            keep_ratio: 0.0,
            ..Default::default()
        };
        assert!(f.validate().unwrap_err().to_string().contains("keep_ratio"));
        assert!(AdvantageConfig::default().validate().is_ok());
        assert!(LossConfig::default().validate().is_ok());
        assert!(OptimizerConfig::default().validate().is_ok());
    }

    #[test]
    fn asymmetric_clip_and_dual_clip_defaults() {
        let cfg = LossConfig {
            pg_clip_high: Some(0.28),
            ..Default::default()
        };
        assert_eq!((cfg.clip_low(), cfg.clip_high()), (0.2, 0.28));
        assert!((cfg.dual_clip_bound() - 1.4).abs() < 1e-6);
    }
}
