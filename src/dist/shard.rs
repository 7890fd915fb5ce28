//! Which part of a model's state a rank keeps under sharded data parallelism ([`Sharding`], the
//! ZeRO stages), and the arithmetic of the split: an optimizer's parameters laid end to end as
//! one flat vector, padded to a multiple of the rank count and cut into equal blocks, one per
//! rank ([`FlatShard`]). Blocks ignore parameter boundaries (a parameter may be split between
//! ranks, and with 3 ranks the split is uneven across parameters); [`FlatShard::pieces`] says
//! which slice of which parameter falls in a rank's block. It moves nothing: the trainer's
//! optimizer step does.

use std::ops::Range;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What data-parallel ranks partition instead of replicating (`sharding`; ZeRO-1/2/3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Sharding {
    /// Every rank holds the weights, the gradients and AdamW's moments; gradients all-reduced.
    #[default]
    None,
    /// ZeRO-1: each rank keeps AdamW's moments for its block of the parameters and updates that
    /// block; gradients are all-reduced, the updated blocks all-gathered.
    Optimizer,
    /// ZeRO-2: as `optimizer`, and the gradients are reduce-scattered, so a rank receives the
    /// summed gradient of its block only.
    Gradients,
    /// ZeRO-3: parameters partitioned too, gathered layer by layer for the forward and backward.
    Parameters,
}

impl Sharding {
    /// The setting's name in a config.
    pub fn name(self) -> &'static str {
        match self {
            Sharding::None => "none",
            Sharding::Optimizer => "optimizer",
            Sharding::Gradients => "gradients",
            Sharding::Parameters => "parameters",
        }
    }

    /// Whether AdamW's moments are partitioned (every mode but `none`).
    pub fn shards_optimizer(self) -> bool {
        self != Sharding::None
    }
}

/// A rank's block of a flat vector of `len` values split over `ranks` ranks: each block holds
/// `ceil(len / ranks)` positions, the last ones past `len` being padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlatShard {
    /// This rank, `0..ranks`.
    pub rank: usize,
    /// Number of ranks.
    pub ranks: usize,
    /// Values of the flat vector, padding excluded.
    pub len: usize,
}

/// One parameter's values inside a rank's block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The parameter's index in the optimizer's order.
    pub param: usize,
    /// Positions within the parameter's flattened values.
    pub in_param: Range<usize>,
    /// The same positions within the rank's block.
    pub in_block: Range<usize>,
}

impl FlatShard {
    /// The block of `rank` of `ranks` over a vector of `len` values.
    pub fn new(rank: usize, ranks: usize, len: usize) -> Self {
        assert!(ranks > 0 && rank < ranks, "rank {rank} of {ranks}");
        Self { rank, ranks, len }
    }

    /// Positions per block (padding included).
    pub fn block(&self) -> usize {
        self.len.div_ceil(self.ranks)
    }

    /// Length of the padded vector the collectives move: `ranks` blocks.
    pub fn padded_len(&self) -> usize {
        self.block() * self.ranks
    }

    /// This rank's positions of the unpadded vector (shorter than a block, or empty, at the end).
    pub fn range(&self) -> Range<usize> {
        let start = (self.rank * self.block()).min(self.len);
        let end = ((self.rank + 1) * self.block()).min(self.len);
        start..end
    }

    /// The slices of parameters of `lens` values each (laid end to end in that order) that fall
    /// in this rank's block, in order.
    pub fn pieces(&self, lens: &[usize]) -> Vec<Piece> {
        let mine = self.range();
        let mut out = Vec::new();
        let mut offset = 0;
        for (param, &n) in lens.iter().enumerate() {
            let (start, end) = (offset.max(mine.start), (offset + n).min(mine.end));
            if start < end {
                out.push(Piece {
                    param,
                    in_param: start - offset..end - offset,
                    in_block: start - mine.start..end - mine.start,
                });
            }
            offset += n;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_blocks_cover_an_uneven_vector_once_with_padding_at_the_end() {
        let shards: Vec<_> = (0..3).map(|r| FlatShard::new(r, 3, 10)).collect();
        assert_eq!(shards[0].block(), 4);
        assert_eq!(shards[0].padded_len(), 12);
        let ranges: Vec<_> = shards.iter().map(FlatShard::range).collect();
        assert_eq!(ranges, vec![0..4, 4..8, 8..10]);
        // More ranks than values: the last blocks are all padding.
        assert_eq!(FlatShard::new(2, 3, 2).range(), 2..2);
    }

    #[test]
    fn pieces_split_parameters_at_block_edges() {
        // Parameters of 3, 5 and 2 values; rank 1 of 3 holds positions 4..8.
        let pieces = FlatShard::new(1, 3, 10).pieces(&[3, 5, 2]);
        assert_eq!(
            pieces,
            vec![Piece {
                param: 1,
                in_param: 1..5,
                in_block: 0..4,
            }]
        );
        let first = FlatShard::new(0, 3, 10).pieces(&[3, 5, 2]);
        assert_eq!(first.len(), 2);
        assert_eq!(
            (first[1].in_param.clone(), first[1].in_block.clone()),
            (0..1, 3..4)
        );
        // Every value belongs to exactly one rank.
        let mut covered = [0u8; 10];
        for r in 0..3 {
            let shard = FlatShard::new(r, 3, 10);
            for p in shard.pieces(&[3, 5, 2]) {
                let offset = [0, 3, 8][p.param];
                for i in p.in_param {
                    covered[offset + i] += 1;
                }
            }
        }
        assert_eq!(covered, [1; 10]);
    }
}
