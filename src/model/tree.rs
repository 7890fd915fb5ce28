//! The shared-prefix ("tree") layout of a training batch and the attention over it.
//!
//! A [`TreeBatch`] packs a batch's tokens end to end, without padding, as segments. A root
//! segment is a sequence of its own or a prefix several sequences share; a branch segment (one
//! sequence's suffix) continues its root: its token `i` sits at position `root.len + i`, sees
//! every token of the root and, causally, its own segment. A shared prefix is thus forwarded once,
//! its K/V are read by each branch, and each branch's gradient flows back into it. The attention
//! has the two implementations of [`TrainingAttention`]: a fused CPU op (the per-head kernels of
//! [`super::attention`], the keys of a branch being its root's and then its own) and matmuls per
//! segment (any device; the reference). Which sequences share which prefix is the caller's choice.

use std::borrow::Cow;
use std::ops::Range;

use candle_core::{Device, Layout, Tensor};
use rayon::prelude::*;

use super::attention::{
    head_backward, head_forward, matmul_attention, BlockScratch, Fused, FusedKernel, HeadGrads,
    HeadInputs, HeadOutput, Seen, TrainingAttention,
};
use super::{ModelError, Result};

/// A run of packed tokens: `len` tokens from `start`, continuing segment `root` if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index of the segment's first token in the packed batch.
    pub start: usize,
    /// Tokens in the segment (at least 1).
    pub len: usize,
    /// The root segment this one continues (a shared prefix); `None` for a root.
    pub root: Option<usize>,
}

/// Packed tokens `[N]` in segments that tile them in order; roots come before their branches.
#[derive(Clone, Debug)]
pub struct TreeBatch {
    ids: Tensor,
    segments: Vec<Segment>,
}

impl TreeBatch {
    /// Checks that `segments` tile `ids` in order (none empty) and that each branch continues an
    /// earlier root segment.
    pub fn new(ids: &[u32], segments: Vec<Segment>, device: &Device) -> Result<Self> {
        let mut next = 0;
        for (i, s) in segments.iter().enumerate() {
            let bad = |why: &str| ModelError::Input(format!("tree segment {i} {s:?}: {why}"));
            if s.start != next || s.len == 0 {
                return Err(bad(&format!("must start at {next} and hold a token")));
            }
            if let Some(r) = s.root {
                if r >= i || segments[r].root.is_some() {
                    return Err(bad("its root must be an earlier root segment"));
                }
            }
            next += s.len;
        }
        if next != ids.len() {
            return Err(ModelError::Input(format!(
                "tree segments hold {next} tokens, the batch {}",
                ids.len()
            )));
        }
        Ok(Self {
            ids: Tensor::new(ids, device)?,
            segments,
        })
    }

    /// Token ids `[N]` (u32).
    pub fn ids(&self) -> &Tensor {
        &self.ids
    }

    /// The segments, in packing order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Packed tokens N.
    pub fn len(&self) -> usize {
        self.segments.iter().map(|s| s.len).sum()
    }

    /// Whether the batch holds no segment (and so no token).
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    /// The segment `s` continues, if any.
    fn root_of(&self, s: &Segment) -> Option<Segment> {
        s.root.map(|r| self.segments[r])
    }

    /// The RoPE position of each packed token: a branch's count on from its root's length.
    pub fn positions(&self) -> Vec<u32> {
        self.segments
            .iter()
            .flat_map(|s| {
                let base = self.root_of(s).map_or(0, |r| r.len);
                (base..base + s.len).map(|p| p as u32)
            })
            .collect()
    }
}

impl TrainingAttention {
    /// Attention of `q [H, N, D]`, `k`, `v [KV, N, D]` over the segments of `tree` → `[H, N, D]`.
    pub fn tree(
        self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        tree: &TreeBatch,
        scale: f64,
    ) -> Result<Tensor> {
        match self {
            Self::Fused => {
                let op = TreeAttention {
                    segments: tree.segments.clone(),
                    scale: scale as f32,
                };
                Ok(q.contiguous()?
                    .apply_op3(&k.contiguous()?, &v.contiguous()?, Fused(op))?)
            }
            Self::Matmul => matmul_tree_attention(q, k, v, tree, scale),
        }
    }
}

/// The matmul form: each segment's queries against its keys (its root's, then its own), under an
/// additive causal bias.
fn matmul_tree_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    tree: &TreeBatch,
    scale: f64,
) -> Result<Tensor> {
    let parts = tree
        .segments
        .iter()
        .map(|s| {
            let root = tree.root_of(s);
            let keys = |x: &Tensor| -> Result<Tensor> {
                let own = x.narrow(1, s.start, s.len)?;
                Ok(match root {
                    Some(r) => Tensor::cat(&[&x.narrow(1, r.start, r.len)?, &own], 1)?,
                    None => own,
                }
                .unsqueeze(0)?)
            };
            let offset = root.map_or(0, |r| r.len);
            let bias = causal_bias(s.len, offset, q.device())?;
            let q = q.narrow(1, s.start, s.len)?.unsqueeze(0)?;
            Ok(matmul_attention(&q, &keys(k)?, &keys(v)?, &bias, scale)?.squeeze(0)?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 1)?)
}

/// `[1, 1, len, offset + len]`: 0 where query `t` (at key position `offset + t`) sees key `s`,
/// −∞ elsewhere.
fn causal_bias(len: usize, offset: usize, device: &Device) -> Result<Tensor> {
    let keys = offset + len;
    let bias: Vec<f32> = (0..len)
        .flat_map(|t| {
            (0..keys).map(move |s| {
                if s <= offset + t {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(bias, (1, 1, len, keys), device)?)
}

/// The fused op: the segments and the score scale.
#[derive(Clone)]
struct TreeAttention {
    segments: Vec<Segment>,
    scale: f32,
}

/// Shapes of one call, read from the layouts.
#[derive(Clone, Copy)]
struct TreeDims {
    heads: usize,
    kv_heads: usize,
    tokens: usize,
    head_dim: usize,
}

impl TreeDims {
    fn rep(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Where segment `s`'s rows of head `h` (of q, or kv head `h` of k, v) lie in a flat buffer.
    fn rows(&self, h: usize, s: &Segment) -> Range<usize> {
        let at = (h * self.tokens + s.start) * self.head_dim;
        at..at + s.len * self.head_dim
    }
}

/// The gradients one (kv head, segment) task computes: its query heads' rows, and the keys' and
/// values' it read (its root's rows, then its own).
struct TaskGrads {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl FusedKernel for TreeAttention {
    type Dims = TreeDims;
    const NAME: &'static str = "tree-attention";

    fn dims(&self, q: &Layout, k: &Layout, v: &Layout) -> candle_core::Result<TreeDims> {
        let (heads, tokens, head_dim) = q.shape().dims3()?;
        let kv = k.shape().dims3()?;
        let covered: usize = self.segments.iter().map(|s| s.len).sum();
        if kv != v.shape().dims3()?
            || kv.1 != tokens
            || kv.2 != head_dim
            || kv.0 == 0
            || !heads.is_multiple_of(kv.0)
            || covered != tokens
        {
            candle_core::bail!(
                "tree attention: q {:?}, k {:?}, v {:?}, segments of {covered} tokens",
                q.shape(),
                k.shape(),
                v.shape()
            );
        }
        Ok(TreeDims {
            heads,
            kv_heads: kv.0,
            tokens,
            head_dim,
        })
    }

    fn forward(&self, dims: TreeDims, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        let tasks = self.tasks(dims);
        let rep = dims.rep();
        let parts: Vec<Vec<f32>> = tasks
            .par_iter()
            .map(|&(g, s)| {
                let seg = &self.segments[s];
                let (keys, offset) = self.context(dims, g, seg, k);
                let (values, _) = self.context(dims, g, seg, v);
                let rows = seg.len * dims.head_dim;
                let mut out = vec![0.0f32; rep * rows];
                for (r, out) in out.chunks_exact_mut(rows).enumerate() {
                    let x = self.head(dims, (g * rep + r, seg), q, (&keys, &values, offset));
                    head_forward(x, self.scale, out);
                }
                out
            })
            .collect();
        let mut out = vec![0.0f32; q.len()];
        for (&(g, s), part) in tasks.iter().zip(parts) {
            let seg = &self.segments[s];
            for (r, rows) in part.chunks_exact(seg.len * dims.head_dim).enumerate() {
                out[dims.rows(g * rep + r, seg)].copy_from_slice(rows);
            }
        }
        out
    }

    /// Gradients of q, k, v given the output `o` and its gradient `grad_o`: each task's, then its
    /// key and value gradients added to its root's rows and its own, task by task in order.
    fn backward(&self, dims: TreeDims, inputs: [&[f32]; 5]) -> [Vec<f32>; 3] {
        let tasks = self.tasks(dims);
        let parts: Vec<TaskGrads> = tasks
            .par_iter()
            .map(|&task| self.task_backward(dims, task, inputs))
            .collect();
        let mut grad_q = vec![0.0f32; inputs[0].len()];
        let mut grad_k = vec![0.0f32; inputs[1].len()];
        let mut grad_v = vec![0.0f32; inputs[2].len()];
        let d = dims.head_dim;
        for (&(g, s), part) in tasks.iter().zip(parts) {
            let seg = &self.segments[s];
            for (r, rows) in part.q.chunks_exact(seg.len * d).enumerate() {
                grad_q[dims.rows(g * dims.rep() + r, seg)].copy_from_slice(rows);
            }
            let mut spans = vec![seg];
            if let Some(r) = seg.root {
                spans.insert(0, &self.segments[r]);
            }
            let mut from = 0;
            for span in spans {
                let to = dims.rows(g, span);
                let n = to.len();
                add(&mut grad_k[to.clone()], &part.k[from..from + n]);
                add(&mut grad_v[to], &part.v[from..from + n]);
                from += n;
            }
        }
        [grad_q, grad_k, grad_v]
    }
}

impl TreeAttention {
    /// Every (kv head, segment) pair: the op's units of parallel work.
    fn tasks(&self, dims: TreeDims) -> Vec<(usize, usize)> {
        (0..dims.kv_heads)
            .flat_map(|g| (0..self.segments.len()).map(move |s| (g, s)))
            .collect()
    }

    /// The rows of kv head `g` of `x` (keys or values) that segment `s` reads: its root's, then
    /// its own; and how many are its root's.
    fn context<'a>(
        &self,
        dims: TreeDims,
        g: usize,
        s: &Segment,
        x: &'a [f32],
    ) -> (Cow<'a, [f32]>, usize) {
        let own = &x[dims.rows(g, s)];
        match s.root.map(|r| self.segments[r]) {
            Some(root) => ([&x[dims.rows(g, &root)], own].concat().into(), root.len),
            None => (own.into(), 0),
        }
    }

    /// Query head `h`'s rows of segment `s` and the keys and values it reads.
    fn head<'a>(
        &self,
        dims: TreeDims,
        (h, s): (usize, &Segment),
        q: &'a [f32],
        (k, v, offset): (&'a [f32], &'a [f32], usize),
    ) -> HeadInputs<'a> {
        HeadInputs {
            q: &q[dims.rows(h, s)],
            k,
            v,
            head_dim: dims.head_dim,
            seen: Seen { offset, real: None },
        }
    }

    /// The gradients of kv head `g`'s query heads on segment `s`.
    fn task_backward(
        &self,
        dims: TreeDims,
        (g, s): (usize, usize),
        inputs: [&[f32]; 5],
    ) -> TaskGrads {
        let [q, k, v, o, grad_o] = inputs;
        let seg = &self.segments[s];
        let (keys, offset) = self.context(dims, g, seg, k);
        let (values, _) = self.context(dims, g, seg, v);
        let rows = seg.len * dims.head_dim;
        let mut grads = TaskGrads {
            q: vec![0.0; dims.rep() * rows],
            k: vec![0.0; keys.len()],
            v: vec![0.0; values.len()],
        };
        let mut scratch = BlockScratch::new(offset + seg.len);
        for (r, grad_q) in grads.q.chunks_exact_mut(rows).enumerate() {
            let h = g * dims.rep() + r;
            let x = self.head(dims, (h, seg), q, (&keys, &values, offset));
            let out = HeadOutput {
                o: &o[dims.rows(h, seg)],
                grad_o: &grad_o[dims.rows(h, seg)],
            };
            let to = HeadGrads {
                q: grad_q,
                k: &mut grads.k,
                v: &mut grads.v,
            };
            head_backward(x, out, self.scale, to, &mut scratch);
        }
        grads
    }
}

fn add(dst: &mut [f32], src: &[f32]) {
    dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
}

#[cfg(test)]
mod tests {
    use candle_core::Var;

    use super::super::attention::tests::{max_diff, random};
    use super::*;

    /// A root of 70 tokens (two blocks of query rows) with branches of 5 and 66 tokens, then a
    /// sequence of its own of 3 tokens.
    fn tree() -> TreeBatch {
        let segments = vec![
            Segment {
                start: 0,
                len: 70,
                root: None,
            },
            Segment {
                start: 70,
                len: 5,
                root: Some(0),
            },
            Segment {
                start: 75,
                len: 66,
                root: Some(0),
            },
            Segment {
                start: 141,
                len: 3,
                root: None,
            },
        ];
        TreeBatch::new(&[0; 144], segments, &Device::Cpu).unwrap()
    }

    /// Output and q/k/v gradients of one implementation under a fixed downstream loss.
    fn run(attention: TrainingAttention, tree: &TreeBatch) -> Vec<Tensor> {
        let n = tree.len();
        let (q, k, v) = (
            random((4, n, 8), 1),
            random((2, n, 8), 2),
            random((2, n, 8), 3),
        );
        let weights = random((4, n, 8), 4);
        let out = attention.tree(&q, &k, &v, tree, 1.0 / 8f64.sqrt()).unwrap();
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
    fn fused_tree_attention_matches_the_matmul_path() {
        let tree = tree();
        let (fused, reference) = (
            run(TrainingAttention::Fused, &tree),
            run(TrainingAttention::Matmul, &tree),
        );
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
    fn a_branch_attends_as_the_end_of_its_whole_sequence() {
        // Root 70 + branch 66 against the causal attention of the 136 tokens laid end to end.
        let tree = tree();
        let [q, k, v] = [(4, 1), (2, 2), (2, 3)].map(|(h, seed)| random((h, 144, 8), seed));
        let scale = 1.0 / 8f64.sqrt();
        let out = TrainingAttention::Fused
            .tree(&q, &k, &v, &tree, scale)
            .unwrap();
        let whole = |x: &Var| {
            Tensor::cat(
                &[x.narrow(1, 0, 70).unwrap(), x.narrow(1, 75, 66).unwrap()],
                1,
            )
            .unwrap()
            .unsqueeze(0)
            .unwrap()
        };
        let causal = TrainingAttention::Fused
            .forward(&whole(&q), &whole(&k), &whole(&v), &[vec![1; 136]], scale)
            .unwrap()
            .squeeze(0)
            .unwrap();
        let diff = max_diff(
            &out.narrow(1, 75, 66).unwrap(),
            &causal.narrow(1, 70, 66).unwrap(),
        );
        assert!(diff < 1e-5, "{diff}");
    }

    #[test]
    fn positions_continue_from_the_root_and_bad_segments_are_refused() {
        let t = TreeBatch::new(
            &[1, 2, 3, 4, 5],
            vec![
                Segment {
                    start: 0,
                    len: 2,
                    root: None,
                },
                Segment {
                    start: 2,
                    len: 2,
                    root: Some(0),
                },
                Segment {
                    start: 4,
                    len: 1,
                    root: None,
                },
            ],
            &Device::Cpu,
        )
        .unwrap();
        assert_eq!(t.positions(), vec![0, 1, 2, 3, 0]);
        let gap = vec![Segment {
            start: 1,
            len: 2,
            root: None,
        }];
        assert!(TreeBatch::new(&[1, 2, 3], gap, &Device::Cpu).is_err());
        let nested = vec![
            Segment {
                start: 0,
                len: 1,
                root: None,
            },
            Segment {
                start: 1,
                len: 1,
                root: Some(0),
            },
            Segment {
                start: 2,
                len: 1,
                root: Some(1),
            },
        ];
        let err = TreeBatch::new(&[1, 2, 3], nested, &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("tree segment 2"), "{err}");
    }
}
