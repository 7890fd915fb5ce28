//! The targets' log-probs and the entropies of a logit matrix as one op: per row of `z = logits /
//! temperature + bias`, one pass for the maximum and one for `Σ e^(z − max)` and `Σ e^(z − max)
//! (z − max)` give `log p(target) = z_target − lse` and `H = ln Σ − Σ e (z − max) / Σ`. The
//! backward recomputes the row's probabilities: `∂/∂z_j = g_lp (δ_jt − p_j) − g_H p_j (log p_j +
//! H)`, divided by the temperature.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

use multiversion::multiversion;

use super::{exp_in_place, f32_data, from_host, max_of, u32_data, with_host, ROWS_PER_TASK};
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

/// The softmax statistics of one row of scaled logits `z`.
struct Row {
    /// `ln Σ e^(z − max)`.
    log_sum: f32,
    sum: f32,
    entropy: f32,
}

impl Row {
    /// Writes `z − max` into `shifted` and `e^(z − max)` into `e` (each the row's length).
    fn new(
        logits: &[f32],
        bias: Option<&[f32]>,
        inv_temp: f32,
        (shifted, e): (&mut [f32], &mut [f32]),
    ) -> Self {
        let (sum, weighted) = shifted_exponentials(logits, bias, inv_temp, (shifted, e));
        let log_sum = sum.ln();
        Self {
            log_sum,
            sum,
            entropy: log_sum - weighted / sum,
        }
    }
}

/// Writes a row's `z − max` and `e^(z − max)`; returns `Σ e^(z − max)` and `Σ e^(z − max) (z − max)`.
#[multiversion(targets = "simd")]
fn shifted_exponentials(
    logits: &[f32],
    bias: Option<&[f32]>,
    inv_temp: f32,
    (shifted, e): (&mut [f32], &mut [f32]),
) -> (f32, f32) {
    match bias {
        Some(b) => {
            for ((s, &l), &b) in shifted.iter_mut().zip(logits).zip(b) {
                *s = l * inv_temp + b;
            }
        }
        None => {
            for (s, &l) in shifted.iter_mut().zip(logits) {
                *s = l * inv_temp;
            }
        }
    }
    let max = max_of(shifted);
    shifted.iter_mut().for_each(|s| *s -= max);
    e.copy_from_slice(shifted);
    exp_in_place(e);
    let (mut sum, mut weighted) = (0.0f32, 0.0f32);
    for (&e, &s) in e.iter().zip(shifted.iter()) {
        sum += e;
        weighted += e * s;
    }
    (sum, weighted)
}

/// Per-task buffers of one row's shifted logits and their exponentials.
fn scratch(v: usize) -> (Vec<f32>, Vec<f32>) {
    (vec![0.0; v], vec![0.0; v])
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
                    let (mut shifted, mut e) = scratch(v);
                    for (i, (lp, ent)) in lp.iter_mut().zip(ent).enumerate() {
                        let r = c * ROWS_PER_TASK + i;
                        let row = Row::new(
                            &logits[r * v..(r + 1) * v],
                            bias.map(|b| &b[r * v..(r + 1) * v]),
                            self.inv_temp,
                            (&mut shifted, &mut e),
                        );
                        *lp = shifted[targets[r] as usize] - row.log_sum;
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
        out.par_chunks_mut(v).enumerate().for_each_init(
            || scratch(v),
            |(shifted, e), (r, out)| {
                let row = Row::new(
                    &logits[r * v..(r + 1) * v],
                    bias.map(|b| &b[r * v..(r + 1) * v]),
                    self.inv_temp,
                    (shifted, e),
                );
                let (g_lp, g_h) = (grad[r], grad[n + r]);
                // p_j = e_j / Σ, log p_j = shifted_j − ln Σ
                let (p_scale, offset) = (self.inv_temp / row.sum, row.entropy - row.log_sum);
                for ((o, &e), &s) in out.iter_mut().zip(e.iter()).zip(shifted.iter()) {
                    *o = -e * p_scale * (g_lp + g_h * (s + offset));
                }
                out[targets[r] as usize] += g_lp * self.inv_temp;
            },
        );
        out
    }
}
