//! The model inputs of a packed mini-batch on the device: [`DeviceBatch`] pads a
//! [`PackedBatch`](super::batch::PackedBatch)'s sequences (or lays them out as a prefix tree,
//! [`super::prefix_tree`], its gather indices moved onto the packed positions), uploads its gather
//! indices and target tokens, adds the constrained-decoding bias of [`ResponseMasks`] when asked,
//! and gathers per-position outputs back to step rows, whatever the layout. Shared by the PPO
//! update, the warm start and the self-imitation replay; the index arithmetic is
//! [`super::batch`]'s, the losses are theirs.

use super::batch::{pad, PackedBatch};
use super::masks::ResponseMasks;
use super::prefix_tree::PrefixTree;
use super::TrainError;
use crate::model::{PaddedBatch, TrainInput, TreeBatch};
use crate::store::StepRecord;
use candle_core::{Device, Tensor, D};

/// The model inputs of a packed mini-batch on the device (the update's and the warm start's).
pub(super) struct DeviceBatch {
    /// The tokens the model reads; the indices below address its outputs' positions.
    pub(super) input: TrainInput,
    pub(super) token_index: Tensor,
    /// The target token at each `token_index` position.
    pub(super) token_targets: Tensor,
    value_index: Tensor,
    /// `[rows * width, vocab]` constrained-decoding bias of the response tokens, if any.
    pub(super) logit_bias: Option<Tensor>,
}

impl DeviceBatch {
    /// The sequences of `p` right-padded with `pad_id`.
    pub(super) fn new(p: &PackedBatch, pad_id: u32, device: &Device) -> Result<Self, TrainError> {
        let (b, t) = (p.inputs.len(), p.seq_len);
        let (ids, mask) = pad(&p.inputs, t, pad_id);
        let input = TrainInput::Padded(PaddedBatch {
            input_ids: Tensor::from_vec(ids, (b, t), device)?,
            attention_mask: Tensor::from_vec(mask, (b, t), device)?,
        });
        Self::with_indices(p, input, &p.token_index, &p.value_index, device)
    }

    /// The sequences of `p`, the `b`-th of group `groups[b]`, as a prefix tree: each group's
    /// common prefix packed once.
    pub(super) fn tree(
        p: &PackedBatch,
        groups: &[u64],
        device: &Device,
    ) -> Result<Self, TrainError> {
        let tree = PrefixTree::new(p, groups);
        let moved = |index: &[u32]| -> Vec<u32> { index.iter().map(|&i| tree.packed(i)).collect() };
        let (token_index, value_index) = (moved(&p.token_index), moved(&p.value_index));
        let input = TrainInput::Tree(TreeBatch::new(&tree.ids, tree.segments, device)?);
        Self::with_indices(p, input, &token_index, &value_index, device)
    }

    /// `input` with the gather indices into its outputs and `p`'s target tokens.
    fn with_indices(
        p: &PackedBatch,
        input: TrainInput,
        token_index: &[u32],
        value_index: &[u32],
        device: &Device,
    ) -> Result<Self, TrainError> {
        let t = p.seq_len;
        let token_targets: Vec<u32> = p
            .token_index
            .iter()
            .map(|&i| {
                p.targets[i as usize / t]
                    .get(i as usize % t)
                    .copied()
                    .unwrap_or(0)
            })
            .collect();
        Ok(DeviceBatch {
            input,
            token_targets: Tensor::new(token_targets.as_slice(), device)?,
            token_index: Tensor::new(token_index, device)?,
            value_index: Tensor::new(value_index, device)?,
            logit_bias: None,
        })
    }

    /// This batch with the constrained-decoding bias of `masks` on `p`'s response tokens.
    pub(super) fn constrained(
        self,
        p: &PackedBatch,
        records: &[StepRecord],
        masks: &ResponseMasks,
    ) -> Result<Self, TrainError> {
        let device = self.token_index.device().clone();
        Ok(DeviceBatch {
            logit_bias: masks.logit_bias(p, records, &device)?,
            ..self
        })
    }

    /// The padded ids and mask, for passes that read padded sequences only.
    pub(super) fn padded(&self) -> Result<&PaddedBatch, TrainError> {
        match &self.input {
            TrainInput::Padded(b) => Ok(b),
            TrainInput::Tree(_) => Err(TrainError::Data(
                "this pass reads padded sequences, not a prefix tree".into(),
            )),
        }
    }

    /// Per-position values (`[B, T]`, or `[1, N]` of a tree) → `[rows, width]` at the response
    /// tokens.
    pub(super) fn at_tokens(&self, x: &Tensor, p: &PackedBatch) -> Result<Tensor, TrainError> {
        Ok(x.flatten_all()?
            .index_select(&self.token_index, D::Minus1)?
            .reshape((p.rows, p.max_response_len))?)
    }

    /// Per-position features (`[B, T, F]`, or `[1, N, F]`) → `[rows, F]` at each step's start.
    pub(super) fn rows_at_step_starts(&self, x: &Tensor) -> Result<Tensor, TrainError> {
        Ok(x.flatten_to(1)?.index_select(&self.value_index, 0)?)
    }

    /// Per-position features (`[B, T, F]`, or `[1, N, F]`) → `[rows * width, F]` at the response
    /// tokens.
    pub(super) fn rows_at_tokens(&self, x: &Tensor) -> Result<Tensor, TrainError> {
        Ok(x.flatten_to(1)?.index_select(&self.token_index, 0)?)
    }

    /// Per-position values (`[B, T]`, or `[1, N]`) → `[rows, 1]` at each step's start.
    pub(super) fn at_step_starts(&self, x: &Tensor, p: &PackedBatch) -> Result<Tensor, TrainError> {
        Ok(x.flatten_all()?
            .index_select(&self.value_index, D::Minus1)?
            .reshape((p.rows, 1))?)
    }
}
