//! Forward passes over a batch of step records without a gradient: the response log-probs of a
//! model (the reference policy's side of a KL term) and a critic's values at rollout time. Each
//! packs the records' sequences in chunks laid out as the update lays out its mini-batches,
//! padded or as a prefix tree ([`BatchLayout`]). Also the re-scoring of stored records after the
//! fact ([`score_records`]: an estimator's advantages, with a saved critic's values).

use crate::algo::{replay_rows, AdvantageConfig, AdvantageInputs, CriticTarget, ReplayExport};
use crate::model::{Critic as CriticTrunk, Model, TrainInput};
use crate::store::StepRecord;
use crate::train::learner::batch::{context_sequences, pack, PackedBatch};
use crate::train::learner::device_batch::{BatchLayout, DeviceBatch};
use crate::train::learner::masks::ResponseMasks;
use crate::train::TrainError;
use candle_core::{Device, Tensor};

/// Log-probs of every record's response tokens under `model` (no gradient), one forward per
/// chunk of `chunk` sequences in `layout`: the reference policy's side of a KL penalty.
pub fn response_logprobs(
    model: &Model,
    records: &[StepRecord],
    sequences: &[Vec<usize>],
    (chunk, layout): (usize, BatchLayout),
    temperature: f32,
    masks: &ResponseMasks,
) -> Result<Vec<Vec<f32>>, TrainError> {
    let mut out: Vec<Vec<f32>> = records.iter().map(|_| Vec::new()).collect();
    for_each_chunk(
        records,
        sequences,
        (chunk, layout),
        masks,
        true,
        model.device(),
        |p, batch| {
            let (logp, _) = model.head_logprobs_entropy(
                &model.hidden(&batch.input)?,
                &batch.token_index,
                &batch.token_targets,
                temperature,
                batch.logit_bias.as_ref(),
            )?;
            let logp = logp
                .detach()
                .reshape((p.rows, p.max_response_len))?
                .to_vec2::<f32>()?;
            for (row, &r) in p.record_of_row.iter().enumerate() {
                out[r] = logp[row][..records[r].response_ids.len()].to_vec();
            }
            Ok(())
        },
    )?;
    Ok(out)
}

/// Packs `sequences` in chunks of `chunk` sequences, laid out in `layout`, and hands each chunk,
/// on `device`, to `visit`: values read past `masks`' forced prefixes, and with `logit_bias` the
/// constrained-decoding bias of `masks` (needed to score tokens, not values). A chunk gathers
/// similar-length sequences when padded (little padding per forward), a group's sequences when
/// laid out as a tree (their prefix forwarded once).
pub(in crate::train) fn for_each_chunk(
    records: &[StepRecord],
    sequences: &[Vec<usize>],
    (chunk, layout): (usize, BatchLayout),
    masks: &ResponseMasks,
    logit_bias: bool,
    device: &Device,
    mut visit: impl FnMut(&PackedBatch, &DeviceBatch) -> Result<(), TrainError>,
) -> Result<(), TrainError> {
    // Values need the masks only to find where they are read; scoring tokens needs the bias too.
    let unconstrained = ResponseMasks::default();
    let bias_masks = if logit_bias { masks } else { &unconstrained };
    let mut sorted = sequences.to_vec();
    if layout.tree {
        sorted.sort_by_key(|seq| records[seq[0]].group_id);
    } else {
        sorted.sort_by_key(|seq| {
            seq.iter()
                .map(|&r| records[r].obs_ids.len() + records[r].response_ids.len())
                .sum::<usize>()
        });
    }
    for seqs in sorted.chunks(chunk.max(1)) {
        let mut p = pack(records, seqs)?;
        p.read_values_after_forced(records, |r| masks.forced_prefix(r))?;
        if p.rows > 0 {
            let batch = DeviceBatch::laid_out(&p, (records, seqs), layout, device)?;
            visit(&p, &batch.constrained(&p, records, bias_masks)?)?;
        }
    }
    Ok(())
}

/// Critic values of every record at rollout time, no update: per record, one value at the step
/// start (`StepStart`) or one per response token (`AllResponseTokens`), `values_of` run on chunks
/// of `chunk` sequences in `layout`.
pub fn critic_values(
    values_of: &dyn Fn(&TrainInput) -> Result<Tensor, TrainError>,
    records: &[StepRecord],
    sequences: &[Vec<usize>],
    target: CriticTarget,
    (chunk, layout): (usize, BatchLayout),
    masks: &ResponseMasks,
    device: &Device,
) -> Result<Vec<Vec<f32>>, TrainError> {
    let mut out: Vec<Vec<f32>> = records.iter().map(|_| Vec::new()).collect();
    for_each_chunk(
        records,
        sequences,
        (chunk, layout),
        masks,
        false,
        device,
        |p, batch| {
            let values = values_of(&batch.input)?.detach();
            match target {
                CriticTarget::StepStart => {
                    let v = batch
                        .at_step_starts(&values, p)?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    for (row, &r) in p.record_of_row.iter().enumerate() {
                        out[r] = vec![v[row]];
                    }
                }
                CriticTarget::AllResponseTokens => {
                    let v = batch.at_tokens(&values, p)?.to_vec2::<f32>()?;
                    for (row, &r) in p.record_of_row.iter().enumerate() {
                        out[r] = v[row][..records[r].response_ids.len()].to_vec();
                    }
                }
            }
            Ok(())
        },
    )?;
    Ok(out)
}

/// Sequences per forward when re-scoring stored records.
const RESCORE_CHUNK: usize = 16;

/// Re-scores stored `records` (whole trajectories, each in step order) with the estimator of
/// `cfg`: per step its return, advantage and, with `critic` (a saved separate critic), the
/// critic's values at the step start and before each response token, read as a rollout reads
/// them. Without a critic the values are 0 (the export says so).
pub fn score_records(
    records: &[StepRecord],
    cfg: &AdvantageConfig,
    critic: Option<&CriticTrunk>,
) -> Result<ReplayExport, TrainError> {
    let values = match critic {
        Some(critic) => Some(record_values(critic, records)?),
        None => None,
    };
    let inputs = AdvantageInputs {
        values: values.as_ref().map(|(steps, _)| steps.as_slice()),
        token_values: values.as_ref().map(|(_, tokens)| tokens.as_slice()),
        ..AdvantageInputs::default()
    };
    Ok(replay_rows(records, &inputs, cfg)?)
}

/// `critic`'s value at each record's step start and before each of its response tokens, from one
/// pass: the value before a response's first token is its step-start value.
fn record_values(
    critic: &CriticTrunk,
    records: &[StepRecord],
) -> Result<(Vec<f32>, Vec<Vec<f32>>), TrainError> {
    if let Some(r) = records.iter().find(|r| r.response_ids.is_empty()) {
        return Err(TrainError::Data(format!(
            "trajectory {} step {}: an empty response has no position to read a value at",
            r.traj_id, r.step_index
        )));
    }
    let layout = BatchLayout {
        pad_id: 0,
        tree: false,
    };
    let tokens = critic_values(
        &|input| Ok(critic.values_of(input)?),
        records,
        &context_sequences(records),
        CriticTarget::AllResponseTokens,
        (RESCORE_CHUNK, layout),
        &ResponseMasks::default(),
        critic.device(),
    )?;
    let steps = tokens.iter().map(|v| v[0]).collect();
    Ok((steps, tokens))
}
