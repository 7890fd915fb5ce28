//! Fitting a value MLP critic after each update: the rows it is fitted on (the updated policy's
//! features at each critic target position, or the records' critic states, with a state critic's
//! history of earlier batches), the fit itself in seeded shuffled mini-batches, and a state
//! critic's rollout-time values.

use super::history::{CriticHistory, StateRows};
use crate::algo::loss::explained_variance;
use crate::algo::{value_loss, AdamW, CriticTarget, LossConfig};
use crate::dist::Single;
use crate::model::{Model, ValueMlp};
use crate::seed;
use crate::store::StepRecord;
use crate::train::learner::device_batch::BatchLayout;
use crate::train::learner::masks::ResponseMasks;
use crate::train::learner::optimizer_step::{step_critic, Means};
use crate::train::learner::scoring::for_each_chunk;
use crate::train::TrainError;
use candle_core::{Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The batch a value MLP is fitted on, aligned with `records`: which records train the critic,
/// and per record the return targets and rollout-time values at its critic target positions.
pub struct FitBatch<'a> {
    /// The batch's step records.
    pub records: &'a [StepRecord],
    /// Sequences (lists of record indices in step order).
    pub sequences: &'a [Vec<usize>],
    /// Per record: whether it trains the critic (false: its rows are left out).
    pub keep: &'a [bool],
    /// Per record, the return target at each position (one for step-start values, one per
    /// response token otherwise).
    pub returns: &'a [Vec<f32>],
    /// Per record, the rollout-time values at the same positions (the value-clip reference).
    pub old_values: &'a [Vec<f32>],
    /// The positions the critic is fitted at.
    pub target: CriticTarget,
}

/// How a value MLP is fitted.
pub struct FitSettings<'a> {
    /// Loss settings; the value loss reads its `value_clip`.
    pub loss: &'a LossConfig,
    /// Passes' worth of mini-batches over the newest batch's rows.
    pub epochs: usize,
    /// Rows per mini-batch.
    pub mini_batch: usize,
    /// Learning rate of the critic's AdamW steps.
    pub lr: f64,
    /// Gradient-norm clip of each critic step.
    pub max_grad_norm: f64,
    /// Seed of the mini-batch shuffles.
    pub shuffle_seed: u64,
}

/// Rows a value MLP is fitted on: its inputs at each critic target position of the records that
/// train the critic (the policy's features, or the record's critic state), with their targets
/// and rollout-time values, in record order.
pub struct FeatureRows {
    /// `[n, F]`.
    pub features: Tensor,
    /// Return target of each row.
    pub returns: Vec<f32>,
    /// Rollout-time value of each row (the value-clip reference).
    pub old_values: Vec<f32>,
}

/// One pass of `policy` over the batch (no gradient) laid out as `layout`, gathering
/// [`FeatureRows`].
pub fn feature_rows(
    batch: &FitBatch,
    policy: &Model,
    (layout, masks): (BatchLayout, &ResponseMasks),
) -> Result<FeatureRows, TrainError> {
    let target = batch.target;
    let (mut parts, mut returns, mut old_values) = (Vec::new(), Vec::new(), Vec::new());
    let mut owners = Vec::new();
    for_each_chunk(
        batch.records,
        batch.sequences,
        (FEATURE_CHUNK, layout),
        masks,
        false,
        policy.device(),
        |p, laid_out| {
            let features = policy.value_features(&laid_out.input)?;
            let (at, per_row) = match target {
                CriticTarget::StepStart => (laid_out.rows_at_step_starts(&features)?, 1),
                CriticTarget::AllResponseTokens => {
                    (laid_out.rows_at_tokens(&features)?, p.max_response_len)
                }
            };
            let mut picked = Vec::new();
            for (row, &r) in p.record_of_row.iter().enumerate() {
                if !batch.keep[r] {
                    continue;
                }
                let positions = match target {
                    CriticTarget::StepStart => 1,
                    CriticTarget::AllResponseTokens => batch.records[r].response_ids.len(),
                };
                for j in 0..positions {
                    picked.push((row * per_row + j) as u32);
                    returns.push(batch.returns[r][j]);
                    old_values.push(batch.old_values[r][j]);
                    owners.push(r);
                }
            }
            let picked = Tensor::new(picked.as_slice(), at.device())?;
            parts.push(at.index_select(&picked, 0)?);
            Ok(())
        },
    )?;
    // Record order: a record's rows are contiguous in one chunk, so a stable sort keeps them.
    let mut order: Vec<u32> = (0..owners.len() as u32).collect();
    order.sort_by_key(|&i| owners[i as usize]);
    let permute = |xs: Vec<f32>| order.iter().map(|&i| xs[i as usize]).collect();
    let order_tensor = Tensor::new(order.as_slice(), policy.device())?;
    Ok(FeatureRows {
        features: Tensor::cat(&parts, 0)?.index_select(&order_tensor, 0)?,
        returns: permute(returns),
        old_values: permute(old_values),
    })
}

/// The critic states of `records`, `width` numbers each, flat; an error naming the first record
/// whose state is missing or of another width.
fn critic_states(records: &[&StepRecord], width: usize) -> Result<Vec<f32>, TrainError> {
    let mut flat = Vec::with_capacity(records.len() * width);
    for r in records {
        if r.critic_state.len() != width {
            return Err(TrainError::Data(format!(
                "record (trajectory {}, step {}, env {}) carries a critic state of {} numbers; \
                 the state critic reads {width} (critic.mode: state needs an env that supplies \
                 one, the same for every training env)",
                r.traj_id,
                r.step_index,
                r.env_tag,
                r.critic_state.len()
            )));
        }
        flat.extend_from_slice(&r.critic_state);
    }
    Ok(flat)
}

/// A state critic's fitting rows of this batch: each kept record's critic state, once per
/// critic target position (one for step-start values, one per response token for `token_gae`).
pub fn state_rows(batch: &FitBatch, width: usize) -> Result<StateRows, TrainError> {
    let target = batch.target;
    let (mut states, mut returns, mut old_values) = (Vec::new(), Vec::new(), Vec::new());
    for (r, rec) in batch.records.iter().enumerate() {
        if !batch.keep[r] {
            continue;
        }
        let positions = match target {
            CriticTarget::StepStart => 1,
            CriticTarget::AllResponseTokens => rec.response_ids.len(),
        };
        for j in 0..positions {
            states.push(rec);
            returns.push(batch.returns[r][j]);
            old_values.push(batch.old_values[r][j]);
        }
    }
    Ok(StateRows {
        states: critic_states(&states, width)?,
        returns,
        old_values,
    })
}

/// Every row of a state critic's history as [`FeatureRows`] on `device`.
pub fn history_rows(history: &CriticHistory, device: &Device) -> Result<FeatureRows, TrainError> {
    let rows = history.rows();
    let n = rows.len();
    Ok(FeatureRows {
        features: Tensor::from_vec(rows.states, (n, history.width()), device)?,
        returns: rows.returns,
        old_values: rows.old_values,
    })
}

/// A state critic's rollout-time values of `records`: the value of each record's critic state,
/// once (step-start target) or repeated over its response tokens (`token_gae`: the state does
/// not change within a response).
pub fn state_values(
    critic: &ValueMlp,
    records: &[StepRecord],
    target: CriticTarget,
    device: &Device,
) -> Result<Vec<Vec<f32>>, TrainError> {
    let all: Vec<&StepRecord> = records.iter().collect();
    let width = critic.input_width();
    let states = Tensor::from_vec(critic_states(&all, width)?, (all.len(), width), device)?;
    let values = critic.forward(&states)?.to_vec1::<f32>()?;
    Ok(records
        .iter()
        .zip(values)
        .map(|(r, v)| match target {
            CriticTarget::StepStart => vec![v],
            CriticTarget::AllResponseTokens => vec![v; r.response_ids.len()],
        })
        .collect())
}

/// Sequences per feature pass of [`feature_rows`].
const FEATURE_CHUNK: usize = 64;

/// Fits a value MLP (a feature or state critic) to `rows`: the critic's input scaling set from
/// them, then `settings.epochs` passes' worth of mini-batches of `settings.mini_batch`
/// rows for the `newest` rows of this batch, drawn in seeded shuffled passes over all of `rows`
/// (with a state critic's history, the rows of earlier batches too; without, exactly
/// `critic_epochs` passes). A feature critic's rows are the features of the policy as it is after
/// the actor's epochs (the policy the next rollout's values are read under). Logs the fit's
/// in-sample explained variance (`critic/vf_fit_explained_var`); returns the skipped updates.
pub(in crate::train) fn fit_value_mlp(
    rows: &FeatureRows,
    newest: usize,
    critic: &ValueMlp,
    opt: &mut AdamW,
    settings: &FitSettings,
    means: &mut Means,
) -> Result<usize, TrainError> {
    let n = rows.returns.len();
    if n < 2 {
        return Ok(0);
    }
    critic.standardize_on(&rows.features)?;
    let device = rows.features.device().clone();
    let mini_batch = settings.mini_batch.max(1);
    let wanted = settings.epochs * newest.max(1).div_ceil(mini_batch);
    let mut skipped = 0;
    let mut done = 0;
    for pass in 0.. {
        if done == wanted {
            break;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed::derive(
            settings.shuffle_seed,
            &[FEATURE_FIT_STREAM, pass],
        ));
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.shuffle(&mut rng);
        for chunk in order.chunks(mini_batch).take(wanted - done) {
            done += 1;
            let pick = Tensor::new(chunk, &device)?;
            let values = critic
                .forward(&rows.features.index_select(&pick, 0)?)?
                .unsqueeze(1)?;
            let column = |v: &[f32]| {
                let picked: Vec<f32> = chunk.iter().map(|&i| v[i as usize]).collect();
                Tensor::from_vec(picked, (chunk.len(), 1), &device)
            };
            let mask = Tensor::ones((chunk.len(), 1), candle_core::DType::F32, &device)?;
            let (loss, m) = value_loss(
                &values,
                &column(&rows.old_values)?,
                &column(&rows.returns)?,
                &mask,
                settings.loss,
            )?;
            means.add("critic/vf_loss", m.vf_loss);
            means.add("critic/vf_clipfrac", m.vf_clipfrac);
            means.add("critic/value_mean", m.value_mean);
            // Every rank fits the same rows: no sum over ranks.
            skipped += usize::from(step_critic(
                opt,
                Some(loss),
                (settings.lr, settings.max_grad_norm),
                &Single,
                means,
            )?);
        }
    }
    let fitted: Vec<f64> = critic
        .forward(&rows.features)?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f64::from)
        .collect();
    let returns: Vec<f64> = rows.returns.iter().map(|&r| f64::from(r)).collect();
    means.add(
        "critic/vf_fit_explained_var",
        explained_variance(&fitted, &returns),
    );
    Ok(skipped)
}

/// Seed stream of a feature critic's mini-batch shuffles.
const FEATURE_FIT_STREAM: u64 = 0xfea7;
