//! A sharded AdamW's state on disk as its ranks' blocks, so that a sharded run saves without
//! gathering its moments anywhere: each rank writes the moments of its block
//! (`block-<rank>.safetensors`: flat `exp_avg` and `exp_avg_sq`, and the step counter), rank 0
//! the layout (`layout.json`: the rank count and each unit of the [`ShardLayout`] as its
//! parameters' names and lengths, in the flat order; the first format's `params`, one unit of
//! them all, is read too). Any optimizer over the same parameters, sharded over any rank count and units or
//! whole, reads the part it keeps from the blocks that hold it ([`AdamW::load`] of the
//! directory).

use std::ops::Range;
use std::path::Path;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::{checkpoint_error, narrow, AdamW, Moments, STEP_KEY};
use crate::algo::AlgoError;
use crate::dist::shard::ShardLayout;

/// The layout file of a block directory.
const LAYOUT_FILE: &str = "layout.json";
/// The flat moments' names in a block file.
const EXP_AVG: &str = "exp_avg";
const EXP_AVG_SQ: &str = "exp_avg_sq";

/// How the blocks of a directory cut the flat parameter vector: as this build writes it, each
/// unit's parameters (`units`); as the first format wrote it, every parameter in one unit
/// (`params`, read only). A reader that knows only `params` (a build before units) refuses the
/// units form, where it would misread the blocks.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Layout {
    /// Ranks that wrote a block each.
    ranks: usize,
    /// Each unit's parameters, each with its name and number of values, in the flat order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    units: Option<Vec<Vec<(String, usize)>>>,
    /// The first format: each parameter's name and number of values, one unit of them all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    params: Option<Vec<(String, usize)>>,
}

impl Layout {
    /// The layout of `layout`'s units of the parameters `named` (name, values) in their order.
    fn of(layout: &ShardLayout, named: &[(String, usize)]) -> Self {
        let units = layout
            .units()
            .iter()
            .map(|u| named[u.params.clone()].to_vec())
            .collect();
        Self {
            ranks: layout.ranks(),
            units: Some(units),
            params: None,
        }
    }

    /// Every parameter's name and number of values, in the flat order.
    fn params(&self) -> Vec<(String, usize)> {
        match (&self.units, &self.params) {
            (Some(units), _) => units.concat(),
            (None, Some(params)) => params.clone(),
            (None, None) => Vec::new(),
        }
    }

    /// What is wrong with the layout itself, if anything.
    fn problem(&self) -> Option<String> {
        match (&self.units, &self.params) {
            _ if self.ranks == 0 => Some("names 0 ranks".into()),
            (Some(_), Some(_)) => Some("has both `units` and `params`".into()),
            (None, None) => Some("has neither `units` nor `params`".into()),
            (Some(units), None) if units.iter().any(Vec::is_empty) => {
                Some("has an empty unit".into())
            }
            _ => None,
        }
    }

    /// How the blocks cut the flat vector, as rank `rank` saw it.
    fn shard_layout(&self, rank: usize) -> ShardLayout {
        let lens: Vec<usize> = self.params().iter().map(|(_, n)| *n).collect();
        let units = match &self.units {
            Some(units) => units.iter().map(Vec::len).collect(),
            None => vec![lens.len()],
        };
        ShardLayout::new(rank, self.ranks, &lens, &units)
    }
}

fn block_file(dir: &Path, rank: usize) -> std::path::PathBuf {
    dir.join(format!("block-{rank}.safetensors"))
}

impl AdamW {
    /// Writes this sharded optimizer's block into `dir` (created if missing), and from rank 0
    /// the layout; an error for an unsharded optimizer ([`AdamW::save`] writes its whole state).
    pub fn save_block(&self, dir: &Path) -> Result<(), AlgoError> {
        let Moments::Block {
            layout: shard,
            exp_avg,
            exp_avg_sq,
            ..
        } = &self.moments
        else {
            return Err(super::sharded_misuse("save_block"));
        };
        // The checkpoint rank 0 began must be visible here (a filesystem every rank sees).
        if !dir.parent().is_some_and(Path::is_dir) {
            let reason = "its checkpoint directory is not visible on this rank: every rank must \
                          see the run directory (a shared filesystem)";
            return Err(checkpoint_error(dir, reason.into()));
        }
        match std::fs::create_dir(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(checkpoint_error(dir, e.to_string()))
            }
            _ => {}
        }
        if shard.rank() == 0 {
            let layout = Layout::of(shard, &self.named_lens());
            let path = dir.join(LAYOUT_FILE);
            let text = serde_json::to_vec_pretty(&layout).expect("a layout serialises");
            std::fs::write(&path, text).map_err(|e| checkpoint_error(&path, e.to_string()))?;
        }
        let step = Tensor::new(&[self.step as i64], exp_avg.device())?;
        let tensors = [
            (EXP_AVG, exp_avg.clone()),
            (EXP_AVG_SQ, exp_avg_sq.clone()),
            (STEP_KEY, step),
        ];
        let path = block_file(dir, shard.rank());
        candle_core::safetensors::save(&tensors.into_iter().collect(), &path)
            .and_then(|()| Ok(std::fs::File::open(&path)?.sync_all()?))
            .map_err(|e| checkpoint_error(&path, e.to_string()))
    }

    /// Checks that `dir` holds a layout and every block it names (before a checkpoint with
    /// them is committed).
    pub fn check_blocks(dir: &Path) -> Result<(), AlgoError> {
        let layout = read_layout(dir)?;
        match (0..layout.ranks).find(|&r| !block_file(dir, r).is_file()) {
            Some(r) => Err(checkpoint_error(
                &block_file(dir, r),
                format!("missing: rank {r} of {} wrote no block here", layout.ranks),
            )),
            None => Ok(()),
        }
    }

    /// Restores this optimizer's part of the state that the blocks in `dir` hold.
    pub(super) fn load_blocks(&mut self, dir: &Path) -> Result<(), AlgoError> {
        let layout_path = dir.join(LAYOUT_FILE);
        let layout = read_layout(dir)?;
        if let Some(problem) = layout.problem() {
            return Err(checkpoint_error(&layout_path, problem));
        }
        let (saved, mine) = (layout.params(), self.named_lens());
        if saved != mine {
            let differs = saved.iter().zip(&mine).find(|(a, b)| a != b);
            return Err(checkpoint_error(
                &layout_path,
                match differs {
                    Some((saved, here)) => format!("holds {saved:?} where this model has {here:?}"),
                    None => format!(
                        "lays out {} parameters over {} ranks, this model has {}",
                        saved.len(),
                        layout.ranks,
                        mine.len()
                    ),
                },
            ));
        }
        let len: usize = mine.iter().map(|(_, n)| n).sum();
        let wanted: Vec<Range<usize>> = match &self.moments {
            Moments::Block { layout, .. } => layout.held().into_iter().map(|(r, _)| r).collect(),
            Moments::PerParam { .. } => std::iter::once(0..len).collect(),
        };
        let (step, exp_avg, exp_avg_sq) = self.read_held(dir, &layout, &wanted)?;
        self.step = step;
        self.moments = match &self.moments {
            Moments::PerParam { .. } => Moments::PerParam {
                exp_avg: self.split(&exp_avg)?,
                exp_avg_sq: self.split(&exp_avg_sq)?,
            },
            Moments::Block {
                sharding,
                layout,
                pieces,
                ..
            } => Moments::Block {
                sharding: *sharding,
                layout: layout.clone(),
                pieces: pieces.clone(),
                exp_avg,
                exp_avg_sq,
            },
        };
        Ok(())
    }

    /// The step counter and the flat moments at the positions `wanted` (ranges of the flat
    /// vector, joined in order), read from the saved blocks that hold them one block at a time,
    /// so that besides what it keeps a rank holds one saved block at most.
    fn read_held(
        &self,
        dir: &Path,
        layout: &Layout,
        wanted: &[Range<usize>],
    ) -> Result<(u64, Tensor, Tensor), AlgoError> {
        let (dtype, device) = self.block_kind();
        let mut out_at = Vec::with_capacity(wanted.len());
        let mut total = 0;
        for w in wanted {
            out_at.push(total);
            total += w.len();
        }
        // (position in what is kept, moments) pieces, from each saved block in turn.
        let (mut m, mut v) = (Vec::new(), Vec::new());
        let mut step: Option<(usize, u64)> = None;
        for rank in 0..layout.ranks {
            let mut overlaps = Vec::new();
            for (theirs, at) in layout.shard_layout(rank).held() {
                for (want, &out) in wanted.iter().zip(&out_at) {
                    let (start, end) = (theirs.start.max(want.start), theirs.end.min(want.end));
                    if start < end {
                        let in_block = at + start - theirs.start..at + end - theirs.start;
                        overlaps.push((out + start - want.start, in_block));
                    }
                }
            }
            // Block 0 gives the step counter when no block holds anything wanted.
            if overlaps.is_empty() && !(rank == 0 && total == 0) {
                continue;
            }
            // Blocks are read on the host; only the kept positions move to the device.
            let block = SavedBlock::read(dir, layout, rank)?;
            match step {
                Some((first, s)) if s != block.step => {
                    let reason = format!("step {}, rank {first}'s block step {s}", block.step);
                    return Err(checkpoint_error(&block_file(dir, rank), reason));
                }
                _ => step = step.or(Some((rank, block.step))),
            }
            for (out, range) in overlaps {
                // Copies of the kept positions alone, so the block read is freed here.
                m.push((
                    out,
                    narrow(&block.exp_avg, &range)?.copy()?.to_dtype(dtype)?,
                ));
                v.push((
                    out,
                    narrow(&block.exp_avg_sq, &range)?.copy()?.to_dtype(dtype)?,
                ));
            }
        }
        let step = step.map(|(_, s)| s);
        let step = step.ok_or_else(|| checkpoint_error(dir, "no block holds any value".into()))?;
        let join = |mut parts: Vec<(usize, Tensor)>| -> Result<Tensor, AlgoError> {
            parts.sort_by_key(|(out, _)| *out);
            let parts: Vec<Tensor> = parts.into_iter().map(|(_, t)| t).collect();
            Ok(match parts.as_slice() {
                [] => Tensor::zeros(0, dtype, &candle_core::Device::Cpu)?,
                _ => Tensor::cat(&parts, 0)?,
            }
            .to_device(&device)?)
        };
        Ok((step, join(m)?, join(v)?))
    }

    /// Each parameter's name and number of values, in the flat order.
    fn named_lens(&self) -> Vec<(String, usize)> {
        self.params
            .iter()
            .map(|(n, v)| (n.clone(), v.elem_count()))
            .collect()
    }

    /// A flat vector of every parameter's values cut into the parameters' shapes.
    fn split(&self, flat: &Tensor) -> Result<Vec<Tensor>, AlgoError> {
        let mut offset = 0;
        let mut out = Vec::with_capacity(self.params.len());
        for (_, var) in &self.params {
            let n = var.elem_count();
            out.push(flat.narrow(0, offset, n)?.reshape(var.shape())?);
            offset += n;
        }
        Ok(out)
    }
}

/// One rank's saved block, checked against the layout.
struct SavedBlock {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: u64,
}

impl SavedBlock {
    /// Rank `rank`'s block file in `dir`, each moment holding as many values as `layout` gives
    /// that rank.
    fn read(dir: &Path, layout: &Layout, rank: usize) -> Result<Self, AlgoError> {
        let path = block_file(dir, rank);
        let mut saved = candle_core::safetensors::load(&path, &candle_core::Device::Cpu)
            .map_err(|e| checkpoint_error(&path, e.to_string()))?;
        let expected = layout.shard_layout(rank).block_len();
        let mut take = |key: &str| -> Result<Tensor, AlgoError> {
            let t = saved
                .remove(key)
                .ok_or_else(|| checkpoint_error(&path, format!("missing `{key}`")))?;
            if t.dims() != [expected] {
                let reason = format!(
                    "`{key}` holds {:?} values where rank {rank}'s block of this layout over {} \
                     ranks holds {expected}",
                    t.dims(),
                    layout.ranks
                );
                return Err(checkpoint_error(&path, reason));
            }
            Ok(t)
        };
        let (exp_avg, exp_avg_sq) = (take(EXP_AVG)?, take(EXP_AVG_SQ)?);
        let step = take_step(&mut saved, &path)?;
        Ok(Self {
            exp_avg,
            exp_avg_sq,
            step,
        })
    }
}

/// The layout file of block directory `dir`.
fn read_layout(dir: &Path) -> Result<Layout, AlgoError> {
    let path = dir.join(LAYOUT_FILE);
    let text = std::fs::read(&path).map_err(|e| checkpoint_error(&path, e.to_string()))?;
    serde_json::from_slice(&text).map_err(|e| checkpoint_error(&path, e.to_string()))
}

/// The step counter of a saved state.
pub(super) fn take_step(
    saved: &mut std::collections::HashMap<String, Tensor>,
    path: &Path,
) -> Result<u64, AlgoError> {
    let step = saved
        .remove(STEP_KEY)
        .ok_or_else(|| checkpoint_error(path, format!("missing `{STEP_KEY}`")))?;
    let step = step.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
    let [step] = step.as_slice() else {
        return Err(checkpoint_error(
            path,
            format!("`{STEP_KEY}` must hold one value"),
        ));
    };
    u64::try_from(*step).map_err(|_| checkpoint_error(path, format!("negative `{STEP_KEY}`")))
}
