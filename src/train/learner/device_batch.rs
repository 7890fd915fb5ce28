//! The model inputs of a packed mini-batch on the device: [`DeviceBatch`] pads a
//! [`PackedBatch`](crate::train::learner::batch::PackedBatch)'s sequences or, in the tree [`BatchLayout`]
//! (`tree_forward`), lays them out as a prefix tree ([`crate::train::learner::prefix_tree`]) with its gather
//! indices moved onto the packed positions; it uploads its gather indices and target tokens, adds
//! the constrained-decoding bias of [`ResponseMasks`] when asked, and gathers per-position outputs
//! back to step rows, whatever the layout. Shared by every training-path pass: the PPO update,
//! the rollout-time critic values and reference log-probs, the feature-critic fit, the warm start
//! and the self-imitation replay; the index arithmetic is [`crate::train::learner::batch`]'s, the losses are
//! theirs.

use crate::model::{PaddedBatch, TrainInput, TreeBatch};
use crate::store::StepRecord;
use crate::train::learner::batch::{pad, PackedBatch};
use crate::train::learner::masks::ResponseMasks;
use crate::train::learner::prefix_tree::PrefixTree;
use crate::train::TrainError;
use candle_core::{Device, Tensor, D};

/// How a pass lays out its sequences: right-padded with `pad_id`, or with `tree` (the config's
/// `tree_forward`) as a prefix tree, the sequences of a group sharing their common prefix and the
/// rest packed without padding. Both give the same outputs, to float rounding.
#[derive(Clone, Copy, Debug)]
pub struct BatchLayout {
    /// Token id padding fills with in the padded layout.
    pub pad_id: u32,
    /// Lay the sequences out as a prefix tree instead of padding them.
    pub tree: bool,
}

/// The model inputs of a packed mini-batch on the device.
pub(in crate::train) struct DeviceBatch {
    /// The tokens the model reads; the indices below address its outputs' positions.
    pub(in crate::train) input: TrainInput,
    /// Where a tree input holds each position of the padded `[B, T]` layout; `None` when padded.
    tree: Option<PrefixTree>,
    pub(in crate::train) token_index: Tensor,
    /// The target token at each `token_index` position.
    pub(in crate::train) token_targets: Tensor,
    value_index: Tensor,
    /// `[rows * width, vocab]` constrained-decoding bias of the response tokens, if any.
    pub(in crate::train) logit_bias: Option<Tensor>,
}

impl DeviceBatch {
    /// `p`, packed from `sequences` of `records`, in `layout`; a sequence's group (the prefix it
    /// may share) is its first record's `group_id`.
    pub(in crate::train) fn laid_out(
        p: &PackedBatch,
        (records, sequences): (&[StepRecord], &[Vec<usize>]),
        layout: BatchLayout,
        device: &Device,
    ) -> Result<Self, TrainError> {
        if !layout.tree {
            return Self::new(p, layout.pad_id, device);
        }
        let groups: Vec<u64> = sequences.iter().map(|s| records[s[0]].group_id).collect();
        Self::tree(p, &groups, device)
    }

    /// The sequences of `p` right-padded with `pad_id`.
    pub(in crate::train) fn new(
        p: &PackedBatch,
        pad_id: u32,
        device: &Device,
    ) -> Result<Self, TrainError> {
        let (b, t) = (p.inputs.len(), p.seq_len);
        let (ids, mask) = pad(&p.inputs, t, pad_id);
        let input = TrainInput::Padded(PaddedBatch {
            input_ids: Tensor::from_vec(ids, (b, t), device)?,
            attention_mask: Tensor::from_vec(mask, (b, t), device)?,
        });
        Self::with_indices(p, (input, None), &p.token_index, &p.value_index, device)
    }

    /// The sequences of `p`, the `b`-th of group `groups[b]`, as a prefix tree: each group's
    /// common prefix packed once.
    fn tree(p: &PackedBatch, groups: &[u64], device: &Device) -> Result<Self, TrainError> {
        let tree = PrefixTree::new(p, groups);
        let moved = |index: &[u32]| -> Vec<u32> { index.iter().map(|&i| tree.packed(i)).collect() };
        let (token_index, value_index) = (moved(&p.token_index), moved(&p.value_index));
        let input = TrainInput::Tree(TreeBatch::new(&tree.ids, tree.segments.clone(), device)?);
        Self::with_indices(p, (input, Some(tree)), &token_index, &value_index, device)
    }

    /// `input` (and its tree, if any) with the gather indices into its outputs and `p`'s target
    /// tokens.
    fn with_indices(
        p: &PackedBatch,
        (input, tree): (TrainInput, Option<PrefixTree>),
        token_index: &[u32],
        value_index: &[u32],
        device: &Device,
    ) -> Result<Self, TrainError> {
        let token_targets = p.token_targets();
        Ok(DeviceBatch {
            input,
            tree,
            token_targets: Tensor::new(token_targets.as_slice(), device)?,
            token_index: Tensor::new(token_index, device)?,
            value_index: Tensor::new(value_index, device)?,
            logit_bias: None,
        })
    }

    /// This batch with the constrained-decoding bias of `masks` on `p`'s response tokens.
    pub(in crate::train) fn constrained(
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

    /// Flat indices into the padded `[B, T]` layout of the batch → the positions of the same
    /// tokens in this batch's outputs.
    pub(in crate::train) fn positions(&self, flat: &[u32]) -> Vec<u32> {
        match &self.tree {
            Some(tree) => flat.iter().map(|&i| tree.packed(i)).collect(),
            None => flat.to_vec(),
        }
    }

    /// Per-position values (`[B, T]`, or `[1, N]` of a tree) → `[rows, width]` at the response
    /// tokens.
    pub(in crate::train) fn at_tokens(
        &self,
        x: &Tensor,
        p: &PackedBatch,
    ) -> Result<Tensor, TrainError> {
        Ok(x.flatten_all()?
            .index_select(&self.token_index, D::Minus1)?
            .reshape((p.rows, p.max_response_len))?)
    }

    /// Per-position features (`[B, T, F]`, or `[1, N, F]`) → `[rows, F]` at each step's start.
    pub(in crate::train) fn rows_at_step_starts(&self, x: &Tensor) -> Result<Tensor, TrainError> {
        Ok(x.flatten_to(1)?.index_select(&self.value_index, 0)?)
    }

    /// Per-position features (`[B, T, F]`, or `[1, N, F]`) → `[rows * width, F]` at the response
    /// tokens.
    pub(in crate::train) fn rows_at_tokens(&self, x: &Tensor) -> Result<Tensor, TrainError> {
        Ok(x.flatten_to(1)?.index_select(&self.token_index, 0)?)
    }

    /// Per-position values (`[B, T]`, or `[1, N]`) → `[rows, 1]` at each step's start.
    pub(in crate::train) fn at_step_starts(
        &self,
        x: &Tensor,
        p: &PackedBatch,
    ) -> Result<Tensor, TrainError> {
        Ok(x.flatten_all()?
            .index_select(&self.value_index, D::Minus1)?
            .reshape((p.rows, 1))?)
    }
}
