//! Cascade attention for a decode call on a device pool, from tensor ops (Hydragen's
//! formulation): each shared span of a [`CascadePlan`] is one batched matrix product of all its
//! readers' queries (every sequence of the sharing set, every query head of a KV head's group)
//! against the span's keys, gathered once by slot, then one against its values; each token's own
//! positions are a second, padded product. Every part yields an un-normalised softmax state
//! (running max, sum of exponentials, weighted values) and the parts merge by log-sum-exp. On
//! CUDA the products run on cuBLAS, so the shared prefix is read once per group and step and the
//! work runs at the speed of a matrix product. Scores, states and the merge are f32 whatever the
//! pool's dtype; the result has the queries' dtype.
//!
//! The slot and token tables go to the device once per call ([`DeviceCascade::new`]) and serve
//! every layer ([`DeviceCascade::attend`]).

use candle_core::{DType, Device, Tensor, D};

use super::cascade::CascadePlan;
use super::{KvError, SeqSlots};

/// A state's max where a token has no part: its weight `exp(NO_PART − max)` is exactly 0.
const NO_PART: f64 = -1e30;

/// One shared span's tables: the slots it covers and the tokens (rows of the call) that read it.
struct SpanTables {
    slots: Tensor,
    tokens: Tensor,
    /// `[n, 1, 1, 1]` u8: whether each token of the call reads the span.
    readers: Tensor,
}

/// A decode call's cascade plan as device tables. See the module documentation.
pub struct DeviceCascade {
    spans: Vec<SpanTables>,
    /// `[n · width]` u32: each token's own slots, padded with its last one.
    own_slots: Tensor,
    /// `[n, 1, 1, width]` f32: 0 on a token's own positions, −∞ on the padding.
    own_mask: Tensor,
    width: usize,
    tokens: usize,
}

/// An un-normalised softmax state, `[n, kv_heads, rep, 1]` max and sum, `[…, head_dim]` values.
struct State {
    max: Tensor,
    sum: Tensor,
    acc: Tensor,
}

impl DeviceCascade {
    /// The tables of `plan` over `seqs` on `dev`; `None` unless every sequence brings at most
    /// one new token (a decode call: prefill calls keep the paged prefill kernel), and when
    /// padding the tokens' own positions to the longest would more than double them (a token
    /// that shares nothing and has a long context: the paged decode kernel reads each
    /// sequence's own length instead).
    pub fn new(
        plan: &CascadePlan,
        seqs: &[SeqSlots],
        dev: &Device,
    ) -> Result<Option<Self>, KvError> {
        if seqs.iter().any(|s| s.num_new > 1) {
            return Ok(None);
        }
        let visible = SeqSlots::visible(seqs);
        let n = visible.len();
        let own: Vec<&[u32]> = (visible.iter().zip(&plan.own_start))
            .map(|(v, &start)| &v[start..])
            .collect();
        let width = own.iter().map(|o| o.len()).max().unwrap_or(1);
        let own_total: usize = own.iter().map(|o| o.len()).sum();
        if n * width > 2 * own_total {
            return Ok(None);
        }
        let mut own_slots = Vec::with_capacity(n * width);
        let mut own_mask = Vec::with_capacity(n * width);
        for slots in &own {
            let last = *slots.last().expect("a token sees itself");
            own_slots.extend(slots.iter().copied());
            own_slots.extend(std::iter::repeat_n(last, width - slots.len()));
            own_mask.extend(std::iter::repeat_n(0f32, slots.len()));
            own_mask.extend(std::iter::repeat_n(f32::NEG_INFINITY, width - slots.len()));
        }
        let spans = (plan.spans.iter())
            .map(|span| {
                let tokens: Vec<u32> = span.tokens.iter().map(|&t| t as u32).collect();
                let mut readers = vec![0u8; n];
                span.tokens.iter().for_each(|&t| readers[t] = 1);
                Ok(SpanTables {
                    slots: Tensor::new(span.slots, dev)?,
                    tokens: Tensor::new(tokens.as_slice(), dev)?,
                    readers: Tensor::from_vec(readers, (n, 1, 1, 1), dev)?,
                })
            })
            .collect::<Result<_, KvError>>()?;
        Ok(Some(Self {
            spans,
            own_slots: Tensor::from_vec(own_slots, n * width, dev)?,
            own_mask: Tensor::from_vec(own_mask, (n, 1, 1, width), dev)?,
            width,
            tokens: n,
        }))
    }

    /// Attention of the call's tokens, `q` `[n, num_heads, head_dim]`, over one layer's pool
    /// `k`, `v` `[slots, kv_heads, head_dim]` (query head h reads KV head `h / rep`); returns
    /// `q`'s shape and dtype.
    pub fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
    ) -> Result<Tensor, KvError> {
        let (n, heads, hd) = q.dims3()?;
        let kv_heads = k.dim(1)?;
        if n != self.tokens || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(KvError::ShapeMismatch {
                pool: format!(
                    "a cascade plan of {} tokens, {kv_heads} KV heads",
                    self.tokens
                ),
                wanted: format!("queries {:?}", q.dims()),
            });
        }
        let (rep, dtype) = (heads / kv_heads, q.dtype());
        // [n, kv_heads, rep, hd], pre-scaled.
        let q = (q.to_dtype(DType::F32)? * f64::from(scale))?.reshape((n, kv_heads, rep, hd))?;
        let mut state = self.own_part(&q, k, v)?;
        for span in &self.spans {
            state = merge(state, span_part(span, &q, k, v, n)?)?;
        }
        let out = state.acc.broadcast_div(&state.sum)?;
        Ok(out.reshape((n, heads, hd))?.to_dtype(dtype)?)
    }

    /// Each token over its own positions: `[n, kv, rep, hd] × [n, kv, hd, width]`, padding masked.
    fn own_part(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<State, KvError> {
        let (n, kv_heads, _, hd) = q.dims4()?;
        let rows = |pool: &Tensor| -> Result<Tensor, KvError> {
            Ok(pool
                .index_select(&self.own_slots, 0)?
                .to_dtype(DType::F32)?
                .reshape((n, self.width, kv_heads, hd))?)
        };
        let keys = rows(k)?.permute((0, 2, 3, 1))?.contiguous()?;
        let values = rows(v)?.permute((0, 2, 1, 3))?.contiguous()?;
        let scores = q
            .contiguous()?
            .matmul(&keys)?
            .broadcast_add(&self.own_mask)?;
        softmax_state(&scores, &values)
    }
}

/// The readers of `span` over its keys: one `[kv, m·rep, hd] × [kv, hd, P]` product for all of
/// them, their states placed at their rows of the call (the other rows get no part).
fn span_part(
    span: &SpanTables,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    n: usize,
) -> Result<State, KvError> {
    let (_, kv_heads, rep, hd) = q.dims4()?;
    let m = span.tokens.dim(0)?;
    let keys = k.index_select(&span.slots, 0)?.to_dtype(DType::F32)?;
    let values = v.index_select(&span.slots, 0)?.to_dtype(DType::F32)?;
    let keys = keys.permute((1, 2, 0))?.contiguous()?;
    let values = values.permute((1, 0, 2))?.contiguous()?;
    let queries = q
        .index_select(&span.tokens, 0)?
        .permute((1, 0, 2, 3))?
        .reshape((kv_heads, m * rep, hd))?;
    let part = softmax_state(&queries.matmul(&keys)?, &values)?;
    // [kv, m·rep, x] → [m, kv, rep, x], then scattered to the call's n rows.
    let placed = |t: &Tensor| -> Result<Tensor, KvError> {
        let x = t.dim(D::Minus1)?;
        let t = t
            .reshape((kv_heads, m, rep, x))?
            .permute((1, 0, 2, 3))?
            .contiguous()?;
        let zeros = Tensor::zeros((n, kv_heads, rep, x), DType::F32, t.device())?;
        Ok(zeros.index_add(&span.tokens, &t, 0)?)
    };
    let max = placed(&part.max)?;
    let readers = span.readers.broadcast_as(max.shape())?;
    let none = Tensor::full(NO_PART as f32, max.shape(), max.device())?;
    Ok(State {
        max: readers.where_cond(&max, &none)?,
        sum: placed(&part.sum)?,
        acc: placed(&part.acc)?,
    })
}

/// The softmax state of `scores` (keys in the last dimension) over `values` (`[…, keys, hd]`).
fn softmax_state(scores: &Tensor, values: &Tensor) -> Result<State, KvError> {
    let max = scores.max_keepdim(D::Minus1)?;
    let weights = scores.broadcast_sub(&max)?.exp()?;
    Ok(State {
        sum: weights.sum_keepdim(D::Minus1)?,
        acc: weights.matmul(values)?,
        max,
    })
}

/// The log-sum-exp merge of two states of the same rows.
fn merge(a: State, b: State) -> Result<State, KvError> {
    let max = a.max.maximum(&b.max)?;
    let wa = (a.max - &max)?.exp()?;
    let wb = (b.max - &max)?.exp()?;
    Ok(State {
        sum: ((a.sum * &wa)? + (b.sum * &wb)?)?,
        acc: (a.acc.broadcast_mul(&wa)? + b.acc.broadcast_mul(&wb)?)?,
        max,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvPool;

    /// Nested sharing in a decode call (tiny: 4 heads over 2 KV heads, head_dim 8): four
    /// sequences share a 600-slot prompt, two of them also a 300-slot turn, each has its own tail.
    fn case() -> (Vec<Vec<u32>>, Tensor, Tensor, Tensor) {
        let dev = Device::Cpu;
        let fill =
            |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin()).collect() };
        let k = Tensor::from_vec(fill(1600 * 16, 0.37), (1600, 2, 8), &dev).unwrap();
        let v = Tensor::from_vec(fill(1600 * 16, 0.53), (1600, 2, 8), &dev).unwrap();
        let q = Tensor::from_vec(fill(4 * 32, 0.29), (4, 4, 8), &dev).unwrap();
        let prompt: Vec<u32> = (0..600).collect();
        let turn: Vec<u32> = (600..900).collect();
        let own = |from: u32, n: u32| (from..from + n).collect::<Vec<u32>>();
        let lists = vec![
            [&prompt[..], &turn, &own(1100, 9)].concat(),
            [&prompt[..], &turn, &own(1200, 20)].concat(),
            [&prompt[..], &own(1300, 30)].concat(),
            [&prompt[..], &own(1400, 1)].concat(),
        ];
        (lists, q, k, v)
    }

    /// A decode call: every sequence of `lists` brings its last position.
    fn decode_call(lists: &[Vec<u32>]) -> Vec<SeqSlots<'_>> {
        (lists.iter())
            .map(|s| SeqSlots {
                slots: s,
                num_new: 1,
            })
            .collect()
    }

    /// The per-row CPU kernel's answer on the same rows.
    fn per_row(lists: &[Vec<u32>], q: &Tensor, k: &Tensor, v: &Tensor) -> Vec<f32> {
        let cfg = crate::model::ModelConfig::tiny(16);
        let mut pool = KvPool::new(&cfg, 1600, &Device::Cpu).unwrap();
        let all: Vec<u32> = (0..1600).collect();
        let flat = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        let (kf, vf) = (flat(k).to_vec1().unwrap(), flat(v).to_vec1().unwrap());
        pool.write(0, &all, &kf, &vf).unwrap();
        let seqs = decode_call(lists);
        let q = flat(q).to_vec1::<f32>().unwrap();
        pool.attend(0, &q, &seqs, 4, 0.3).unwrap()
    }

    fn check(dtype: DType, bound: f32) {
        let (lists, q, k, v) = case();
        let [q, k, v] = [q, k, v].map(|t| t.to_dtype(dtype).unwrap());
        let seqs = decode_call(&lists);
        let plan = CascadePlan::new(&seqs, 256).expect("shared runs");
        assert_eq!(plan.spans.len(), 2, "the prompt, then the turn inside it");
        let cascade = DeviceCascade::new(&plan, &seqs, &Device::Cpu)
            .unwrap()
            .unwrap();
        let out = cascade.attend(&q, &k, &v, 0.3).unwrap();
        assert_eq!((out.dims(), out.dtype()), (q.dims(), dtype));
        let out: Vec<f32> = out
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want = per_row(&lists, &q, &k, &v);
        let diff = (out.iter().zip(&want)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(diff <= bound, "{dtype:?}: max |Δ| {diff}");
    }

    #[test]
    fn matches_the_per_row_kernel_in_f32() {
        check(DType::F32, 1e-6);
    }

    #[test]
    fn matches_the_per_row_kernel_in_bf16_to_the_output_s_rounding() {
        // The kernel reads the same bf16 values exactly; only the bf16 output rounds.
        check(DType::BF16, 8e-3);
    }

    #[test]
    fn a_long_unshared_context_is_left_to_the_paged_kernel() {
        let (mut lists, ..) = case();
        lists.push((0..1600).rev().collect());
        let seqs = decode_call(&lists);
        let plan = CascadePlan::new(&seqs, 256).unwrap();
        assert!(DeviceCascade::new(&plan, &seqs, &Device::Cpu)
            .unwrap()
            .is_none());
    }

    #[test]
    fn a_prefill_call_is_not_planned() {
        let (lists, ..) = case();
        let seqs = [
            SeqSlots {
                slots: &lists[0],
                num_new: 1,
            },
            SeqSlots {
                slots: &lists[1],
                num_new: 2,
            },
        ];
        let plan = CascadePlan::new(&seqs, 256).unwrap();
        assert!(DeviceCascade::new(&plan, &seqs, &Device::Cpu)
            .unwrap()
            .is_none());
    }
}
