//! PPO-family losses on candle tensors already gathered per step row: the clipped surrogate
//! with token or segment (GSPO-token) ratios, asymmetric and dual clip, KL to a reference
//! policy and the entropy bonus; the clipped critic loss; `loss_agg_mode` aggregation; and the
//! per-token KL-in-reward penalty. It does not run models.
//!
//! Shapes: every tensor argument is `[N, L]` (N step rows, one response per row, padded to L
//! tokens), float (f32 or f64), on one device. `mask` is 1 on response tokens and 0 on padding.
//! For the step-GAE critic, pass `[N, 1]` tensors holding the value at each step's start.

use candle_core::{DType, Tensor};

use super::config::{KlEstimator, KlMode, LossAggMode, LossConfig, RatioType};
use super::AlgoError;

/// verl clamps log-ratios to ±20 before `exp`.
pub const LOG_RATIO_BOUND: f64 = 20.0;
/// verl clamps the GSPO log-ratio at 10.
const GSPO_LOG_RATIO_MAX: f64 = 10.0;
/// verl clamps k3 to ±10.
const K3_BOUND: f64 = 10.0;

/// Diagnostics of one actor loss evaluation (masked token means unless stated).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyMetrics {
    /// The clipped surrogate loss, aggregated by `loss_agg_mode`.
    pub pg_loss: f64,
    /// The aggregated KL to the reference before its coefficient (0 when the KL loss is off).
    pub kl_loss: f64,
    /// The unlikelihood term before its coefficient (0 when off).
    pub unlikelihood_loss: f64,
    /// Token entropy, aggregated by `loss_agg_mode`.
    pub entropy: f64,
    /// The loss backpropagated: the surrogate plus the weighted KL and unlikelihood terms, minus
    /// the weighted entropy bonus.
    pub total_loss: f64,
    /// verl `pg_clipfrac`: the clipped term is the active one.
    pub clipfrac: f64,
    /// ROLL `ppo_ratio_high_clipfrac`: ratio > 1 + ε_high.
    pub clipfrac_high: f64,
    /// ROLL `ppo_ratio_low_clipfrac`: ratio < 1 − ε_low.
    pub clipfrac_low: f64,
    /// verl `pg_clipfrac_lower`: the dual-clip bound is active.
    pub clipfrac_lower: f64,
    /// verl `ppo_kl`: mean(log π_old − log π).
    pub approx_kl: f64,
    /// Mean importance ratio over the response tokens.
    pub ratio_mean: f64,
    /// Smallest importance ratio over the response tokens (0 when there are none).
    pub ratio_min: f64,
    /// Largest importance ratio over the response tokens (0 when there are none).
    pub ratio_max: f64,
}

/// Diagnostics of one critic loss evaluation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ValueMetrics {
    /// ½ · the aggregated squared value error (the larger of clipped and unclipped per token).
    pub vf_loss: f64,
    /// Fraction of masked positions where the clipped error is the larger (0 when unclipped).
    pub vf_clipfrac: f64,
    /// 1 − Var(R − V)/Var(R) over masked positions (0 when Var(R) is 0).
    pub vf_explained_var: f64,
    /// Mean predicted value over masked positions.
    pub value_mean: f64,
}

fn check_shapes(named: &[(&'static str, &Tensor)]) -> Result<(), AlgoError> {
    let expected = named[0].1.dims().to_vec();
    for (what, t) in named {
        if t.rank() != 2 || t.dims() != expected.as_slice() {
            return Err(AlgoError::Shape {
                what,
                expected: expected.clone(),
                got: t.dims().to_vec(),
            });
        }
    }
    Ok(())
}

/// Per-row count of mask tokens, read back to the host.
fn row_counts(mask: &Tensor) -> Result<Vec<f64>, AlgoError> {
    Ok(mask.sum(1)?.to_dtype(DType::F64)?.to_vec1::<f64>()?)
}

/// Aggregates token losses `[N, L]` to a scalar by `mode`. Sequence modes average over the
/// rows with at least one mask token (ROLL); `seq-mean-token-sum-norm` divides each row's sum
/// by `norm_len` (default: the mask width L).
pub fn agg_loss(
    loss: &Tensor,
    mask: &Tensor,
    mode: LossAggMode,
    norm_len: Option<usize>,
) -> Result<Tensor, AlgoError> {
    let masked = (loss * mask)?;
    let counts = row_counts(mask)?;
    let valid_rows = counts.iter().filter(|&&c| c > 0.0).count().max(1) as f64;
    let out = match mode {
        LossAggMode::TokenMean => {
            let tokens = counts.iter().sum::<f64>().max(1.0);
            masked.sum_all()?.affine(1.0 / tokens, 0.0)?
        }
        LossAggMode::SeqMeanTokenSum => masked.sum_all()?.affine(1.0 / valid_rows, 0.0)?,
        LossAggMode::SeqMeanTokenMean => {
            let per_row = masked
                .sum(1)?
                .broadcast_div(&mask.sum(1)?.clamp(1.0, f64::INFINITY)?)?;
            per_row.sum_all()?.affine(1.0 / valid_rows, 0.0)?
        }
        LossAggMode::SeqMeanTokenSumNorm => {
            let len = norm_len.unwrap_or(mask.dim(1)?).max(1) as f64;
            masked.sum_all()?.affine(1.0 / (valid_rows * len), 0.0)?
        }
    };
    Ok(out)
}

/// The number `agg_loss` divides the masked sum by under `mode`, before its clamp to at least 1:
/// the mask tokens (`token-mean`), the rows with a token (sequence modes), times `norm_len`
/// (default `width`) for `seq-mean-token-sum-norm`. `counts` are the rows' mask tokens. Ranks
/// that each hold part of a batch weight their losses by their share of it.
pub fn agg_normaliser(
    counts: &[f64],
    width: usize,
    mode: LossAggMode,
    norm_len: Option<usize>,
) -> f64 {
    let valid_rows = counts.iter().filter(|&&c| c > 0.0).count() as f64;
    match mode {
        LossAggMode::TokenMean => counts.iter().sum(),
        LossAggMode::SeqMeanTokenSum | LossAggMode::SeqMeanTokenMean => valid_rows,
        LossAggMode::SeqMeanTokenSumNorm => valid_rows * norm_len.unwrap_or(width).max(1) as f64,
    }
}

/// Importance ratio per token: exp(clamp(lp − old)) (`token`), or the GSPO-token ratio
/// sg[s_i]·π/sg[π] with s_i = exp(masked mean of the row's log-ratios) (`segment`).
fn importance_ratio(
    logprobs: &Tensor,
    log_ratio: &Tensor,
    mask: &Tensor,
    ratio_type: RatioType,
) -> Result<Tensor, AlgoError> {
    match ratio_type {
        RatioType::Token => Ok(log_ratio.exp()?),
        RatioType::Segment => {
            let counts = mask.sum_keepdim(1)?.clamp(1.0, f64::INFINITY)?;
            let seq = (log_ratio * mask)?
                .sum_keepdim(1)?
                .broadcast_div(&counts)?
                .detach();
            let log_s = (logprobs - logprobs.detach())?.broadcast_add(&seq)?;
            Ok(log_s.minimum(GSPO_LOG_RATIO_MAX)?.exp()?)
        }
    }
}

/// Per-token KL estimate of log π − log π_ref.
fn kl_estimate(
    logprobs: &Tensor,
    ref_logprobs: &Tensor,
    estimator: KlEstimator,
) -> Result<Tensor, AlgoError> {
    let lr = (logprobs - ref_logprobs)?;
    Ok(match estimator {
        KlEstimator::K1 => lr,
        KlEstimator::K3 => ((lr.neg()?.exp()? + &lr)? - 1.0)?.clamp(-K3_BOUND, K3_BOUND)?,
    })
}

/// The PPO actor loss (a scalar with gradient) and its metrics.
///
/// ℓ = max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high)); with `dual_clip_loss`, ℓ ← min(ℓ, −c·A)
/// where A < 0; then `agg(ℓ) + β·agg(KL) − c_H·agg(entropy) + λ·agg(U)` (KL only in `loss` mode
/// with `kl.coef` > 0, which requires `ref_logprobs`; U only with `negative_unlikelihood_coef`
/// λ > 0). U = |A|·−log(1 − π) on the tokens with A < 0 that were a choice (old log-prob < 0:
/// a token constrained decoding forces has log-prob exactly 0 and nothing to push). Its gradient
/// on the token's logit is |A|·π, where the surrogate's is |A|·ρ·(1 − π): together a near-certain
/// wrong choice is pushed as hard as an uncertain one.
pub fn policy_loss(
    logprobs: &Tensor,
    old_logprobs: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    ref_logprobs: Option<&Tensor>,
    entropy: &Tensor,
    cfg: &LossConfig,
) -> Result<(Tensor, PolicyMetrics), AlgoError> {
    check_shapes(&[
        ("logprobs", logprobs),
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("mask", mask),
        ("entropy", entropy),
    ])?;
    let mask = &mask.to_dtype(logprobs.dtype())?;
    let log_ratio = (logprobs - old_logprobs)?.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)?;
    let ratio = importance_ratio(logprobs, &log_ratio, mask, cfg.ratio_type)?;
    let (low, high) = (cfg.clip_low() as f64, cfg.clip_high() as f64);
    let neg_adv = advantages.neg()?;
    let unclipped = (&neg_adv * &ratio)?;
    let clipped_term = (&neg_adv * ratio.clamp(1.0 - low, 1.0 + high)?)?;
    let clipped = unclipped.maximum(&clipped_term)?;
    let (token_loss, dual_bound) = if cfg.dual_clip_loss {
        let bound = neg_adv.affine(cfg.dual_clip_bound() as f64, 0.0)?;
        let negative = advantages.lt(0.0)?;
        (
            negative.where_cond(&clipped.minimum(&bound)?, &clipped)?,
            Some(bound),
        )
    } else {
        (clipped.clone(), None)
    };
    let mode = cfg.loss_agg_mode;
    let pg_loss = agg_loss(&token_loss, mask, mode, cfg.loss_norm_len)?;
    let mut total = pg_loss.clone();
    let mut kl_value = 0.0;
    if cfg.kl.coef > 0.0 && cfg.kl.mode == KlMode::Loss {
        let reference = ref_logprobs.ok_or(AlgoError::MissingReference)?;
        check_shapes(&[("logprobs", logprobs), ("ref_logprobs", reference)])?;
        let kl = agg_loss(
            &kl_estimate(logprobs, reference, cfg.kl.estimator)?,
            mask,
            mode,
            cfg.loss_norm_len,
        )?;
        kl_value = scalar(&kl)?;
        total = (total + kl.affine(cfg.kl.coef as f64, 0.0)?)?;
    }
    let mut unlikelihood_value = 0.0;
    if cfg.negative_unlikelihood_coef > 0.0 {
        let u = agg_loss(
            &negative_unlikelihood(logprobs, old_logprobs, advantages)?,
            mask,
            mode,
            cfg.loss_norm_len,
        )?;
        unlikelihood_value = scalar(&u)?;
        total = (total + u.affine(cfg.negative_unlikelihood_coef as f64, 0.0)?)?;
    }
    let entropy_agg = agg_loss(entropy, mask, mode, cfg.loss_norm_len)?;
    if cfg.entropy_loss_coef != 0.0 {
        total = (total - entropy_agg.affine(cfg.entropy_loss_coef as f64, 0.0)?)?;
    }
    let host = HostTokens::read(
        mask,
        &ratio,
        &log_ratio,
        advantages,
        &unclipped,
        &clipped_term,
        &clipped,
        dual_bound.as_ref(),
    )?;
    let metrics = PolicyMetrics {
        pg_loss: scalar(&pg_loss)?,
        kl_loss: kl_value,
        unlikelihood_loss: unlikelihood_value,
        entropy: scalar(&entropy_agg)?,
        total_loss: scalar(&total)?,
        ..host.metrics(low, high)
    };
    Ok((total, metrics))
}

/// Smallest 1 − π the unlikelihood term takes a log of.
const UNLIKELIHOOD_FLOOR: f64 = 1e-6;

/// Per-token |A|·−log(1 − π) where A < 0 and the token was a choice (old log-prob < 0), else 0.
fn negative_unlikelihood(
    logprobs: &Tensor,
    old_logprobs: &Tensor,
    advantages: &Tensor,
) -> Result<Tensor, AlgoError> {
    let rest = logprobs
        .exp()?
        .affine(-1.0, 1.0)?
        .clamp(UNLIKELIHOOD_FLOOR, 1.0)?;
    let weight = (advantages.lt(0.0)?.to_dtype(logprobs.dtype())?
        * old_logprobs.lt(0.0)?.to_dtype(logprobs.dtype())?)?
    .mul(&advantages.abs()?)?;
    Ok((rest.log()?.neg()? * weight)?)
}

fn scalar(t: &Tensor) -> Result<f64, AlgoError> {
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

fn host_flat(t: &Tensor) -> Result<Vec<f64>, AlgoError> {
    Ok(t.detach()
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?)
}

/// Masked token values read back to compute the clip/ratio metrics.
struct HostTokens {
    ratio: Vec<f64>,
    log_ratio: Vec<f64>,
    clipped_active: Vec<bool>,
    dual_active: Vec<bool>,
}

impl HostTokens {
    #[allow(clippy::too_many_arguments)]
    fn read(
        mask: &Tensor,
        ratio: &Tensor,
        log_ratio: &Tensor,
        advantages: &Tensor,
        unclipped: &Tensor,
        clipped_term: &Tensor,
        clipped: &Tensor,
        dual_bound: Option<&Tensor>,
    ) -> Result<Self, AlgoError> {
        let keep: Vec<bool> = host_flat(mask)?.iter().map(|&m| m > 0.0).collect();
        let select = |v: Vec<f64>| -> Vec<f64> {
            v.into_iter()
                .zip(&keep)
                .filter(|(_, &k)| k)
                .map(|(x, _)| x)
                .collect()
        };
        let (l1, l2) = (
            select(host_flat(unclipped)?),
            select(host_flat(clipped_term)?),
        );
        let clipped_active = l1.iter().zip(&l2).map(|(a, b)| b > a).collect();
        let dual_active = match dual_bound {
            Some(bound) => {
                let (adv, c, b) = (
                    select(host_flat(advantages)?),
                    select(host_flat(clipped)?),
                    select(host_flat(bound)?),
                );
                adv.iter()
                    .zip(c.iter().zip(&b))
                    .map(|(&a, (&c, &b))| a < 0.0 && b < c)
                    .collect()
            }
            None => vec![false; l1.len()],
        };
        Ok(Self {
            ratio: select(host_flat(ratio)?),
            log_ratio: select(host_flat(log_ratio)?),
            clipped_active,
            dual_active,
        })
    }

    fn metrics(&self, low: f64, high: f64) -> PolicyMetrics {
        let n = self.ratio.len().max(1) as f64;
        let frac = |count: usize| count as f64 / n;
        let empty = self.ratio.is_empty();
        PolicyMetrics {
            clipfrac: frac(self.clipped_active.iter().filter(|&&b| b).count()),
            clipfrac_high: frac(self.ratio.iter().filter(|&&r| r > 1.0 + high).count()),
            clipfrac_low: frac(self.ratio.iter().filter(|&&r| r < 1.0 - low).count()),
            clipfrac_lower: frac(self.dual_active.iter().filter(|&&b| b).count()),
            approx_kl: -self.log_ratio.iter().sum::<f64>() / n,
            ratio_mean: self.ratio.iter().sum::<f64>() / n,
            ratio_min: if empty {
                0.0
            } else {
                self.ratio.iter().copied().fold(f64::INFINITY, f64::min)
            },
            ratio_max: if empty {
                0.0
            } else {
                self.ratio.iter().copied().fold(f64::NEG_INFINITY, f64::max)
            },
            ..PolicyMetrics::default()
        }
    }
}

/// The critic loss ½·agg(max((V − R)², (V_clip − R)²)) with V_clip = V_old + clamp(V − V_old,
/// ±`value_clip`) (unclipped when `value_clip` is `None`), aggregated by `loss_agg_mode`.
pub fn value_loss(
    values: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    cfg: &LossConfig,
) -> Result<(Tensor, ValueMetrics), AlgoError> {
    check_shapes(&[
        ("values", values),
        ("old_values", old_values),
        ("returns", returns),
        ("mask", mask),
    ])?;
    let mask = &mask.to_dtype(values.dtype())?;
    let err = (values - returns)?.sqr()?;
    let (err, clipfrac) = match cfg.value_clip {
        Some(c) => {
            let c = c as f64;
            let clipped_v = (old_values + (values - old_values)?.clamp(-c, c)?)?;
            let err_clipped = (clipped_v - returns)?.sqr()?;
            let active = err_clipped.gt(&err)?.to_dtype(values.dtype())?;
            let frac = scalar(&agg_loss(&active, mask, LossAggMode::TokenMean, None)?)?;
            (err.maximum(&err_clipped)?, frac)
        }
        None => (err, 0.0),
    };
    let loss = agg_loss(&err, mask, cfg.loss_agg_mode, cfg.loss_norm_len)?.affine(0.5, 0.0)?;
    let keep: Vec<bool> = host_flat(mask)?.iter().map(|&m| m > 0.0).collect();
    let pick = |t: &Tensor| -> Result<Vec<f64>, AlgoError> {
        Ok(host_flat(t)?
            .into_iter()
            .zip(&keep)
            .filter(|(_, &k)| k)
            .map(|(x, _)| x)
            .collect())
    };
    let (v, r) = (pick(values)?, pick(returns)?);
    let metrics = ValueMetrics {
        vf_loss: scalar(&loss)?,
        vf_clipfrac: clipfrac,
        vf_explained_var: explained_variance(&v, &r),
        value_mean: v.iter().sum::<f64>() / v.len().max(1) as f64,
    };
    Ok((loss, metrics))
}

/// 1 − Var(R − V)/Var(R) (unbiased variances; 0 when Var(R) is 0).
pub fn explained_variance(values: &[f64], returns: &[f64]) -> f64 {
    VarianceParts::of(values, returns).explained()
}

/// The two variances explained variance is made of, kept apart so that figures of many batches
/// can be pooled (Σ n · residual / Σ n · returns).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VarianceParts {
    /// Var(R), unbiased.
    pub returns: f64,
    /// Var(R − V), unbiased.
    pub residual: f64,
}

impl VarianceParts {
    /// The unbiased variances of `returns` and of `returns − values` (paired by index).
    pub fn of(values: &[f64], returns: &[f64]) -> Self {
        let residual: Vec<f64> = returns.iter().zip(values).map(|(r, v)| r - v).collect();
        let var = |xs: &[f64]| super::normalize::mean_std(xs).1.powi(2);
        Self {
            returns: var(returns),
            residual: var(&residual),
        }
    }

    /// 1 − residual / returns; 0 when the returns do not vary.
    pub fn explained(self) -> f64 {
        if self.returns <= 0.0 {
            return 0.0;
        }
        1.0 - self.residual / self.returns
    }
}

/// Per-token KL-in-reward penalty `coef · KL(log π_old − log π_ref)` for each step's response
/// tokens (ROLL `add_token_level_kl` / `init_kl_coef`); pass it as
/// [`crate::algo::AdvantageInputs::token_reward_penalty`].
pub fn kl_reward_penalty(
    old_logprobs: &[Vec<f32>],
    ref_logprobs: &[Vec<f32>],
    coef: f32,
    estimator: KlEstimator,
) -> Result<Vec<Vec<f32>>, AlgoError> {
    if old_logprobs.len() != ref_logprobs.len() {
        return Err(AlgoError::LengthMismatch {
            what: "ref_logprobs",
            expected: old_logprobs.len(),
            got: ref_logprobs.len(),
        });
    }
    old_logprobs
        .iter()
        .zip(ref_logprobs)
        .map(|(old, reference)| {
            if old.len() != reference.len() {
                return Err(AlgoError::LengthMismatch {
                    what: "ref_logprobs row",
                    expected: old.len(),
                    got: reference.len(),
                });
            }
            Ok(old
                .iter()
                .zip(reference)
                .map(|(&o, &r)| coef * kl_value(o - r, estimator))
                .collect())
        })
        .collect()
}

fn kl_value(lr: f32, estimator: KlEstimator) -> f32 {
    match estimator {
        KlEstimator::K1 => lr,
        KlEstimator::K3 => ((-lr).exp() + lr - 1.0).clamp(-K3_BOUND as f32, K3_BOUND as f32),
    }
}
