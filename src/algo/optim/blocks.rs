//! A sharded AdamW's state on disk as its ranks' blocks, so that a sharded run saves without
//! gathering its moments anywhere: each rank writes the moments of its block
//! (`block-<rank>.safetensors`: flat `exp_avg` and `exp_avg_sq`, and the step counter), rank 0
//! the layout (`layout.json`: the rank count, each parameter's name and length in the flat
//! order, and the parameters per unit of the [`ShardLayout`]; without `units`, one unit of
//! them all). Any optimizer over the same parameters, sharded over any rank count and units or
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

/// How the blocks of a directory cut the flat parameter vector.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Layout {
    /// Ranks that wrote a block each.
    ranks: usize,
    /// Each parameter's name and number of values, in the flat order.
    params: Vec<(String, usize)>,
    /// Parameters per unit, in order (absent: one unit of every parameter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    units: Option<Vec<usize>>,
}

impl Layout {
    /// How the blocks cut the flat vector.
    fn shard_layout(&self, rank: usize) -> ShardLayout {
        let lens: Vec<usize> = self.params.iter().map(|(_, n)| *n).collect();
        let units = self.units.clone().unwrap_or_else(|| vec![lens.len()]);
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
            let layout = Layout {
                ranks: shard.ranks(),
                params: self.named_lens(),
                units: Some(shard.unit_params()),
            };
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
        let mine = self.named_lens();
        if layout.params != mine || layout.ranks == 0 {
            let differs = layout.params.iter().zip(&mine).find(|(a, b)| a != b);
            return Err(checkpoint_error(
                &layout_path,
                match differs {
                    Some((saved, here)) => format!("holds {saved:?} where this model has {here:?}"),
                    None => format!(
                        "lays out {} parameters over {} ranks, this model has {}",
                        layout.params.len(),
                        layout.ranks,
                        mine.len()
                    ),
                },
            ));
        }
        if let Some(units) = layout.units.as_ref() {
            if units.iter().sum::<usize>() != mine.len() || units.contains(&0) {
                let reason = format!("units {units:?} do not cut its {} parameters", mine.len());
                return Err(checkpoint_error(&layout_path, reason));
            }
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
    /// vector, joined in order), read from the saved blocks that hold them.
    fn read_held(
        &self,
        dir: &Path,
        layout: &Layout,
        wanted: &[Range<usize>],
    ) -> Result<(u64, Tensor, Tensor), AlgoError> {
        let (dtype, device) = self.block_kind();
        // Blocks are read on the host; only the wanted positions move to the device.
        let mut blocks: Vec<Option<SavedBlock>> = (0..layout.ranks).map(|_| None).collect();
        let (mut m, mut v) = (Vec::new(), Vec::new());
        let saved: Vec<Vec<(Range<usize>, usize)>> = (0..layout.ranks)
            .map(|rank| layout.shard_layout(rank).held())
            .collect();
        for want in wanted {
            // The saved pieces that overlap it, in flat order: (start, rank, positions in block).
            let mut found = Vec::new();
            for (rank, held) in saved.iter().enumerate() {
                for (theirs, at) in held {
                    let (start, end) = (theirs.start.max(want.start), theirs.end.min(want.end));
                    if start < end {
                        let in_block = at + start - theirs.start..at + end - theirs.start;
                        found.push((start, rank, in_block));
                    }
                }
            }
            found.sort_by_key(|(start, _, _)| *start);
            for (_, rank, range) in found {
                let block = match &mut blocks[rank] {
                    Some(b) => b,
                    slot => slot.insert(SavedBlock::read(dir, layout, rank)?),
                };
                m.push(narrow(&block.exp_avg, &range)?.to_dtype(dtype)?);
                v.push(narrow(&block.exp_avg_sq, &range)?.to_dtype(dtype)?);
            }
        }
        // The step counter from block 0 when no wanted position needed a block (a rank whose
        // block is all padding); every block read must agree on it.
        if blocks.iter().all(Option::is_none) {
            blocks[0] = Some(SavedBlock::read(dir, layout, 0)?);
        }
        let mut read = blocks
            .iter()
            .enumerate()
            .filter_map(|(r, b)| Some((r, b.as_ref()?)));
        let (_, first) = read.next().expect("a block was read");
        if let Some((rank, other)) = read.find(|(_, b)| b.step != first.step) {
            let reason = format!("step {}, block 0's step {}", other.step, first.step);
            return Err(checkpoint_error(&block_file(dir, rank), reason));
        }
        let join = |parts: &[Tensor]| -> Result<Tensor, AlgoError> {
            Ok(match parts {
                [] => Tensor::zeros(0, dtype, &candle_core::Device::Cpu)?,
                _ => Tensor::cat(parts, 0)?.copy()?,
            }
            .to_device(&device)?)
        };
        Ok((first.step, join(&m)?, join(&v)?))
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
