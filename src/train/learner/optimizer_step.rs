//! One optimizer step: the backward of a loss, its gradients summed over the data-parallel ranks,
//! skipped when the loss or a gradient is not finite; and the running means of the metrics an
//! update logs ([`Means`]), merged over ranks. Shared by the PPO update and the value-MLP
//! critics' fit.

use crate::algo::AdamW;
use crate::dist::Collective;
use crate::train::learner::ranks;
use crate::train::Scalars;
use crate::train::TrainError;
use candle_core::Tensor;

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
/// finite).
pub(in crate::train) fn step_critic(
    opt: &mut AdamW,
    loss: Option<&Tensor>,
    (lr, max_grad_norm): (f64, f64),
    dist: &dyn Collective,
    means: &mut Means,
) -> Result<bool, TrainError> {
    let (finite, local) = backward(loss)?;
    let Some(grads) = ranks::summed_gradients(opt, local.as_ref(), finite, dist)? else {
        return Ok(true);
    };
    let report = opt.step(&grads, lr, Some(max_grad_norm))?;
    means.add("critic/grad_norm", report.grad_norm);
    Ok(report.skipped)
}
