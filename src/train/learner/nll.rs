//! The negative log-likelihood of a packed batch's response tokens: the loss of behaviour
//! cloning in the warm start and of self-imitation replay in the update.

use crate::model::Model;
use crate::train::learner::batch::PackedBatch;
use crate::train::learner::device_batch::DeviceBatch;
use crate::train::TrainError;
use candle_core::Tensor;

/// Mean negative log-likelihood of `batch`'s response tokens (a scalar with gradient), from the
/// policy trunk's output `hidden`, under the batch's constrained-decoding bias when it has one.
pub(in crate::train) fn cross_entropy(
    policy: &Model,
    packed: &PackedBatch,
    batch: &DeviceBatch,
    hidden: &Tensor,
) -> Result<Tensor, TrainError> {
    let (picked, _) = policy.head_logprobs_entropy(
        hidden,
        &batch.token_index,
        &batch.token_targets,
        1.0,
        batch.logit_bias.as_ref(),
    )?;
    let weights = Tensor::new(packed.token_mask.as_slice(), policy.device())?;
    let n = packed.num_tokens().max(1) as f64;
    Ok((picked * weights)?.sum_all()?.affine(-1.0 / n, 0.0)?)
}
