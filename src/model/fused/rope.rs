//! Rotate-half RoPE of q or k heads as one op that also makes them head-major: `x [B, T, n, D]` →
//! `y [B, n, T, D]` with `y = x cos + rotate_half(x) sin`, `rotate_half(x) = [−x₂, x₁]`. The
//! backward rotates the gradient back: `∂x_k = g_k cos_k + g_{k+D/2} sin_{k+D/2}` in the first
//! half, `g_k cos_k − g_{k−D/2} sin_{k−D/2}` in the second, and transposes it to `[B, T, n, D]`.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::{f32_data, from_host, with_host};
use crate::model::Result;

const NAME: &str = "rope-heads";

/// `x [B, T, n, D]` rotated by the tables `cos`, `sin` (`B·T·D` values: `[B, 1, T, D]`) and
/// transposed to `[B, n, T, D]` (differentiable in `x`).
pub(crate) fn rope_heads(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let op = RopeHeads {
        cos: cos.contiguous()?,
        sin: sin.contiguous()?,
    };
    Ok(x.contiguous()?.apply_op1(op)?)
}

struct RopeHeads {
    cos: Tensor,
    sin: Tensor,
}

#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    n: usize,
    d: usize,
}

impl RopeHeads {
    fn dims(&self, x: &Shape) -> candle_core::Result<Dims> {
        let (b, t, n, d) = x.dims4()?;
        if self.cos.elem_count() != b * t * d || self.sin.elem_count() != b * t * d || d % 2 == 1 {
            candle_core::bail!("{NAME}: x {x:?}, tables {:?}", self.cos.shape());
        }
        Ok(Dims { b, t, n, d })
    }

    fn with_tables<T>(
        &self,
        f: impl FnOnce(&[f32], &[f32]) -> candle_core::Result<T>,
    ) -> candle_core::Result<T> {
        with_host(&self.cos, NAME, |cos| {
            with_host(&self.sin, NAME, |sin| f(cos, sin))
        })
    }
}

/// `y = x cos + rotate_half(x) sin` of one head row (`D` values).
fn rotate(x: &[f32], cos: &[f32], sin: &[f32], y: &mut [f32]) {
    let half = x.len() / 2;
    for k in 0..half {
        y[k] = x[k] * cos[k] - x[k + half] * sin[k];
        y[k + half] = x[k + half] * cos[k + half] + x[k] * sin[k + half];
    }
}

/// The gradient of [`rotate`]'s input from its output's `g`.
fn unrotate(g: &[f32], cos: &[f32], sin: &[f32], dx: &mut [f32]) {
    let half = g.len() / 2;
    for k in 0..half {
        dx[k] = g[k] * cos[k] + g[k + half] * sin[k + half];
        dx[k + half] = g[k + half] * cos[k + half] - g[k] * sin[k];
    }
}

impl CustomOp1 for RopeHeads {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let Dims { b, t, n, d } = self.dims(l.shape())?;
        let x = f32_data(s, l, NAME)?;
        let mut out = vec![0.0f32; x.len()];
        self.with_tables(|cos, sin| {
            out.par_chunks_mut(t * d).enumerate().for_each(|(bh, out)| {
                let (bi, h) = (bh / n, bh % n);
                for (ti, y) in out.chunks_exact_mut(d).enumerate() {
                    let row = bi * t + ti;
                    let at = (row * n + h) * d;
                    let table = row * d..(row + 1) * d;
                    rotate(&x[at..at + d], &cos[table.clone()], &sin[table], y);
                }
            });
            Ok(())
        })?;
        Ok((CpuStorage::F32(out), Shape::from((b, n, t, d))))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let Dims { t, n, d, .. } = self.dims(x.shape())?;
        let dx = with_host(grad, NAME, |g| {
            self.with_tables(|cos, sin| {
                let mut dx = vec![0.0f32; g.len()];
                dx.par_chunks_mut(n * d).enumerate().for_each(|(row, dx)| {
                    let (bi, ti) = (row / t, row % t);
                    let table = row * d..(row + 1) * d;
                    for (h, dx) in dx.chunks_exact_mut(d).enumerate() {
                        let at = ((bi * n + h) * t + ti) * d;
                        unrotate(&g[at..at + d], &cos[table.clone()], &sin[table.clone()], dx);
                    }
                });
                Ok(dx)
            })
        })?;
        Ok(Some(from_host(dx, x.shape())?))
    }
}
