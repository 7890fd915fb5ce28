//! Cascade attention over the CPU pool: the new tokens of an attention call whose sequences share
//! a run of context slots (a group's prompt held once in the radix tree, an earlier turn shared
//! by some members) read that run's keys and values once for all of them, as one block of
//! scores, instead of once per token and head. The sharing tree is found from the slot lists
//! alone (equal slots hold the same token's K/V), nested to any depth: each shared run is a
//! [`SharedSpan`]; what a token sees past its last span is its own. Every part yields an
//! un-normalised softmax state (running max, sum of exponentials, weighted sum of values) and a
//! token's parts merge by log-sum-exp, in a fixed order, so the result does not depend on the
//! thread count. A call without any sharing is not planned here: the pool's per-row kernel runs
//! it unchanged.

use std::ops::Range;

use multiversion::multiversion;
use rayon::prelude::*;

use super::{dot, SeqSlots};

/// Keys per block of a shared span's work: the block's K and V rows stay in cache while every
/// query of the sharing set reads them.
const KEY_BLOCK: usize = 256;

/// A run of context positions that several sequences hold in the same slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedSpan<'a> {
    /// The run's slots (equal in every sharing sequence), borrowed from the first one's list.
    pub slots: &'a [u32],
    /// The new tokens (indices into the call's new tokens, in batch order) that read it.
    pub tokens: Vec<usize>,
}

/// Where each new token of a call reads its keys: the shared spans it belongs to, then its own
/// positions from `own_start` through itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CascadePlan<'a> {
    /// The shared runs, outermost first.
    pub spans: Vec<SharedSpan<'a>>,
    /// Per new token: its position in its sequence's slot list where its own keys start.
    pub own_start: Vec<usize>,
    /// Per new token: the (span, row in the span's `tokens`) pairs it reads, outermost first.
    pub parts: Vec<Vec<(usize, usize)>>,
}

impl<'a> CascadePlan<'a> {
    /// The sharing tree of `seqs` over shared runs of at least `min_span` positions, or `None`
    /// when there is none (the per-row kernel then runs the call as it is). A shorter common
    /// run, and all that its sequences hold after it, stays in each sequence's own part.
    pub fn new(seqs: &[SeqSlots<'a>], min_span: usize) -> Option<CascadePlan<'a>> {
        let mut first_token = Vec::with_capacity(seqs.len());
        let mut n = 0;
        for s in seqs {
            first_token.push(n);
            n += s.num_new;
        }
        let mut plan = CascadePlan {
            spans: Vec::new(),
            own_start: vec![0; n],
            parts: vec![Vec::new(); n],
        };
        let members: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].num_new > 0).collect();
        plan.split(seqs, &first_token, members, 0, min_span.max(1));
        (!plan.spans.is_empty()).then_some(plan)
    }

    /// Context positions read once instead of once per sequence: per span, its length times
    /// the sequences beyond the first that share it.
    pub fn positions_saved(&self, seqs: &[SeqSlots]) -> u64 {
        let mut seq_of = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            seq_of.extend(std::iter::repeat_n(i, s.num_new));
        }
        let readers = |span: &SharedSpan| {
            let mut seqs: Vec<usize> = span.tokens.iter().map(|&t| seq_of[t]).collect();
            seqs.dedup();
            seqs.len() as u64
        };
        (self.spans.iter())
            .map(|span| span.slots.len() as u64 * (readers(span) - 1))
            .sum()
    }

    /// Plans `members`, which agree on every slot before `depth`: their common run from
    /// `depth` becomes a span, then each subset that agrees on the next slot is planned alone.
    fn split(
        &mut self,
        seqs: &[SeqSlots<'a>],
        first: &[usize],
        members: Vec<usize>,
        depth: usize,
        min_span: usize,
    ) {
        let own = |plan: &mut Self, seq: usize, start: usize| {
            (first[seq]..first[seq] + seqs[seq].num_new).for_each(|t| plan.own_start[t] = start);
        };
        if members.len() < 2 {
            members.iter().for_each(|&m| own(self, m, depth));
            return;
        }
        let limit = members
            .iter()
            .map(|&m| seqs[m].context_len())
            .min()
            .unwrap_or(0);
        let lead = seqs[members[0]].slots;
        let common = (depth..limit)
            .take_while(|&p| members.iter().all(|&m| seqs[m].slots[p] == lead[p]))
            .count();
        if (1..min_span).contains(&common) {
            members.iter().for_each(|&m| own(self, m, depth));
            return;
        }
        if common > 0 {
            let tokens: Vec<usize> = (members.iter())
                .flat_map(|&m| first[m]..first[m] + seqs[m].num_new)
                .collect();
            let span = self.spans.len();
            for (row, &t) in tokens.iter().enumerate() {
                self.parts[t].push((span, row));
            }
            self.spans.push(SharedSpan {
                slots: &lead[depth..depth + common],
                tokens,
            });
        }
        let depth = depth + common;
        let mut subsets: Vec<(u32, Vec<usize>)> = Vec::new();
        for m in members {
            if seqs[m].context_len() == depth {
                own(self, m, depth);
                continue;
            }
            let slot = seqs[m].slots[depth];
            match subsets.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, subset)) => subset.push(m),
                None => subsets.push((slot, vec![m])),
            }
        }
        for (_, subset) in subsets {
            self.split(seqs, first, subset, depth, min_span);
        }
    }
}

/// One layer's K/V rows and how to find a head in them.
#[derive(Clone, Copy)]
pub(super) struct LayerRows<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// Floats one slot's row holds (every KV head).
    pub row: usize,
    pub head_dim: usize,
}

/// An un-normalised softmax over some keys for some query rows: per row the largest score, the
/// sum of `exp(score − max)` and the values weighted by it (`rows × head_dim`).
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

/// Causal attention of every new token of `seqs` under `plan`: `q` is `[n, num_heads,
/// head_dim]`, query head h reads KV head `h / rep`; returns the same shape.
pub(super) fn attend(
    plan: &CascadePlan,
    seqs: &[SeqSlots],
    q: &[f32],
    kv: LayerRows,
    (num_heads, rep): (usize, usize),
    scale: f32,
) -> Vec<f32> {
    let hd = kv.head_dim;
    let kv_heads = num_heads / rep;
    // One task per (span, KV head, block of keys): all of the span's queries of that head group.
    let tasks: Vec<(usize, usize, Range<usize>)> = (plan.spans.iter().enumerate())
        .flat_map(|(s, span)| {
            let blocks = span.slots.len().div_ceil(KEY_BLOCK);
            (0..kv_heads).flat_map(move |g| {
                (0..blocks).map(move |b| {
                    let end = ((b + 1) * KEY_BLOCK).min(span.slots.len());
                    (s, g, b * KEY_BLOCK..end)
                })
            })
        })
        .collect();
    let shared: Vec<Partial> = tasks
        .par_iter()
        .map(|(s, g, keys)| {
            let span = &plan.spans[*s];
            let queries: Vec<&[f32]> = (span.tokens.iter())
                .flat_map(|&t| (0..rep).map(move |r| (t, g * rep + r)))
                .map(|(t, h)| &q[(t * num_heads + h) * hd..][..hd])
                .collect();
            block_partial(&queries, &span.slots[keys.clone()], kv, g * hd, scale)
        })
        .collect();
    // Where each span's tasks start in `shared`, and how many blocks each has.
    let mut span_task = Vec::with_capacity(plan.spans.len());
    let mut at = 0;
    for span in &plan.spans {
        span_task.push(at);
        at += kv_heads * span.slots.len().div_ceil(KEY_BLOCK);
    }
    let visible = SeqSlots::visible(seqs);
    let mut out = vec![0.0f32; q.len()];
    out.par_chunks_mut(hd)
        .enumerate()
        .for_each(|(at, out_row)| {
            let (t, h) = (at / num_heads, at % num_heads);
            let g = h / rep;
            let q_row = &q[at * hd..(at + 1) * hd];
            let own = block_partial(
                &[q_row],
                &visible[t][plan.own_start[t]..],
                kv,
                g * hd,
                scale,
            );
            let mut states = vec![(own.max[0], own.sum[0], &own.acc[..])];
            for &(s, row) in &plan.parts[t] {
                let blocks = plan.spans[s].slots.len().div_ceil(KEY_BLOCK);
                let row = row * rep + h % rep;
                for p in &shared[span_task[s] + g * blocks..][..blocks] {
                    states.push((p.max[row], p.sum[row], &p.acc[row * hd..][..hd]));
                }
            }
            merge(&states, out_row);
        });
    out
}

/// `out = Σ_i e^{m_i − M} acc_i / Σ_i e^{m_i − M} sum_i` over the parts `(m_i, sum_i, acc_i)`,
/// `M` their largest max.
fn merge(states: &[(f32, f32, &[f32])], out: &mut [f32]) {
    let top = states.iter().map(|s| s.0).fold(f32::NEG_INFINITY, f32::max);
    out.fill(0.0);
    let mut denom = 0.0f32;
    for &(max, sum, acc) in states {
        if sum == 0.0 {
            continue;
        }
        let w = (max - top).exp();
        denom += w * sum;
        for (o, a) in out.iter_mut().zip(acc) {
            *o += w * a;
        }
    }
    if denom > 0.0 {
        out.iter_mut().for_each(|o| *o /= denom);
    }
}

/// The softmax state of every query row in `queries` over the keys in `slots` (the head whose
/// part of a row starts at `offset`): all scores first, reading each key row once for all
/// queries, then the weighted values, reading each value row once.
#[multiversion(targets = "simd")]
fn block_partial(
    queries: &[&[f32]],
    slots: &[u32],
    kv: LayerRows,
    offset: usize,
    scale: f32,
) -> Partial {
    let (hd, nk, rows) = (kv.head_dim, slots.len(), queries.len());
    let start = |s: u32| s as usize * kv.row + offset;
    let mut scores = vec![0.0f32; rows * nk];
    for (j, &slot) in slots.iter().enumerate() {
        let k = &kv.k[start(slot)..][..hd];
        for (r, q) in queries.iter().enumerate() {
            scores[r * nk + j] = scale * dot(q, k);
        }
    }
    let mut max = vec![f32::NEG_INFINITY; rows];
    let mut sum = vec![0.0f32; rows];
    for r in 0..rows {
        let row = &mut scores[r * nk..(r + 1) * nk];
        max[r] = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for w in row.iter_mut() {
            *w = (*w - max[r]).exp();
            sum[r] += *w;
        }
    }
    let mut acc = vec![0.0f32; rows * hd];
    for (j, &slot) in slots.iter().enumerate() {
        let v = &kv.v[start(slot)..][..hd];
        for r in 0..rows {
            let w = scores[r * nk + j];
            for (o, x) in acc[r * hd..(r + 1) * hd].iter_mut().zip(v) {
                *o += w * x;
            }
        }
    }
    Partial { max, sum, acc }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(slots: &[u32], num_new: usize) -> SeqSlots<'_> {
        SeqSlots { slots, num_new }
    }

    #[test]
    fn no_shared_slot_plans_nothing() {
        let (a, b) = ([0, 1, 2], [3, 4, 5]);
        assert_eq!(CascadePlan::new(&[seq(&a, 1), seq(&b, 1)], 1), None);
        assert_eq!(CascadePlan::new(&[seq(&a, 1)], 1), None);
    }

    #[test]
    fn a_group_prompt_and_a_shared_turn_nest() {
        // Four members share slots 0..4 (the prompt); members 0 and 1 also share 4..6 (a turn).
        let m0 = [0, 1, 2, 3, 4, 5, 10];
        let m1 = [0, 1, 2, 3, 4, 5, 11, 12];
        let m2 = [0, 1, 2, 3, 6, 13];
        let m3 = [0, 1, 2, 3, 14];
        let seqs = [seq(&m0, 1), seq(&m1, 2), seq(&m2, 1), seq(&m3, 1)];
        let plan = CascadePlan::new(&seqs, 1).unwrap();
        assert_eq!(plan.spans.len(), 2);
        assert_eq!(plan.spans[0].slots, [0, 1, 2, 3]);
        assert_eq!(plan.spans[0].tokens, [0, 1, 2, 3, 4]);
        assert_eq!(plan.spans[1].slots, [4, 5]);
        assert_eq!(plan.spans[1].tokens, [0, 1, 2]);
        assert_eq!(plan.own_start, [6, 6, 6, 4, 4]);
        assert_eq!(plan.parts[1], [(0, 1), (1, 1)]);
        assert_eq!(plan.parts[4], [(0, 4)]);
    }

    #[test]
    fn runs_shorter_than_the_minimum_stay_in_each_sequence_s_own_part() {
        let m0 = [0, 1, 2, 3, 4, 5, 10];
        let m1 = [0, 1, 2, 3, 4, 5, 11];
        let m2 = [0, 1, 6, 7, 8, 9, 12];
        let seqs = [seq(&m0, 1), seq(&m1, 1), seq(&m2, 1)];
        // All three share 2 slots (too short), members 0 and 1 share 6 (long enough): the short
        // run ends sharing for everyone, the longer one below it included.
        assert_eq!(CascadePlan::new(&seqs, 3), None);
        let plan = CascadePlan::new(&seqs[..2], 3).unwrap();
        assert_eq!(plan.spans[0].slots, [0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn a_span_stops_where_a_member_s_context_ends() {
        // Member 1 is prefilling its own tokens at positions 2..4: they are not shared context.
        let m0 = [0, 1, 2, 3, 9];
        let m1 = [0, 1, 7, 8];
        let plan = CascadePlan::new(&[seq(&m0, 1), seq(&m1, 2)], 1).unwrap();
        assert_eq!(plan.spans[0].slots, [0, 1]);
        assert_eq!(plan.own_start, [2, 2, 2]);
    }
}
