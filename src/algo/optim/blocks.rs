//! A sharded AdamW's state on disk as its ranks' blocks, so that a sharded run saves without
//! gathering its moments anywhere: each rank writes the moments of its block
//! (`block-<rank>.safetensors`: flat `exp_avg` and `exp_avg_sq`, and the step counter), rank 0
//! the layout (`layout.json`: the rank count and each parameter's name and length, in the flat
//! order). Any optimizer over the same parameters, sharded over any rank count or whole, reads
//! the part it keeps from the blocks that hold it ([`AdamW::load`] of the directory).

use std::ops::Range;
use std::path::Path;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::{checkpoint_error, narrow, AdamW, Moments, STEP_KEY};
use crate::algo::AlgoError;
use crate::dist::shard::FlatShard;

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
}

fn block_file(dir: &Path, rank: usize) -> std::path::PathBuf {
    dir.join(format!("block-{rank}.safetensors"))
}

impl AdamW {
    /// Writes this sharded optimizer's block into `dir` (created if missing), and from rank 0
    /// the layout; an error for an unsharded optimizer ([`AdamW::save`] writes its whole state).
    pub fn save_block(&self, dir: &Path) -> Result<(), AlgoError> {
        let Moments::Block {
            shard,
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
        if shard.rank == 0 {
            let layout = Layout {
                ranks: shard.ranks,
                params: self.named_lens(),
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
        let path = block_file(dir, shard.rank);
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
        let len = mine.iter().map(|(_, n)| n).sum();
        let wanted = match &self.moments {
            Moments::Block { shard, .. } => shard.range(),
            Moments::PerParam { .. } => 0..len,
        };
        let (step, exp_avg, exp_avg_sq) = self.read_range(dir, &layout, len, &wanted)?;
        self.step = step;
        self.moments = match &self.moments {
            Moments::PerParam { .. } => Moments::PerParam {
                exp_avg: self.split(&exp_avg)?,
                exp_avg_sq: self.split(&exp_avg_sq)?,
            },
            Moments::Block {
                sharding,
                shard,
                pieces,
                ..
            } => Moments::Block {
                sharding: *sharding,
                shard: *shard,
                pieces: pieces.clone(),
                exp_avg,
                exp_avg_sq,
            },
        };
        Ok(())
    }

    /// The step counter and the flat moments at positions `wanted` of a vector of `len` values,
    /// read from the blocks that overlap them.
    fn read_range(
        &self,
        dir: &Path,
        layout: &Layout,
        len: usize,
        wanted: &Range<usize>,
    ) -> Result<(u64, Tensor, Tensor), AlgoError> {
        let (dtype, device) = self.block_kind();
        let (mut m, mut v) = (Vec::new(), Vec::new());
        // Blocks are read on the host; only the wanted range moves to the device.
        let host = candle_core::Device::Cpu;
        let mut step = None;
        for rank in 0..layout.ranks {
            let theirs = FlatShard::new(rank, layout.ranks, len).range();
            let (start, end) = (theirs.start.max(wanted.start), theirs.end.min(wanted.end));
            // A rank whose block is all padding still reads the step counter (from block 0).
            if start >= end && !(rank == 0 && wanted.is_empty()) {
                continue;
            }
            let at = match start < end {
                true => start - theirs.start..end - theirs.start,
                false => 0..0,
            };
            let path = block_file(dir, rank);
            let mut saved = candle_core::safetensors::load(&path, &host)
                .map_err(|e| checkpoint_error(&path, e.to_string()))?;
            let mut take = |key: &str| -> Result<Tensor, AlgoError> {
                let t = saved
                    .remove(key)
                    .ok_or_else(|| checkpoint_error(&path, format!("missing `{key}`")))?;
                if t.dims() != [theirs.len()] {
                    let reason = format!(
                        "`{key}` holds {:?} values, rank {rank}'s block of {len} over {} ranks {}",
                        t.dims(),
                        layout.ranks,
                        theirs.len()
                    );
                    return Err(checkpoint_error(&path, reason));
                }
                Ok(t)
            };
            m.push(narrow(&take(EXP_AVG)?, &at)?.to_dtype(dtype)?);
            v.push(narrow(&take(EXP_AVG_SQ)?, &at)?.to_dtype(dtype)?);
            let counter = take_step(&mut saved, &path)?;
            if step.is_some_and(|s| s != counter) {
                let reason = format!("step {counter}, another block step {}", step.unwrap_or(0));
                return Err(checkpoint_error(&path, reason));
            }
            step = Some(counter);
        }
        let step = step.ok_or_else(|| checkpoint_error(dir, "no block holds any value".into()))?;
        // A copy of the wanted range alone, so the blocks read are freed here.
        let join = |parts: &[Tensor]| -> Result<Tensor, AlgoError> {
            Ok(Tensor::cat(parts, 0)?.copy()?.to_device(&device)?)
        };
        Ok((step, join(&m)?, join(&v)?))
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
