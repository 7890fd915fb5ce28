//! [`super::AdamW`]'s update of f32 CPU parameters in place: the moments and then the
//! parameter, each in one pass over its buffer (candle in-place ops), where the tensor-op form
//! allocates and fills about a dozen parameter-sized temporaries per parameter and step; and the
//! gradients' sum of squares read straight from their buffers. Other devices and dtypes keep
//! the tensor ops. It does not choose learning rates or clip norms (the optimizer's).

use candle_core::{CpuStorage, InplaceOp2, InplaceOp3, Layout, Storage, Tensor};
use rayon::prelude::*;

use crate::algo::AlgoError;

/// Elements per rayon task.
const CHUNK: usize = 1 << 14;

/// One step's coefficients (torch's AdamW): `m ← β₁ m + (1 − β₁) c g`,
/// `v ← β₂ v + (1 − β₂) (c g)²`, `p ← p·decay − lr (m / bc₁) / (sqrt(v / bc₂) + ε)` with the clip
/// scale `c` and `decay = 1 − lr · weight_decay`.
pub(super) struct Coefs {
    pub(super) betas: (f32, f32),
    pub(super) bias_corrections: (f32, f32),
    pub(super) eps: f32,
    pub(super) lr: f32,
    pub(super) decay: f32,
    pub(super) clip_scale: f32,
}

/// Whether the parameter (or a flat block of parameters) and its gradient take the in-place
/// update: f32 on the CPU.
pub(super) fn applies(param: &Tensor, grad: &Tensor) -> bool {
    let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == candle_core::DType::F32;
    f32_cpu(param) && f32_cpu(grad) && param.is_contiguous()
}

/// One parameter's AdamW step from its gradient, updating `moments` (`m`, `v`) and the
/// parameter's values in place (a contiguous view updates the storage it views).
pub(super) fn step(
    param: &Tensor,
    grad: &Tensor,
    (m, v): (&Tensor, &Tensor),
    k: &Coefs,
) -> Result<(), AlgoError> {
    let (b1, b2) = k.betas;
    let grad = grad.contiguous()?;
    let c = k.clip_scale;
    m.inplace_op2(
        &grad,
        &Moment {
            keep: b1,
            scale: (1.0 - b1) * c,
            square: false,
        },
    )?;
    v.inplace_op2(
        &grad,
        &Moment {
            keep: b2,
            scale: (1.0 - b2) * c * c,
            square: true,
        },
    )?;
    param.inplace_op3(m, v, &Update(k))?;
    Ok(())
}

/// `Σ g²` (in f64) of an f32 CPU gradient; `None` for other devices and dtypes.
pub(super) fn sum_of_squares(grad: &Tensor) -> Result<Option<f64>, AlgoError> {
    if !grad.device().is_cpu() || grad.dtype() != candle_core::DType::F32 {
        return Ok(None);
    }
    let grad = grad.contiguous()?;
    let (storage, layout) = grad.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Ok(None);
    };
    let g = f32_data(cpu, layout, "sum of squares")?;
    let parts: Vec<f64> = g
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&x| f64::from(x) * f64::from(x)).sum())
        .collect();
    Ok(Some(parts.iter().sum()))
}

fn f32_data<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(data), Some((start, end))) => Ok(&data[start..end]),
        _ => candle_core::bail!("{op} takes contiguous f32 tensors"),
    }
}

fn f32_data_mut<'a>(
    s: &'a mut CpuStorage,
    l: &Layout,
    op: &str,
) -> candle_core::Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(data), Some((start, end))) => Ok(&mut data[start..end]),
        _ => candle_core::bail!("{op} takes contiguous f32 tensors"),
    }
}

/// `x ← keep · x + scale · g` (or `· g²` with `square`).
struct Moment {
    keep: f32,
    scale: f32,
    square: bool,
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let x = f32_data_mut(s1, l1, self.name())?;
        let g = f32_data(s2, l2, self.name())?;
        if x.len() != g.len() {
            candle_core::bail!("{}: {} values, gradient {}", self.name(), x.len(), g.len());
        }
        x.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .for_each(|(x, g)| {
                for (x, &g) in x.iter_mut().zip(g) {
                    let g = if self.square { g * g } else { g };
                    *x = self.keep * *x + self.scale * g;
                }
            });
        Ok(())
    }
}

/// The parameter's update from its new moments.
struct Update<'a>(&'a Coefs);

impl InplaceOp3 for Update<'_> {
    fn name(&self) -> &'static str {
        "adamw-update"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let p = f32_data_mut(s1, l1, self.name())?;
        let (m, v) = (
            f32_data(s2, l2, self.name())?,
            f32_data(s3, l3, self.name())?,
        );
        if p.len() != m.len() || p.len() != v.len() {
            candle_core::bail!("{}: moments do not match the parameter", self.name());
        }
        let k = self.0;
        let (bc1, bc2) = k.bias_corrections;
        p.par_chunks_mut(CHUNK)
            .zip(m.par_chunks(CHUNK).zip(v.par_chunks(CHUNK)))
            .for_each(|(p, (m, v))| {
                for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
                    *p = *p * k.decay - k.lr * (m / bc1) / ((v / bc2).sqrt() + k.eps);
                }
            });
        Ok(())
    }
}
