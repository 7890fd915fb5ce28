//! The padded model inputs of a packed mini-batch on the device: [`DeviceBatch`] pads a
//! [`PackedBatch`](super::batch::PackedBatch)'s sequences, uploads its gather indices and target
//! tokens, adds the constrained-decoding bias of [`ResponseMasks`] when asked, and gathers
//! per-position outputs back to step rows. Shared by the PPO update, the warm start and the
//! self-imitation replay; the index arithmetic is [`super::batch`]'s, the losses are theirs.

use super::batch::{pad, PackedBatch};
use super::masks::ResponseMasks;
use super::TrainError;
use crate::store::StepRecord;
use candle_core::{Device, Tensor, D};

/// The padded model inputs of a packed mini-batch on the device (the update's and the warm
/// start's).
pub(super) struct DeviceBatch {
    pub(super) ids: Tensor,
    pub(super) mask: Tensor,
    pub(super) token_index: Tensor,
    /// The target token at each `token_index` position.
    pub(super) token_targets: Tensor,
    value_index: Tensor,
    /// `[rows * width, vocab]` constrained-decoding bias of the response tokens, if any.
    pub(super) logit_bias: Option<Tensor>,
}

impl DeviceBatch {
    pub(super) fn new(p: &PackedBatch, pad_id: u32, device: &Device) -> Result<Self, TrainError> {
        let (b, t) = (p.inputs.len(), p.seq_len);
        let (ids, mask) = pad(&p.inputs, t, pad_id);
        let (targets, _) = pad(&p.targets, t, pad_id);
        let token_targets: Vec<u32> = p.token_index.iter().map(|&i| targets[i as usize]).collect();
        Ok(DeviceBatch {
            token_targets: Tensor::new(token_targets.as_slice(), device)?,
            ids: Tensor::from_vec(ids, (b, t), device)?,
            mask: Tensor::from_vec(mask, (b, t), device)?,
            token_index: Tensor::new(p.token_index.as_slice(), device)?,
            value_index: Tensor::new(p.value_index.as_slice(), device)?,
            logit_bias: None,
        })
    }

    /// The batch of `new` with the constrained-decoding bias of `masks` on its response tokens.
    pub(super) fn constrained(
        p: &PackedBatch,
        pad_id: u32,
        device: &Device,
        records: &[StepRecord],
        masks: &ResponseMasks,
    ) -> Result<Self, TrainError> {
        Ok(DeviceBatch {
            logit_bias: masks.logit_bias(p, records, device)?,
            ..Self::new(p, pad_id, device)?
        })
    }

    /// `[B, T]` per-position values → `[rows, width]` at the response tokens.
    pub(super) fn at_tokens(&self, x: &Tensor, p: &PackedBatch) -> Result<Tensor, TrainError> {
        Ok(x.flatten_all()?
            .index_select(&self.token_index, D::Minus1)?
            .reshape((p.rows, p.max_response_len))?)
    }

    /// `[B, T, F]` per-position features → `[rows, F]` at each step's start.
    pub(super) fn rows_at_step_starts(&self, x: &Tensor) -> Result<Tensor, TrainError> {
        Ok(x.flatten_to(1)?.index_select(&self.value_index, 0)?)
    }

    /// `[B, T, F]` per-position features → `[rows * width, F]` at the response tokens.
    pub(super) fn rows_at_tokens(&self, x: &Tensor) -> Result<Tensor, TrainError> {
        Ok(x.flatten_to(1)?.index_select(&self.token_index, 0)?)
    }

    /// `[B, T]` per-position values → `[rows, 1]` at each step's start.
    pub(super) fn at_step_starts(&self, x: &Tensor, p: &PackedBatch) -> Result<Tensor, TrainError> {
        Ok(x.flatten_all()?
            .index_select(&self.value_index, D::Minus1)?
            .reshape((p.rows, 1))?)
    }
}
