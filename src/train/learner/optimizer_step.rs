//! One optimizer step: the backward of a loss, its gradients summed over the data-parallel ranks
//! as the optimizer's sharding says (all-reduced; or, for a sharded optimizer, all-reduced or
//! reduce-scattered, the rank's block updated and the blocks all-gathered into every rank's
//! weights), skipped when the loss or a gradient is not finite; and the running means of the
//! metrics an update logs ([`Means`]), merged over ranks. Shared by the PPO update and the
//! value-MLP critics' fit.

use crate::algo::{AdamW, StepReport};
use crate::dist::shard::{FlatShard, Sharding};
use crate::dist::Collective;
use crate::train::learner::ranks;
use crate::train::Scalars;
use crate::train::TrainError;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

/// Running means of the update's metrics.
///
/// A value measured on one rank's part of a mini-batch counts as that part's share of the
/// mini-batch ([`Means::part`]), so merged over ranks it is the whole mini-batch's value (for the
/// means the losses aggregate); a value every rank holds alike counts once per rank.
pub struct Means {
    sums: Scalars,
    counts: std::collections::BTreeMap<String, f64>,
    /// Weight of the values added now (1 outside [`Means::part`]).
    weight: f64,
}

impl Default for Means {
    fn default() -> Self {
        Self {
            sums: Scalars::new(),
            counts: Default::default(),
            weight: 1.0,
        }
    }
}

impl Means {
    /// Adds `v` to the running mean `name` at the current weight; non-finite values are skipped.
    pub fn add(&mut self, name: &str, v: f64) {
        if v.is_finite() {
            *self.sums.entry(name.into()).or_default() += v * self.weight;
            *self.counts.entry(name.into()).or_default() += self.weight;
        }
    }

    /// Runs `f` with the values it adds weighted by this rank's `share` of the mini-batch.
    pub(in crate::train) fn part<T>(
        &mut self,
        share: &ranks::Share,
        f: impl FnOnce(&mut Self) -> T,
    ) -> T {
        self.weight = share.scale();
        let out = f(self);
        self.weight = 1.0;
        out
    }

    /// The sums and counts of every rank.
    pub(in crate::train) fn merged(self, dist: &dyn Collective) -> Result<Self, TrainError> {
        let (sums, counts) = ranks::merge_means(self.sums, self.counts, dist)?;
        Ok(Self {
            sums,
            counts,
            weight: 1.0,
        })
    }

    pub(in crate::train) fn into_scalars(self, out: &mut Scalars) {
        for (k, s) in self.sums {
            out.insert(k.clone(), s / self.counts[&k]);
        }
    }
}

/// Whether `loss` is finite, and its gradients when it is (none without a loss).
pub(in crate::train) fn backward(
    loss: Option<&Tensor>,
) -> Result<(bool, Option<candle_core::backprop::GradStore>), TrainError> {
    let Some(loss) = loss else {
        return Ok((true, None));
    };
    let value = loss.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
    if !value.is_finite() {
        return Ok((false, None));
    }
    Ok((true, Some(crate::model::backward(loss)?)))
}

/// Steps the critic's optimizer on `loss` (this rank's part; `None`: none here), its gradients
/// summed over ranks; returns whether the update was skipped (a loss or a gradient that is not
/// finite). The loss's graph is freed before the step.
pub(in crate::train) fn step_critic(
    opt: &mut AdamW,
    loss: Option<Tensor>,
    (lr, max_grad_norm): (f64, f64),
    dist: &dyn Collective,
    means: &mut Means,
) -> Result<bool, TrainError> {
    let (finite, local) = backward(loss.as_ref())?;
    drop(loss);
    let Some(report) = step_over_ranks(opt, local.as_ref(), finite, (lr, max_grad_norm), dist)?
    else {
        return Ok(true);
    };
    means.add("critic/grad_norm", report.grad_norm);
    Ok(report.skipped)
}

/// Steps `opt` at learning rate `lr` (gradients clipped to `max_grad_norm`) on this rank's
/// gradients `local` (`None`: nothing back-propagated here; `finite`: whether its loss was
/// finite), summed over the ranks. `None` when a rank's loss was not finite: every rank skips.
pub(in crate::train) fn step_over_ranks(
    opt: &mut AdamW,
    local: Option<&GradStore>,
    finite: bool,
    (lr, max_grad_norm): (f64, f64),
    dist: &dyn Collective,
) -> Result<Option<StepReport>, TrainError> {
    let Some((sharding, shard)) = opt.shard().map(|(mode, shard)| (mode, *shard)) else {
        let Some(grads) = ranks::summed_gradients(opt, local, finite, dist)? else {
            return Ok(None);
        };
        return Ok(Some(opt.step(&grads, lr, Some(max_grad_norm))?));
    };
    if shard.ranks != dist.size() {
        return Err(TrainError::Data(format!(
            "an optimizer sharded over {} ranks steps in a world of {}",
            shard.ranks,
            dist.size()
        )));
    }
    let flat = ranks::flat_gradients(opt, local, finite, shard.padded_len(), dist)?;
    let Some((flat, reached)) = flat else {
        return Ok(None);
    };
    let (grad, grad_norm) = block_gradient(opt, &flat, sharding, &shard, dist)?;
    drop(flat);
    let values = block_values(opt, &shard)?;
    let (report, values) = opt.step_block(
        values,
        &grad,
        &reached,
        grad_norm,
        (lr, Some(max_grad_norm)),
    )?;
    if !report.skipped {
        gather_weights(opt, values, &shard, dist)?;
    }
    Ok(Some(report))
}

/// The summed gradient of this rank's block and the global gradient norm: all-reduced whole
/// (ZeRO-1, the norm summed as an unsharded step sums it) or reduce-scattered (ZeRO-2, the
/// norm's squares summed over the ranks' blocks).
fn block_gradient(
    opt: &AdamW,
    flat: &Tensor,
    sharding: Sharding,
    shard: &FlatShard,
    dist: &dyn Collective,
) -> Result<(Tensor, f64), TrainError> {
    let range = shard.range();
    // Σ g² of the given slices of `t`, summed as an unsharded step sums its gradients.
    let squares = |t: &Tensor, slices: &[std::ops::Range<usize>]| -> Result<f64, TrainError> {
        let parts: Vec<Tensor> = slices
            .iter()
            .map(|r| t.narrow(0, r.start, r.len()))
            .collect::<Result<_, _>>()?;
        Ok(crate::algo::sum_of_squares(&parts)?)
    };
    let lens = opt.param_lens();
    if sharding == Sharding::Optimizer {
        let summed = dist.all_reduce_tensor(flat)?;
        let whole = FlatShard::new(0, 1, shard.len).pieces(&lens);
        let slices: Vec<_> = whole.into_iter().map(|p| p.in_block).collect();
        let norm = squares(&summed, &slices)?;
        // A copy, so that the whole sum is freed here.
        let block = summed.narrow(0, range.start, range.len())?.copy()?;
        return Ok((block, norm.sqrt()));
    }
    let scattered = dist.reduce_scatter_tensor(flat)?;
    let block = scattered.narrow(0, 0, range.len())?.contiguous()?;
    let mine: Vec<_> = shard
        .pieces(&lens)
        .into_iter()
        .map(|p| p.in_block)
        .collect();
    let mut sum = [squares(&block, &mine)?];
    dist.all_reduce_f64(&mut sum)?;
    Ok((block, sum[0].sqrt()))
}

/// This rank's block of `opt`'s parameters laid end to end, as a new f32 tensor.
fn block_values(opt: &AdamW, shard: &FlatShard) -> Result<Tensor, TrainError> {
    let params = opt.params();
    let mut parts = Vec::new();
    for piece in shard.pieces(&opt.param_lens()) {
        let flat = params[piece.param].1.as_tensor().flatten_all()?;
        let r = piece.in_param;
        parts.push(flat.narrow(0, r.start, r.len())?.to_dtype(DType::F32)?);
    }
    Ok(match parts.as_slice() {
        [] => Tensor::zeros(0, DType::F32, &opt.device())?,
        [one] => one.copy()?,
        _ => Tensor::cat(&parts, 0)?,
    })
}

/// Every rank's updated block all-gathered, and written into `opt`'s parameters.
fn gather_weights(
    opt: &AdamW,
    block: Tensor,
    shard: &FlatShard,
    dist: &dyn Collective,
) -> Result<(), TrainError> {
    let all = dist.all_gather_tensor(&padded_block(block, shard)?)?;
    let mut offset = 0;
    for (_, var) in opt.params() {
        let n = var.elem_count();
        let values = all.narrow(0, offset, n)?.reshape(var.shape())?;
        var.set(&values.to_dtype(var.dtype())?)?;
        offset += n;
    }
    Ok(())
}

/// A rank's block (its [`FlatShard::range`]) with zeros after it up to a whole block, as the
/// collectives move it.
fn padded_block(block: Tensor, shard: &FlatShard) -> Result<Tensor, TrainError> {
    Ok(match shard.block() - block.elem_count() {
        0 => block,
        n => {
            let zeros = Tensor::zeros(n, block.dtype(), block.device())?;
            Tensor::cat(&[block, zeros], 0)?
        }
    })
}
