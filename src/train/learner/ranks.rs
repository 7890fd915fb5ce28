//! What a data-parallel rank does on its own and what the ranks agree on. Each rank plays a
//! contiguous share of every tag's env groups; the records are then gathered, in the order one
//! process would have produced them, so every rank holds the whole batch (advantages, the
//! replay buffer and the counters stay identical). Rollout-time critic values and reference
//! log-probs are computed by each rank on a dealt share of the sequences and gathered. Each
//! mini-batch's sequences are dealt to the ranks round-robin; a rank scales its part of each
//! loss by its share of the loss's normaliser, so the summed gradients are the gradient of the
//! whole mini-batch's loss; the gradients are summed before each optimizer step, which then runs
//! identically everywhere. In a single process (no launcher) every function here is the identity.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};

use crate::algo::AdamW;
use crate::dist::Collective;
use crate::rollout::engine::CacheCounters;
use crate::store::StepRecord;
use crate::train::Scalars;
use crate::train::TrainError;

/// The groups `rank` of `size` plays out of `groups` consecutive ones: `(offset, count)`.
pub fn group_share(groups: usize, rank: usize, size: usize) -> (usize, usize) {
    let start = groups * rank / size;
    let end = groups * (rank + 1) / size;
    (start, end - start)
}

/// This rank's part of a mini-batch: the entries at positions `rank, rank + size, …`.
pub fn deal<T: Copy>(items: &[T], dist: &dyn Collective) -> Vec<T> {
    items
        .iter()
        .skip(dist.rank())
        .step_by(dist.size())
        .copied()
        .collect()
}

/// A per-record result (critic values, reference log-probs) computed by each rank on its dealt
/// share of `sequences` and gathered, so every rank holds every record's row. `compute` returns
/// one row per record of `records_len`, filled for the records of the sequences it was given.
pub fn per_record_rows(
    records_len: usize,
    sequences: &[Vec<usize>],
    dist: &dyn Collective,
    compute: impl FnOnce(&[Vec<usize>]) -> Result<Vec<Vec<f32>>, TrainError>,
) -> Result<Vec<Vec<f32>>, TrainError> {
    if dist.is_single_process() {
        return compute(sequences);
    }
    let mine: Vec<Vec<usize>> = sequences
        .iter()
        .skip(dist.rank())
        .step_by(dist.size())
        .cloned()
        .collect();
    let rows = compute(&mine)?;
    let filled: Vec<(usize, &Vec<f32>)> = mine.iter().flatten().map(|&r| (r, &rows[r])).collect();
    let bytes = serde_json::to_vec(&filled).map_err(|e| TrainError::Data(e.to_string()))?;
    let mut out = vec![Vec::new(); records_len];
    for (rank, part) in dist.all_gather_bytes(&bytes)?.iter().enumerate() {
        let rows: Vec<(usize, Vec<f32>)> = serde_json::from_slice(part)
            .map_err(|e| TrainError::Data(format!("rows gathered from rank {rank}: {e}")))?;
        for (r, row) in rows {
            out[r] = row;
        }
    }
    Ok(out)
}

/// Every rank's records, in one process's order (trajectory id, then step).
pub fn gather_records(
    local: Vec<StepRecord>,
    dist: &dyn Collective,
) -> Result<Vec<StepRecord>, TrainError> {
    if dist.is_single_process() {
        return Ok(local);
    }
    let bytes = serde_json::to_vec(&local).map_err(|e| TrainError::Data(e.to_string()))?;
    let mut all = Vec::new();
    for (rank, part) in dist.all_gather_bytes(&bytes)?.iter().enumerate() {
        let records: Vec<StepRecord> = serde_json::from_slice(part)
            .map_err(|e| TrainError::Data(format!("records gathered from rank {rank}: {e}")))?;
        all.extend(records);
    }
    all.sort_by_key(|r| (r.traj_id, r.step_index));
    Ok(all)
}

/// The rollout's prefix-cache counters summed over ranks (those [`CacheCounters::add`] sums).
pub fn sum_counters(
    mine: CacheCounters,
    dist: &dyn Collective,
) -> Result<CacheCounters, TrainError> {
    if dist.is_single_process() {
        return Ok(mine);
    }
    let bytes = serde_json::to_vec(&mine).map_err(|e| TrainError::Data(e.to_string()))?;
    let mut total = CacheCounters::default();
    for part in dist.all_gather_bytes(&bytes)? {
        let c: CacheCounters =
            serde_json::from_slice(&part).map_err(|e| TrainError::Data(e.to_string()))?;
        total.add(&c);
    }
    Ok(total)
}

/// A count summed over the ranks.
pub fn sum_count(mine: u64, dist: &dyn Collective) -> Result<u64, TrainError> {
    if dist.is_single_process() {
        return Ok(mine);
    }
    let mut total = 0;
    for (rank, part) in dist
        .all_gather_bytes(&mine.to_le_bytes())?
        .iter()
        .enumerate()
    {
        let bytes: [u8; 8] = part.as_slice().try_into().map_err(|_| {
            TrainError::Data(format!(
                "count gathered from rank {rank}: {} bytes",
                part.len()
            ))
        })?;
        total += u64::from_le_bytes(bytes);
    }
    Ok(total)
}

/// A loss normaliser (tokens or rows, as the loss aggregates) of this rank's part and of the
/// whole mini-batch, and how many rows of the whole train.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Share {
    pub local: f64,
    pub global: f64,
    pub global_rows: f64,
}

impl Share {
    /// The factor this rank's loss (normalised by `local`) is multiplied by so that the ranks'
    /// losses sum to the whole mini-batch's (normalised by `global`).
    pub fn scale(&self) -> f64 {
        if self.global > 0.0 {
            self.local / self.global
        } else {
            0.0
        }
    }
}

/// `(rows, normaliser)` of each loss term of this rank, summed over ranks, as [`Share`]s.
pub fn shares<const N: usize>(
    local: [(usize, f64); N],
    dist: &dyn Collective,
) -> Result<[Share; N], TrainError> {
    let mut sums: Vec<f64> = local
        .iter()
        .flat_map(|&(rows, norm)| [rows as f64, norm])
        .collect();
    dist.all_reduce_f64(&mut sums)?;
    Ok(std::array::from_fn(|i| Share {
        local: local[i].1,
        global: sums[2 * i + 1],
        global_rows: sums[2 * i],
    }))
}

/// `loss × share.scale()` in a launched world (the loss unchanged in a single process).
pub fn scaled(loss: Tensor, share: &Share, dist: &dyn Collective) -> Result<Tensor, TrainError> {
    if dist.is_single_process() {
        return Ok(loss);
    }
    Ok(loss.affine(share.scale(), 0.0)?)
}

/// Gradients for an optimizer step: this process's own (a single process) or the sum over ranks.
pub enum Gradients<'a> {
    Local(&'a GradStore),
    Summed(GradStore),
}

impl std::ops::Deref for Gradients<'_> {
    type Target = GradStore;
    fn deref(&self) -> &GradStore {
        match self {
            Gradients::Local(g) => g,
            Gradients::Summed(g) => g,
        }
    }
}

/// The gradients of `opt`'s parameters summed over ranks: `local` is this rank's (`None` when it
/// had nothing to back-propagate), `finite` whether its loss was finite. A parameter no rank
/// reached gets no gradient. `None` when a rank's loss was not finite: every rank then skips.
pub fn summed_gradients<'a>(
    opt: &AdamW,
    local: Option<&'a GradStore>,
    finite: bool,
    dist: &dyn Collective,
) -> Result<Option<Gradients<'a>>, TrainError> {
    if dist.is_single_process() {
        return Ok(local.filter(|_| finite).map(Gradients::Local));
    }
    let Some(reached) = reached_params(opt, local, finite, dist)? else {
        return Ok(None);
    };
    // One unit (a decoder layer) at a time, so the flat buffers hold one unit's gradients.
    let params = opt.params();
    let mut out = GradStore::default();
    for unit in opt.layer_layout(0, 1).units() {
        let len = unit.values.len();
        let summed =
            dist.all_reduce_tensor(&flat_gradient(opt, local, unit.params.clone(), len)?)?;
        let mut offset = 0;
        for i in unit.params.clone() {
            let var = &params[i].1;
            let n = var.elem_count();
            if reached[i] {
                let g = summed.narrow(0, offset, n)?.reshape(var.shape())?;
                out.insert(var.as_tensor(), g.to_dtype(var.dtype())?);
            }
            offset += n;
        }
    }
    Ok(Some(Gradients::Summed(out)))
}

/// Which of `opt`'s parameters any rank reached (has a gradient of, in `local`), agreed over the
/// ranks; `None` when a rank's loss was not finite (`finite`: this rank's).
pub fn reached_params(
    opt: &AdamW,
    local: Option<&GradStore>,
    finite: bool,
    dist: &dyn Collective,
) -> Result<Option<Vec<bool>>, TrainError> {
    let params = opt.params();
    let mut flags = vec![0f64; params.len() + 1];
    flags[params.len()] = f64::from(u8::from(!finite));
    if let Some(grads) = local.filter(|_| finite) {
        for (flag, (_, var)) in flags.iter_mut().zip(params) {
            *flag = f64::from(u8::from(grads.get(var).is_some()));
        }
    }
    dist.all_reduce_f64(&mut flags)?;
    if flags[params.len()] > 0.0 {
        return Ok(None);
    }
    Ok(Some(
        flags[..params.len()].iter().map(|&f| f > 0.0).collect(),
    ))
}

/// This rank's gradients (`local`) of `opt`'s parameters `params` laid end to end as one f32
/// vector of `len` values: zeros where a parameter has none, and after the last one.
pub fn flat_gradient(
    opt: &AdamW,
    local: Option<&GradStore>,
    params: std::ops::Range<usize>,
    len: usize,
) -> Result<Tensor, TrainError> {
    let mut parts = Vec::with_capacity(params.len() + 1);
    let mut filled = 0;
    for (_, var) in &opt.params()[params] {
        parts.push(match local.and_then(|g| g.get(var)) {
            Some(g) => g.to_dtype(DType::F32)?.flatten_all()?,
            None => Tensor::zeros(var.elem_count(), DType::F32, var.device())?,
        });
        filled += var.elem_count();
    }
    if len > filled {
        parts.push(Tensor::zeros(len - filled, DType::F32, &opt.device())?);
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// Running sums and counts of the update's metrics, merged over ranks.
pub fn merge_means(
    sums: Scalars,
    counts: BTreeMap<String, f64>,
    dist: &dyn Collective,
) -> Result<(Scalars, BTreeMap<String, f64>), TrainError> {
    if dist.is_single_process() {
        return Ok((sums, counts));
    }
    let bytes =
        serde_json::to_vec(&(&sums, &counts)).map_err(|e| TrainError::Data(e.to_string()))?;
    let (mut all_sums, mut all_counts) = (Scalars::new(), BTreeMap::new());
    for part in dist.all_gather_bytes(&bytes)? {
        let (s, c): (Scalars, BTreeMap<String, f64>) =
            serde_json::from_slice(&part).map_err(|e| TrainError::Data(e.to_string()))?;
        for (k, v) in s {
            *all_sums.entry(k).or_default() += v;
        }
        for (k, v) in c {
            *all_counts.entry(k).or_default() += v;
        }
    }
    Ok((all_sums, all_counts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_shares_are_contiguous_and_cover_every_group_once() {
        let shares: Vec<_> = (0..3).map(|r| group_share(8, r, 3)).collect();
        assert_eq!(shares, vec![(0, 2), (2, 3), (5, 3)]);
        assert_eq!(group_share(1, 1, 2), (0, 1));
        assert_eq!(group_share(1, 0, 2), (0, 0));
    }

    #[test]
    fn a_share_scales_a_rank_loss_to_its_part_of_the_whole() {
        // Rank with 3 of 8 tokens: its token-mean loss S/3 becomes S/8.
        let s = Share {
            local: 3.0,
            global: 8.0,
            global_rows: 2.0,
        };
        assert_eq!(s.scale(), 0.375);
        assert_eq!(Share::default().scale(), 0.0);
    }
}
