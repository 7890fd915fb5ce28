//! Causal self-attention of the training forward, in two implementations with one contract:
//! `q [B, H, T, D]`, `k`, `v [B, KV, T, D]` (grouped-query heads share a kv head) and a `[B, T]`
//! real-token mask → `[B, H, T, D]`, where query `t` sees key `s` when `s ≤ t` and `s` is a real
//! token, or `s = t` (so padded rows stay finite).
//!
//! - [`TrainingAttention::Fused`] (CPU): one candle op with its own backward. The matmul form
//!   materialises `[B, H, T, T]` scores, bias, probabilities and their gradients; on a small
//!   model those element-wise passes and the page faults of allocating them cost more than the
//!   products, and half the work lies above the causal diagonal. The fused op takes each
//!   (sequence, head) in blocks of query rows: a block's scores are one small matrix product over
//!   the keys up to its last row only, its softmax is masked in place, and the backward recomputes
//!   the probabilities from `q`, `k` (flash-attention style) instead of storing them. K/V are never
//!   repeated for grouped heads; work is split over (sequence, head) pairs with rayon, and each
//!   pair's arithmetic is sequential, so results do not depend on the thread count.
//! - [`TrainingAttention::Matmul`] (any device): differentiable candle ops with an additive bias.
//!
//! `stepppo bench attention` times the two side by side.

use candle_core::{CpuStorage, CustomOp3, Device, Layout, Shape, Tensor, D};
use rayon::prelude::*;

use super::fused::{exp_in_place, max_of, sum_of};
use super::Result;
use multiversion::multiversion;

/// Which implementation computes the training forward's attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainingAttention {
    /// The fused causal op (CPU only).
    Fused,
    /// Matmuls, additive bias and `ops::softmax` (any device; the reference).
    Matmul,
}

impl TrainingAttention {
    /// The fused op on CPU, matmuls elsewhere.
    pub fn for_device(device: &Device) -> Self {
        match device {
            Device::Cpu => Self::Fused,
            _ => Self::Matmul,
        }
    }

    /// Attention of `q`, `k`, `v` under the causal and real-token mask `real_tokens [B][T]`.
    pub fn forward(
        self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        real_tokens: &[Vec<u32>],
        scale: f64,
    ) -> Result<Tensor> {
        match self {
            Self::Fused => fused_attention(q, k, v, real_tokens, scale as f32),
            Self::Matmul => {
                let bias = attention_bias(real_tokens, q.device())?;
                matmul_attention(q, k, v, &bias, scale)
            }
        }
    }
}

fn fused_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    real_tokens: &[Vec<u32>],
    scale: f32,
) -> Result<Tensor> {
    let op = CausalAttention {
        real: real_tokens
            .iter()
            .map(|row| row.iter().map(|&m| m != 0).collect())
            .collect(),
        scale,
    };
    Ok(q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, Fused(op))?)
}

/// Additive attention bias `[B, 1, T, T]`: 0 where query t may see key s, −∞ elsewhere.
fn attention_bias(mask: &[Vec<u32>], dev: &Device) -> Result<Tensor> {
    let (b_sz, t_len) = (mask.len(), mask.first().map_or(0, Vec::len));
    let mut bias = vec![f32::NEG_INFINITY; b_sz * t_len * t_len];
    for (b, row) in mask.iter().enumerate() {
        for t in 0..t_len {
            for s in 0..=t {
                if row[s] != 0 || s == t {
                    bias[(b * t_len + t) * t_len + s] = 0.0;
                }
            }
        }
    }
    Ok(Tensor::from_vec(bias, (b_sz, 1, t_len, t_len), dev)?)
}

/// Masked softmax attention from matmuls with an additive `bias [B, 1, Tq, Tk]` (`q [B, H, Tq, D]`,
/// `k`, `v [B, KV, Tk, D]`).
pub(super) fn matmul_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let rep = q.dim(1)? / k.dim(1)?;
    let (k, v) = (repeat_kv(k, rep)?, repeat_kv(v, rep)?);
    let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?.broadcast_add(bias)?;
    let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
    Ok(probs.matmul(&v)?)
}

/// `[B, kv, T, d]` → `[B, kv·rep, T, d]`, each kv head repeated for its `rep` query heads.
fn repeat_kv(x: &Tensor, rep: usize) -> Result<Tensor> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let (b, kv, t, d) = x.dims4()?;
    Ok(x.unsqueeze(2)?
        .broadcast_as((b, kv, rep, t, d))?
        .reshape((b, kv * rep, t, d))?)
}

/// The op: which key positions are real tokens, per sequence, and the score scale.
#[derive(Clone)]
struct CausalAttention {
    real: Vec<Vec<bool>>,
    scale: f32,
}

/// Shapes of one call, read from the layouts.
#[derive(Clone, Copy)]
struct Dims {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    len: usize,
    head_dim: usize,
}

impl Dims {
    fn rep(&self) -> usize {
        self.heads / self.kv_heads
    }
}

impl FusedKernel for CausalAttention {
    type Dims = Dims;
    const NAME: &'static str = "causal-attention";

    fn dims(&self, q: &Layout, k: &Layout, v: &Layout) -> candle_core::Result<Dims> {
        let (batch, heads, len, head_dim) = q.shape().dims4()?;
        let kv = k.shape().dims4()?;
        if kv != v.shape().dims4()?
            || kv.0 != batch
            || kv.2 != len
            || kv.3 != head_dim
            || kv.1 == 0
            || !heads.is_multiple_of(kv.1)
            || self.real.len() != batch
            || self.real.iter().any(|row| row.len() != len)
        {
            candle_core::bail!(
                "causal attention: q {:?}, k {:?}, v {:?}, mask {}×{}",
                q.shape(),
                k.shape(),
                v.shape(),
                self.real.len(),
                self.real.first().map_or(0, Vec::len)
            );
        }
        Ok(Dims {
            batch,
            heads,
            kv_heads: kv.1,
            len,
            head_dim,
        })
    }

    fn forward(&self, dims: Dims, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        let head = dims.len * dims.head_dim;
        let mut out = vec![0.0f32; dims.batch * dims.heads * head];
        out.par_chunks_mut(head)
            .enumerate()
            .for_each(|(bh, out_head)| {
                head_forward(self.head(dims, bh, [q, k, v]), self.scale, out_head);
            });
        out
    }

    /// Gradients of q, k, v given the output `o` and its gradient `grad_o`.
    fn backward(&self, dims: Dims, inputs: [&[f32]; 5]) -> [Vec<f32>; 3] {
        let [q, k, v, o, grad_o] = inputs;
        let head = dims.len * dims.head_dim;
        let rep = dims.rep();
        let mut grad_q = vec![0.0f32; q.len()];
        let mut grad_k = vec![0.0f32; k.len()];
        let mut grad_v = vec![0.0f32; v.len()];
        grad_q
            .par_chunks_mut(rep * head)
            .zip(grad_k.par_chunks_mut(head))
            .zip(grad_v.par_chunks_mut(head))
            .enumerate()
            .for_each(|(bg, ((grad_q_group, grad_k), grad_v))| {
                let mut scratch = BlockScratch::new(dims.len);
                for r in 0..rep {
                    let bh = bg * rep + r;
                    let at = bh * head..(bh + 1) * head;
                    let out = HeadOutput {
                        o: &o[at.clone()],
                        grad_o: &grad_o[at],
                    };
                    let grads = HeadGrads {
                        q: &mut grad_q_group[r * head..(r + 1) * head],
                        k: grad_k,
                        v: grad_v,
                    };
                    let inputs = self.head(dims, bh, [q, k, v]);
                    head_backward(inputs, out, self.scale, grads, &mut scratch);
                }
            });
        [grad_q, grad_k, grad_v]
    }
}

impl CausalAttention {
    /// Query head `bh` (sequence `b = bh / heads`) of `q`, with its kv head's `k`, `v`.
    fn head<'a>(&'a self, dims: Dims, bh: usize, qkv: [&'a [f32]; 3]) -> HeadInputs<'a> {
        let [q, k, v] = qkv;
        let head = dims.len * dims.head_dim;
        let (b, h) = (bh / dims.heads, bh % dims.heads);
        let kv = (b * dims.kv_heads + h / dims.rep()) * head;
        HeadInputs {
            q: &q[bh * head..(bh + 1) * head],
            k: &k[kv..kv + head],
            v: &v[kv..kv + head],
            head_dim: dims.head_dim,
            seen: Seen {
                offset: 0,
                real: Some(&self.real[b]),
            },
        }
    }
}

/// Which keys the query rows of a head see: row `t` sits at key position `offset + t` and sees
/// the keys `s ≤ offset + t` that are real tokens (every key without `real`), and always itself.
#[derive(Clone, Copy)]
pub(super) struct Seen<'a> {
    pub(super) offset: usize,
    pub(super) real: Option<&'a [bool]>,
}

/// One query head's rows `q [len, D]` and its kv head's keys and values `k`, `v`
/// `[seen.offset + len, D]`.
#[derive(Clone, Copy)]
pub(super) struct HeadInputs<'a> {
    pub(super) q: &'a [f32],
    pub(super) k: &'a [f32],
    pub(super) v: &'a [f32],
    pub(super) head_dim: usize,
    pub(super) seen: Seen<'a>,
}

impl HeadInputs<'_> {
    fn len(&self) -> usize {
        self.q.len() / self.head_dim
    }

    /// Keys scored by the block of query rows ending before row `end` (none past the diagonal).
    fn keys(&self, end: usize) -> usize {
        self.seen.offset + end
    }

    /// Probabilities of query rows `t0..t0 + rows` over keys `0..keys(t0 + rows)`, row-major in
    /// `probs`: scaled scores from one matrix product, then a softmax over the keys each row sees
    /// (the rest get 0).
    fn block_probabilities(&self, t0: usize, rows: usize, scale: f32, probs: &mut [f32]) {
        let (keys, d) = (self.keys(t0 + rows), self.head_dim);
        matmul(
            probs,
            Shape2(rows, keys),
            d,
            Operand::rows(&self.q[t0 * d..], d),
            Operand::transposed(self.k, d),
            Accumulate::No(scale),
        );
        causal_softmax(probs, keys, self.seen.offset + t0, self.seen.real);
    }
}

/// Softmax of each row of `scores` (`keys` wide) over the keys it sees: row `r` sits at key
/// position `first + r` and sees the keys up to it that are real (all without `real`); the rest
/// become 0.
#[multiversion(targets = "simd")]
fn causal_softmax(scores: &mut [f32], keys: usize, first: usize, real: Option<&[bool]>) {
    for (r, row) in scores.chunks_exact_mut(keys).enumerate() {
        let at = first + r;
        let (live, above) = row.split_at_mut(at + 1);
        above.fill(0.0);
        if let Some(real) = real {
            for (p, &real) in live[..at].iter_mut().zip(real) {
                if !real {
                    *p = f32::NEG_INFINITY;
                }
            }
        }
        let max = max_of(live);
        live.iter_mut().for_each(|p| *p -= max);
        exp_in_place(live);
        let sum = sum_of(live);
        live.iter_mut().for_each(|p| *p /= sum);
    }
}

/// Attention of one query head into `out [len, D]`, block of query rows by block.
pub(super) fn head_forward(x: HeadInputs, scale: f32, out: &mut [f32]) {
    let (len, d) = (x.len(), x.head_dim);
    let mut probs = vec![0.0f32; BLOCK * x.keys(len)];
    for t0 in (0..len).step_by(BLOCK) {
        let rows = BLOCK.min(len - t0);
        let keys = x.keys(t0 + rows);
        let probs = &mut probs[..rows * keys];
        x.block_probabilities(t0, rows, scale, probs);
        matmul(
            &mut out[t0 * d..],
            Shape2(rows, d),
            keys,
            Operand::rows(probs, keys),
            Operand::rows(x.v, d),
            Accumulate::No(1.0),
        );
    }
}

/// One query head's contribution to the gradients, block of query rows by block: its `q` rows'
/// are written, its kv head's `k`, `v` added to.
pub(super) fn head_backward(
    x: HeadInputs,
    out: HeadOutput,
    scale: f32,
    grads: HeadGrads,
    scratch: &mut BlockScratch,
) {
    let (len, d) = (x.len(), x.head_dim);
    for t0 in (0..len).step_by(BLOCK) {
        let rows = BLOCK.min(len - t0);
        let keys = x.keys(t0 + rows);
        let probs = &mut scratch.probs[..rows * keys];
        let grad_scores = &mut scratch.grad_scores[..rows * keys];
        x.block_probabilities(t0, rows, scale, probs);
        let grad_o = &out.grad_o[t0 * d..];
        // dV[..keys] += Pᵀ dO
        matmul(
            grads.v,
            Shape2(keys, d),
            rows,
            Operand::transposed(probs, keys),
            Operand::rows(grad_o, d),
            Accumulate::Yes(1.0),
        );
        // dP = dO Vᵀ, then dS = P ∘ (dP − rowsum(dO ∘ O))
        matmul(
            grad_scores,
            Shape2(rows, keys),
            d,
            Operand::rows(grad_o, d),
            Operand::transposed(x.v, d),
            Accumulate::No(1.0),
        );
        for (r, (grad_row, prob_row)) in grad_scores
            .chunks_exact_mut(keys)
            .zip(probs.chunks_exact(keys))
            .enumerate()
        {
            let t = (t0 + r) * d..(t0 + r + 1) * d;
            let delta = dot(&out.grad_o[t.clone()], &out.o[t]);
            grad_row
                .iter_mut()
                .zip(prob_row)
                .for_each(|(g, p)| *g = p * (*g - delta));
        }
        // dQ = scale · dS K;  dK[..keys] += scale · dSᵀ Q
        matmul(
            &mut grads.q[t0 * d..],
            Shape2(rows, d),
            keys,
            Operand::rows(grad_scores, keys),
            Operand::rows(x.k, d),
            Accumulate::No(scale),
        );
        matmul(
            grads.k,
            Shape2(keys, d),
            rows,
            Operand::transposed(grad_scores, keys),
            Operand::rows(&x.q[t0 * d..], d),
            Accumulate::Yes(scale),
        );
    }
}

/// Query rows per block: a block's scores are one `[BLOCK, keys]` matrix product, and keys past
/// the block's last row (all above the causal diagonal) are never computed.
const BLOCK: usize = 64;

/// A query head's output and its gradient (`[len, D]` each).
pub(super) struct HeadOutput<'a> {
    pub(super) o: &'a [f32],
    pub(super) grad_o: &'a [f32],
}

/// Where a query head's gradients go: its own `q` rows, and its kv head's `k`, `v` (shared with
/// the other query heads of the group, so added to).
pub(super) struct HeadGrads<'a> {
    pub(super) q: &'a mut [f32],
    pub(super) k: &'a mut [f32],
    pub(super) v: &'a mut [f32],
}

/// Per-task buffers of one block's probabilities and score gradients.
pub(super) struct BlockScratch {
    probs: Vec<f32>,
    grad_scores: Vec<f32>,
}

impl BlockScratch {
    /// Buffers for heads of at most `keys` keys.
    pub(super) fn new(keys: usize) -> Self {
        Self {
            probs: vec![0.0; BLOCK * keys],
            grad_scores: vec![0.0; BLOCK * keys],
        }
    }
}

/// Rows × columns of a matrix product's result.
#[derive(Clone, Copy)]
pub(super) struct Shape2(pub(super) usize, pub(super) usize);

/// A row-major matrix read as itself or transposed; `width` is its row length in memory.
#[derive(Clone, Copy)]
pub(super) struct Operand<'a> {
    data: &'a [f32],
    row_stride: usize,
    col_stride: usize,
}

impl<'a> Operand<'a> {
    pub(super) fn rows(data: &'a [f32], width: usize) -> Self {
        Self {
            data,
            row_stride: width,
            col_stride: 1,
        }
    }

    pub(super) fn transposed(data: &'a [f32], width: usize) -> Self {
        Self {
            data,
            row_stride: 1,
            col_stride: width,
        }
    }

    /// Panics unless a `rows × cols` view fits in the slice (what makes the gemm call sound).
    fn check(&self, rows: usize, cols: usize) {
        if rows > 0 && cols > 0 {
            let last = (rows - 1) * self.row_stride + (cols - 1) * self.col_stride;
            assert!(last < self.data.len(), "matrix view past its slice");
        }
    }
}

/// Whether a product overwrites its destination or is added to it, and its scale.
#[derive(Clone, Copy)]
pub(super) enum Accumulate {
    No(f32),
    Yes(f32),
}

/// `dst[..m × n]` (row-major, width `n`) = or += `scale · lhs[m × inner] · rhs[inner × n]`,
/// single-threaded (the callers run one per rayon task).
fn matmul(
    dst: &mut [f32],
    shape: Shape2,
    inner: usize,
    lhs: Operand,
    rhs: Operand,
    accumulate: Accumulate,
) {
    matmul_on(
        dst,
        shape,
        inner,
        [lhs, rhs],
        accumulate,
        gemm::Parallelism::None,
    );
}

/// [`matmul`] with the given parallelism.
pub(super) fn matmul_on(
    dst: &mut [f32],
    Shape2(m, n): Shape2,
    inner: usize,
    [lhs, rhs]: [Operand; 2],
    accumulate: Accumulate,
    parallelism: gemm::Parallelism,
) {
    lhs.check(m, inner);
    rhs.check(inner, n);
    assert!(m * n <= dst.len(), "matrix product past its destination");
    let (read_dst, scale) = match accumulate {
        Accumulate::No(scale) => (false, scale),
        Accumulate::Yes(scale) => (true, scale),
    };
    // SAFETY: both operand views were checked to lie inside their slices and the destination
    // inside `dst`; `dst` is borrowed mutably, so it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            inner,
            dst.as_mut_ptr(),
            1,
            n as isize,
            read_dst,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        );
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub(super) fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(data), Some((start, end))) => Ok(&data[start..end]),
        _ => candle_core::bail!("causal attention takes contiguous f32 tensors"),
    }
}

/// A fused attention kernel over contiguous f32 CPU buffers (q, k, v), with its hand-written
/// backward: what [`Fused`] turns into a candle op with a gradient.
pub(super) trait FusedKernel: Send + Sync {
    /// The shapes the kernel reads from its inputs' layouts.
    type Dims: Copy;
    /// The op's name in candle's graph.
    const NAME: &'static str;
    fn dims(&self, q: &Layout, k: &Layout, v: &Layout) -> candle_core::Result<Self::Dims>;
    fn forward(&self, dims: Self::Dims, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32>;
    /// Gradients of q, k and v from `[q, k, v, out, grad_out]`.
    fn backward(&self, dims: Self::Dims, inputs: [&[f32]; 5]) -> [Vec<f32>; 3];
}

/// A [`FusedKernel`] as a candle op: `q.apply_op3(k, v, Fused(kernel))`.
pub(super) struct Fused<K>(pub K);

impl<K: FusedKernel> CustomOp3 for Fused<K> {
    fn name(&self) -> &'static str {
        K::NAME
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
        let dims = self.0.dims(l1, l2, l3)?;
        let out = self.0.forward(
            dims,
            f32_slice(s1, l1)?,
            f32_slice(s2, l2)?,
            f32_slice(s3, l3)?,
        );
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dims = self.0.dims(q.layout(), k.layout(), v.layout())?;
        let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
        let (qv, kv, vv, ov, gv) = (flat(q)?, flat(k)?, flat(v)?, flat(out)?, flat(grad_out)?);
        let [gq, gk, gv] = self.0.backward(dims, [&qv, &kv, &vv, &ov, &gv]);
        let dev = q.device();
        Ok((
            Some(Tensor::from_vec(gq, q.shape(), dev)?),
            Some(Tensor::from_vec(gk, k.shape(), dev)?),
            Some(Tensor::from_vec(gv, v.shape(), dev)?),
        ))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// A tensor of the given shape filled from a seeded LCG in [-1, 1).
    pub(in crate::model) fn random(shape: impl Into<candle_core::Shape>, seed: u64) -> Var {
        let shape = shape.into();
        let n = shape.elem_count();
        let mut state = seed;
        let data: Vec<f32> = (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
            })
            .collect();
        Var::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    /// The largest absolute elementwise difference.
    pub(in crate::model) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        let host = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        host(a)
            .iter()
            .zip(host(b))
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// Output and q/k/v gradients of one attention implementation under a fixed downstream loss.
    fn run(fused: bool, mask: &[Vec<u32>]) -> Vec<Tensor> {
        let len = mask[0].len();
        let (q, k, v) = (
            random((2, 4, len, 8), 1),
            random((2, 2, len, 8), 2),
            random((2, 2, len, 8), 3),
        );
        let weights = random((2, 4, len, 8), 4);
        let scale = 1.0 / 8f64.sqrt();
        let attention = if fused {
            TrainingAttention::Fused
        } else {
            TrainingAttention::Matmul
        };
        let out = attention.forward(&q, &k, &v, mask, scale).unwrap();
        let grads = (&out * weights.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut all = vec![out];
        all.extend([&q, &k, &v].map(|x| grads.get(x).unwrap().clone()));
        all
    }

    #[test]
    fn fused_attention_matches_the_matmul_path_with_padding_and_grouped_heads() {
        // Two blocks of query rows; sequence 0 is full, sequence 1 is right-padded after 50
        // tokens and has a padded hole at position 3.
        let len = BLOCK + 6;
        let mut padded = vec![1; len];
        padded[3] = 0;
        padded[50..].iter_mut().for_each(|m| *m = 0);
        let mask = vec![vec![1; len], padded];
        let (fused, reference) = (run(true, &mask), run(false, &mask));
        for (name, (a, b)) in ["output", "grad q", "grad k", "grad v"]
            .iter()
            .zip(fused.iter().zip(&reference))
        {
            assert_eq!(a.dims(), b.dims(), "{name}");
            let diff = max_diff(a, b);
            assert!(diff < 1e-5, "{name} differs by {diff}");
        }
    }

    #[test]
    fn mismatched_shapes_are_an_error() {
        let q = random((1, 4, 6, 8), 1);
        let k = random((1, 3, 6, 8), 2);
        let err = TrainingAttention::Fused
            .forward(&q, &k, &k, &[vec![1; 6]], 1.0)
            .unwrap_err();
        assert!(err.to_string().contains("causal attention"), "{err}");
    }
}
