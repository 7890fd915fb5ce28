//! The targets' log-probs and the entropies of a logit matrix as one op: per row of `z = logits /
//! temperature + bias`, one pass for the maximum and one for `Σ e^(z − max)` and `Σ e^(z − max)
//! (z − max)` give `log p(target) = z_target − lse` and `H = ln Σ − Σ e (z − max) / Σ`. The
//! backward recomputes the row's probabilities: `∂/∂z_j = g_lp (δ_jt − p_j) − g_H p_j (log p_j +
//! H)`, divided by the temperature.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::{f32_data, from_host, u32_data, with_host, ROWS_PER_TASK};
use crate::model::Result;

const NAME: &str = "logprobs-entropy";

/// Log-prob of `targets [N]` and entropy per row of `logits [N, V]` divided by `temperature`,
/// with the optional constant `bias [N, V]` added after (both `[N]`, differentiable in `logits`).
pub(crate) fn logprobs_entropy(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f32,
    bias: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let op = LogprobsEntropy {
        inv_temp: 1.0 / temperature,
        bias: bias.map(|b| b.contiguous()).transpose()?,
    };
    let targets = targets.to_dtype(candle_core::DType::U32)?.contiguous()?;
    let out = logits.contiguous()?.apply_op2(&targets, op)?;
    Ok((out.get(0)?, out.get(1)?))
}

struct LogprobsEntropy {
    inv_temp: f32,
    bias: Option<Tensor>,
}

/// One row's scaled logits and the statistics of their softmax.
struct Row<'a> {
    logits: &'a [f32],
    bias: Option<&'a [f32]>,
    inv_temp: f32,
    max: f32,
    /// `ln Σ e^(z − max)`.
    log_sum: f32,
    entropy: f32,
}

impl<'a> Row<'a> {
    fn new(logits: &'a [f32], bias: Option<&'a [f32]>, inv_temp: f32) -> Self {
        let mut row = Self {
            logits,
            bias,
            inv_temp,
            max: f32::NEG_INFINITY,
            log_sum: 0.0,
            entropy: 0.0,
        };
        row.max = (0..logits.len())
            .map(|j| row.z(j))
            .fold(f32::NEG_INFINITY, f32::max);
        let (mut sum, mut weighted) = (0.0f32, 0.0f32);
        for j in 0..logits.len() {
            let shifted = row.z(j) - row.max;
            let e = shifted.exp();
            sum += e;
            weighted += e * shifted;
        }
        row.log_sum = sum.ln();
        row.entropy = row.log_sum - weighted / sum;
        row
    }

    fn z(&self, j: usize) -> f32 {
        self.logits[j] * self.inv_temp + self.bias.map_or(0.0, |b| b[j])
    }

    fn log_prob(&self, j: usize) -> f32 {
        self.z(j) - self.max - self.log_sum
    }
}

impl LogprobsEntropy {
    /// Runs `f` on the bias values, if any.
    fn with_bias<T>(
        &self,
        f: impl FnOnce(Option<&[f32]>) -> candle_core::Result<T>,
    ) -> candle_core::Result<T> {
        match &self.bias {
            Some(b) => with_host(b, NAME, |b| f(Some(b))),
            None => f(None),
        }
    }
}

fn dims(
    logits: &Layout,
    targets: &Layout,
    bias: Option<&[f32]>,
) -> candle_core::Result<(usize, usize)> {
    let (n, v) = logits.shape().dims2()?;
    if targets.shape().dims() != [n] || bias.is_some_and(|b| b.len() != n * v) {
        candle_core::bail!(
            "{NAME}: logits {:?}, targets {:?}, bias of {} values",
            logits.shape(),
            targets.shape(),
            bias.map_or(0, <[f32]>::len)
        );
    }
    Ok((n, v))
}

impl CustomOp2 for LogprobsEntropy {
    fn name(&self) -> &'static str {
        NAME
    }

    /// `[2, N]`: the log-probs, then the entropies.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (logits, targets) = (f32_data(s1, l1, NAME)?, u32_data(s2, l2, NAME)?);
        self.with_bias(|bias| {
            let (n, v) = dims(l1, l2, bias)?;
            if let Some(&t) = targets.iter().find(|&&t| t as usize >= v) {
                candle_core::bail!("{NAME}: target {t} ≥ vocabulary {v}");
            }
            let mut out = vec![0.0f32; 2 * n];
            let (lp, ent) = out.split_at_mut(n);
            lp.par_chunks_mut(ROWS_PER_TASK)
                .zip(ent.par_chunks_mut(ROWS_PER_TASK))
                .enumerate()
                .for_each(|(c, (lp, ent))| {
                    for (i, (lp, ent)) in lp.iter_mut().zip(ent).enumerate() {
                        let r = c * ROWS_PER_TASK + i;
                        let row = Row::new(
                            &logits[r * v..(r + 1) * v],
                            bias.map(|b| &b[r * v..(r + 1) * v]),
                            self.inv_temp,
                        );
                        *lp = row.log_prob(targets[r] as usize);
                        *ent = row.entropy;
                    }
                });
            Ok((CpuStorage::F32(out), Shape::from((2, n))))
        })
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let targets = targets.to_vec1::<u32>()?;
        let grad = with_host(logits, NAME, |z| {
            with_host(grad_res, NAME, |g| {
                self.with_bias(|bias| Ok(self.grad_logits(z, &targets, g, bias)))
            })
        })?;
        Ok((Some(from_host(grad, logits.shape())?), None))
    }
}

impl LogprobsEntropy {
    /// `∂loss/∂logits` from `grad [2, N]` (of the log-probs, then of the entropies).
    fn grad_logits(
        &self,
        logits: &[f32],
        targets: &[u32],
        grad: &[f32],
        bias: Option<&[f32]>,
    ) -> Vec<f32> {
        let n = targets.len();
        let v = logits.len() / n.max(1);
        let mut out = vec![0.0f32; logits.len()];
        out.par_chunks_mut(v).enumerate().for_each(|(r, out)| {
            let row = Row::new(
                &logits[r * v..(r + 1) * v],
                bias.map(|b| &b[r * v..(r + 1) * v]),
                self.inv_temp,
            );
            let (g_lp, g_h) = (grad[r], grad[n + r]);
            for (j, o) in out.iter_mut().enumerate() {
                let log_p = row.log_prob(j);
                let p = log_p.exp();
                *o = -p * (g_lp + g_h * (log_p + row.entropy)) * self.inv_temp;
            }
            out[targets[r] as usize] += g_lp * self.inv_temp;
        });
        out
    }
}
