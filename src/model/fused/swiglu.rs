//! The MLP's gate as one op: `y = silu(g) · u` with `silu(g) = g σ(g)`. Backward:
//! `∂g = dy · u · σ(g) (1 + g (1 − σ(g)))`, `∂u = dy · silu(g)`.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use multiversion::multiversion;
use rayon::prelude::*;

use super::{exp, f32_data, from_host, with_host};
use crate::model::Result;

const NAME: &str = "swiglu";

/// Elements per rayon task.
const CHUNK: usize = 4096;

/// `silu(gate) · up`, elementwise (differentiable in both).
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok(gate.contiguous()?.apply_op2(&up.contiguous()?, Swiglu)?)
}

struct Swiglu;

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `y = silu(g) · u` over one chunk.
#[multiversion(targets = "simd")]
fn chunk_forward(g: &[f32], u: &[f32], y: &mut [f32]) {
    for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
        *y = g * sigmoid(g) * u;
    }
}

/// The gradients of one chunk's gate and up values from the output's `dy`.
#[multiversion(targets = "simd")]
fn chunk_backward(g: &[f32], u: &[f32], dy: &[f32], (dg, du): (&mut [f32], &mut [f32])) {
    for j in 0..g.len() {
        let s = sigmoid(g[j]);
        dg[j] = dy[j] * u[j] * s * (1.0 + g[j] * (1.0 - s));
        du[j] = dy[j] * g[j] * s;
    }
}

fn check(g: &Layout, u: &Layout) -> candle_core::Result<()> {
    if g.shape() != u.shape() {
        candle_core::bail!("{NAME}: gate {:?}, up {:?}", g.shape(), u.shape());
    }
    Ok(())
}

impl CustomOp2 for Swiglu {
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
        check(l1, l2)?;
        let (g, u) = (f32_data(s1, l1, NAME)?, f32_data(s2, l2, NAME)?);
        let mut out = vec![0.0f32; g.len()];
        out.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
            .for_each(|(y, (g, u))| chunk_forward(g, u, y));
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (dg, du) = with_host(gate, NAME, |g| {
            with_host(up, NAME, |u| {
                with_host(grad, NAME, |dy| {
                    let mut dg = vec![0.0f32; g.len()];
                    let mut du = vec![0.0f32; g.len()];
                    dg.par_chunks_mut(CHUNK)
                        .zip(du.par_chunks_mut(CHUNK))
                        .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
                        .zip(dy.par_chunks(CHUNK))
                        .for_each(|(((dg, du), (g, u)), dy)| chunk_backward(g, u, dy, (dg, du)));
                    Ok((dg, du))
                })
            })
        })?;
        Ok((
            Some(from_host(dg, gate.shape())?),
            Some(from_host(du, up.shape())?),
        ))
    }
}
