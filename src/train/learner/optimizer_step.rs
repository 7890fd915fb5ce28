//! One optimizer step: the backward of a loss, its gradients summed over the data-parallel ranks
//! as the optimizer's sharding says (all-reduced; or, for a sharded optimizer, all-reduced or
//! reduce-scattered, the rank's block updated and the blocks all-gathered into every rank's
//! weights), skipped when the loss or a gradient is not finite; and the running means of the
//! metrics an update logs ([`Means`]), merged over ranks. Shared by the PPO update and the
//! value-MLP critics' fit.

use std::ops::Range;

use crate::algo::{AdamW, StepReport};
use crate::dist::shard::{FlatShard, ShardLayout, Sharding};
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
/// Gradients are summed one unit (a decoder layer, or a parameter outside the layers) at a time,
/// so the flat buffers of a sum hold one unit; a sharded optimizer also gathers its weights a
/// unit at a time and holds its whole block (gradient, values, update) beside them.
pub(in crate::train) fn step_over_ranks(
    opt: &mut AdamW,
    local: Option<&GradStore>,
    finite: bool,
    (lr, max_grad_norm): (f64, f64),
    dist: &dyn Collective,
) -> Result<Option<StepReport>, TrainError> {
    let Some((sharding, layout)) = opt.shard().map(|(mode, layout)| (mode, layout.clone())) else {
        let Some(grads) = ranks::summed_gradients(opt, local, finite, dist)? else {
            return Ok(None);
        };
        return Ok(Some(opt.step(&grads, lr, Some(max_grad_norm))?));
    };
    if layout.ranks() != dist.size() {
        return Err(TrainError::Data(format!(
            "an optimizer sharded over {} ranks steps in a world of {}",
            layout.ranks(),
            dist.size()
        )));
    }
    let Some(reached) = ranks::reached_params(opt, local, finite, dist)? else {
        return Ok(None);
    };
    let (grad, grad_norm) = block_gradient(opt, local, sharding, &layout, dist)?;
    let values = block_values(opt, &layout)?;
    let (report, values) = opt.step_block(
        values,
        &grad,
        &reached,
        grad_norm,
        (lr, Some(max_grad_norm)),
    )?;
    if !report.skipped {
        gather_weights(opt, &values, &layout, dist)?;
    }
    Ok(Some(report))
}

/// The summed gradient of this rank's block and the global gradient norm, unit by unit: each
/// unit's gradients all-reduced whole (ZeRO-1, the norm summed as an unsharded step sums it) or
/// reduce-scattered (ZeRO-2, the norm's squares summed over the ranks' blocks).
fn block_gradient(
    opt: &AdamW,
    local: Option<&GradStore>,
    sharding: Sharding,
    layout: &ShardLayout,
    dist: &dyn Collective,
) -> Result<(Tensor, f64), TrainError> {
    let lens = opt.param_lens();
    // Σ g² over slices of `t` added to `sum`, one parameter's slice after another, as an
    // unsharded step sums.
    let add_squares =
        |sum: &mut f64, t: &Tensor, slices: &[Range<usize>]| -> Result<(), TrainError> {
            let parts: Vec<Tensor> = slices
                .iter()
                .map(|r| t.narrow(0, r.start, r.len()))
                .collect::<Result<_, _>>()?;
            *sum = crate::algo::sum_of_squares_after(*sum, &parts)?;
            Ok(())
        };
    let mut squares = 0.0;
    let mut blocks = Vec::with_capacity(layout.units().len());
    for unit in layout.units() {
        let flat = ranks::flat_gradient(opt, local, unit.params.clone(), unit.shard.padded_len())?;
        let range = unit.shard.range();
        let unit_lens = &lens[unit.params.clone()];
        if sharding == Sharding::Optimizer {
            let summed = dist.all_reduce_tensor(&flat)?;
            drop(flat);
            let whole = FlatShard::new(0, 1, unit.shard.len).pieces(unit_lens);
            let slices: Vec<_> = whole.into_iter().map(|p| p.in_block).collect();
            add_squares(&mut squares, &summed, &slices)?;
            // A copy, so that the unit's whole sum is freed here.
            blocks.push(summed.narrow(0, range.start, range.len())?.copy()?);
            continue;
        }
        let scattered = dist.reduce_scatter_tensor(&flat)?;
        drop(flat);
        let block = scattered.narrow(0, 0, range.len())?.copy()?;
        let mine: Vec<_> = unit
            .shard
            .pieces(unit_lens)
            .into_iter()
            .map(|p| p.in_block)
            .collect();
        add_squares(&mut squares, &block, &mine)?;
        blocks.push(block);
    }
    if sharding != Sharding::Optimizer {
        let mut sum = [squares];
        dist.all_reduce_f64(&mut sum)?;
        squares = sum[0];
    }
    Ok((joined(blocks, &opt.device())?, squares.sqrt()))
}

/// Flat tensors end to end (an empty f32 tensor on `device` for none).
fn joined(parts: Vec<Tensor>, device: &candle_core::Device) -> Result<Tensor, TrainError> {
    let parts: Vec<Tensor> = parts.into_iter().filter(|t| t.elem_count() > 0).collect();
    Ok(match parts.as_slice() {
        [] => Tensor::zeros(0, DType::F32, device)?,
        [one] => one.clone(),
        _ => Tensor::cat(&parts, 0)?,
    })
}

/// This rank's block of `opt`'s parameters laid end to end, as a new f32 tensor.
fn block_values(opt: &AdamW, layout: &ShardLayout) -> Result<Tensor, TrainError> {
    let params = opt.params();
    let pieces = layout.pieces();
    let mut parts = Vec::with_capacity(pieces.len());
    for piece in &pieces {
        let flat = params[piece.param].1.as_tensor().flatten_all()?;
        let r = &piece.in_param;
        parts.push(flat.narrow(0, r.start, r.len())?.to_dtype(DType::F32)?);
    }
    let values = joined(parts, &opt.device())?;
    // A copy of its own when one slice is all of it: the update writes into it.
    Ok(match pieces.len() {
        1 => values.copy()?,
        _ => values,
    })
}

/// Every rank's updated block all-gathered unit by unit, and written into `opt`'s parameters.
fn gather_weights(
    opt: &AdamW,
    block: &Tensor,
    layout: &ShardLayout,
    dist: &dyn Collective,
) -> Result<(), TrainError> {
    let params = opt.params();
    for unit in layout.units() {
        let mine = block.narrow(0, unit.in_block, unit.shard.range().len())?;
        let all = dist.all_gather_tensor(&padded_block(mine, &unit.shard)?)?;
        let mut offset = 0;
        for (_, var) in &params[unit.params.clone()] {
            let n = var.elem_count();
            let values = all.narrow(0, offset, n)?.reshape(var.shape())?;
            var.set(&values.to_dtype(var.dtype())?)?;
            offset += n;
        }
    }
    Ok(())
}

/// A rank's block of a unit (its [`FlatShard::range`]) with zeros after it up to a whole block,
/// as the collectives move it.
fn padded_block(block: Tensor, shard: &FlatShard) -> Result<Tensor, TrainError> {
    Ok(match shard.block() - block.elem_count() {
        0 => block,
        n => {
            let zeros = Tensor::zeros(n, block.dtype(), block.device())?;
            Tensor::cat(&[block, zeros], 0)?
        }
    })
}
