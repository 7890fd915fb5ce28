//! RMSNorm over the last dimension as one op: `y = x · r · w` with `r = 1 / sqrt(mean(x²) + eps)`.
//! The backward recomputes `r` per row: `∂x = r (g ∘ w) − x r³ Σ(g ∘ w ∘ x) / H` and
//! `∂w = Σ_rows g ∘ x · r` (summed per chunk of rows, then over chunks in order).

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use multiversion::multiversion;
use rayon::prelude::*;

use super::{f32_data, from_host, with_host, ROWS_PER_TASK};
use crate::model::Result;

const NAME: &str = "rms-norm";

/// `x / sqrt(mean(x²) + eps) · weight` over the last dimension (differentiable in both).
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let op = RmsNorm { eps: eps as f32 };
    Ok(x.contiguous()?.apply_op2(&weight.contiguous()?, op)?)
}

struct RmsNorm {
    eps: f32,
}

#[inline(always)]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mean = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (mean + eps).sqrt()
}

/// One chunk of rows' output.
#[multiversion(targets = "simd")]
fn chunk_forward(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let h = w.len();
    for (y, x) in out.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
        let r = inv_rms(x, eps);
        for j in 0..h {
            y[j] = x[j] * r * w[j];
        }
    }
}

/// One chunk of rows' `∂x` (written) and its part of `∂w` (returned).
#[multiversion(targets = "simd")]
fn chunk_backward(x: &[f32], w: &[f32], g: &[f32], eps: f32, dx: &mut [f32]) -> Vec<f32> {
    let h = w.len();
    let mut dw = vec![0.0f32; h];
    for ((x, g), dx) in x
        .chunks_exact(h)
        .zip(g.chunks_exact(h))
        .zip(dx.chunks_exact_mut(h))
    {
        let r = inv_rms(x, eps);
        let dot: f32 = (0..h).map(|j| g[j] * w[j] * x[j]).sum();
        let c = r * r * r * dot / h as f32;
        for j in 0..h {
            dx[j] = r * g[j] * w[j] - x[j] * c;
            dw[j] += g[j] * x[j] * r;
        }
    }
    dw
}

fn width(x: &Layout, w: &Layout) -> candle_core::Result<usize> {
    let h = w.shape().elem_count();
    if x.shape().dims().last() != Some(&h) || w.shape().rank() != 1 {
        candle_core::bail!("{NAME}: x {:?}, weight {:?}", x.shape(), w.shape());
    }
    Ok(h)
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let h = width(l1, l2)?;
        let (x, w) = (f32_data(s1, l1, NAME)?, f32_data(s2, l2, NAME)?);
        let mut out = vec![0.0f32; x.len()];
        out.par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .for_each(|(out, x)| chunk_forward(x, w, self.eps, out));
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let h = width(x.layout(), w.layout())?;
        let (dx, dw) = with_host(x, NAME, |xs| {
            with_host(w, NAME, |ws| {
                with_host(grad, NAME, |gs| {
                    let mut dx = vec![0.0f32; xs.len()];
                    let parts: Vec<Vec<f32>> = dx
                        .par_chunks_mut(h * ROWS_PER_TASK)
                        .zip(xs.par_chunks(h * ROWS_PER_TASK))
                        .zip(gs.par_chunks(h * ROWS_PER_TASK))
                        .map(|((dx, x), g)| chunk_backward(x, ws, g, self.eps, dx))
                        .collect();
                    let mut dw = vec![0.0f32; h];
                    for part in parts {
                        dw.iter_mut().zip(part).for_each(|(d, p)| *d += p);
                    }
                    Ok((dx, dw))
                })
            })
        })?;
        Ok((
            Some(from_host(dx, x.shape())?),
            Some(from_host(dw, w.shape())?),
        ))
    }
}
