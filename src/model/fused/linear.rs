//! A linear layer `y = x Wᵀ (+ b)` over the last dimension as one op. candle's form is a graph of
//! reshape, transpose, matmul, broadcast and add nodes, and its backward gives each node a zeroed
//! gradient buffer to add into; here the backward is three products and a column sum:
//! `∂x = g W`, `∂W = gᵀ x`, `∂b = Σ_rows g`.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

use super::super::attention::{matmul_on, Accumulate, Operand, Shape2};
use super::{f32_data, from_host, with_host};
use crate::model::Result;

const NAME: &str = "linear";

/// `x [.., in] · weightᵀ [in, out] (+ bias [out])` (differentiable in all three).
pub(crate) fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (x, weight) = (x.contiguous()?, weight.contiguous()?);
    Ok(match bias {
        Some(b) => x.apply_op3(&weight, &b.contiguous()?, Linear)?,
        None => x.apply_op2(&weight, Linear)?,
    })
}

struct Linear;

/// The products' parallelism: candle's thread count (`RAYON_NUM_THREADS` or the cores).
fn parallelism() -> gemm::Parallelism {
    match candle_core::utils::get_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// `(rows, in, out)` of `x`, `weight` and the optional bias, and the output shape.
fn dims(
    x: &Shape,
    w: &Shape,
    bias: Option<&Shape>,
) -> candle_core::Result<((usize, usize, usize), Shape)> {
    let (out, inner) = w.dims2()?;
    let bias_ok = bias.is_none_or(|b| b.dims() == [out]);
    if x.dims().last() != Some(&inner) || !bias_ok {
        candle_core::bail!("{NAME}: x {x:?}, weight {w:?}, bias {bias:?}");
    }
    let mut y = x.dims().to_vec();
    *y.last_mut().expect("rank ≥ 1") = out;
    Ok(((x.elem_count() / inner.max(1), inner, out), Shape::from(y)))
}

fn forward(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (rows, inner, out): (usize, usize, usize),
) -> Vec<f32> {
    let mut y = match bias {
        Some(b) => b.repeat(rows),
        None => vec![0.0f32; rows * out],
    };
    let accumulate = if bias.is_some() {
        Accumulate::Yes(1.0)
    } else {
        Accumulate::No(1.0)
    };
    let operands = [Operand::rows(x, inner), Operand::transposed(w, inner)];
    matmul_on(
        &mut y,
        Shape2(rows, out),
        inner,
        operands,
        accumulate,
        parallelism(),
    );
    y
}

/// Which input gradients a backward computes: none for an input that nothing trains (a frozen
/// base weight under a LoRA adapter, or the embeddings feeding the first block), which saves
/// the product.
#[derive(Clone, Copy)]
struct Wanted {
    x: bool,
    w: bool,
    bias: bool,
}

/// Host gradients of x, W and b; `None` where not [`Wanted`].
type HostGrads = (Option<Vec<f32>>, Option<Vec<f32>>, Option<Vec<f32>>);

/// `∂x`, `∂W` and `∂b` (each where `wanted`) from the output gradient `g [rows, out]`.
fn backward(
    [x, w, g]: [&[f32]; 3],
    (rows, inner, out): (usize, usize, usize),
    wanted: Wanted,
) -> HostGrads {
    let dx = wanted.x.then(|| {
        let mut dx = vec![0.0f32; rows * inner];
        let operands = [Operand::rows(g, out), Operand::rows(w, inner)];
        matmul_on(
            &mut dx,
            Shape2(rows, inner),
            out,
            operands,
            Accumulate::No(1.0),
            parallelism(),
        );
        dx
    });
    let dw = wanted.w.then(|| {
        let mut dw = vec![0.0f32; out * inner];
        let operands = [Operand::transposed(g, out), Operand::rows(x, inner)];
        matmul_on(
            &mut dw,
            Shape2(out, inner),
            rows,
            operands,
            Accumulate::No(1.0),
            parallelism(),
        );
        dw
    });
    let db = wanted.bias.then(|| {
        let mut db = vec![0.0f32; out];
        for row in g.chunks_exact(out) {
            db.iter_mut().zip(row).for_each(|(d, g)| *d += g);
        }
        db
    });
    (dx, dw, db)
}

impl CustomOp2 for Linear {
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
        let (d, shape) = dims(l1.shape(), l2.shape(), None)?;
        let y = forward(f32_data(s1, l1, NAME)?, f32_data(s2, l2, NAME)?, None, d);
        Ok((CpuStorage::F32(y), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = grads(x, w, grad, None)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (d, shape) = dims(l1.shape(), l2.shape(), Some(l3.shape()))?;
        let (x, w) = (f32_data(s1, l1, NAME)?, f32_data(s2, l2, NAME)?);
        let y = forward(x, w, Some(f32_data(s3, l3, NAME)?), d);
        Ok((CpuStorage::F32(y), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        grads(x, w, grad, Some(b))
    }
}

/// `∂x`, `∂W` and, given the bias, `∂b` as tensors of the inputs' shapes, each only for an input
/// that autograd tracks.
#[allow(clippy::type_complexity)] // three optional gradients, as candle's `CustomOp3::bwd` returns
fn grads(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    bias: Option<&Tensor>,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let (d, _) = dims(x.shape(), w.shape(), None)?;
    let wanted = Wanted {
        x: x.track_op(),
        w: w.track_op(),
        bias: bias.is_some_and(Tensor::track_op),
    };
    let (dx, dw, db) = with_host(x, NAME, |xs| {
        with_host(w, NAME, |ws| {
            with_host(grad, NAME, |g| Ok(backward([xs, ws, g], d, wanted)))
        })
    })?;
    let dx = dx.map(|dx| from_host(dx, x.shape())).transpose()?;
    let dw = dw.map(|dw| from_host(dw, w.shape())).transpose()?;
    let db = match (db, bias) {
        (Some(db), Some(b)) => Some(from_host(db, b.shape())?),
        _ => None,
    };
    Ok((dx, dw, db))
}
