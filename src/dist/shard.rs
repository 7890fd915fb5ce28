//! Which part of a model's state a rank keeps under sharded data parallelism ([`Sharding`], the
//! ZeRO stages), and the arithmetic of the split. An optimizer's parameters, laid end to end as
//! one flat vector, are cut into units ([`ShardLayout`]: runs of consecutive parameters, one
//! decoder layer each, or one parameter outside the layers: [`layer_units`]); each unit is
//! padded to a multiple of the rank count and cut into equal blocks, one per rank
//! ([`FlatShard`]), so that a step moves one unit at a time and a rank's block is its block of
//! every unit, end to end. Blocks ignore parameter boundaries (a parameter may be split between
//! ranks, and with 3 ranks the split is uneven across parameters); [`ShardLayout::pieces`] says
//! which slice of which parameter falls where in a rank's block. It moves nothing: the trainer's optimizer step does.

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

/// One unit of a [`ShardLayout`]: a run of consecutive parameters split over the ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// Its parameters' indices in the optimizer's order.
    pub params: Range<usize>,
    /// Its values' positions in the flat vector of every parameter.
    pub values: Range<usize>,
    /// The rank's block of the unit's values.
    pub shard: FlatShard,
    /// Where the rank's part of the unit (its `shard.range()`, unpadded) starts in the rank's
    /// block.
    pub in_block: usize,
}

/// A rank's block of an optimizer's parameters cut into units, each split over the ranks on its
/// own (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    rank: usize,
    ranks: usize,
    units: Vec<Unit>,
    lens: Vec<usize>,
}

impl ShardLayout {
    /// The layout of rank `rank` of `ranks` over parameters of `lens` values each, cut into
    /// units of `unit_params` consecutive parameters each (their sum is `lens.len()`).
    pub fn new(rank: usize, ranks: usize, lens: &[usize], unit_params: &[usize]) -> Self {
        assert!(ranks > 0 && rank < ranks, "rank {rank} of {ranks}");
        assert_eq!(
            unit_params.iter().sum::<usize>(),
            lens.len(),
            "units cover every parameter once"
        );
        let (mut param, mut value, mut in_block) = (0, 0, 0);
        let mut units = Vec::with_capacity(unit_params.len());
        for &n in unit_params {
            let len: usize = lens[param..param + n].iter().sum();
            let shard = FlatShard::new(rank, ranks, len);
            units.push(Unit {
                params: param..param + n,
                values: value..value + len,
                shard,
                in_block,
            });
            (param, value, in_block) = (param + n, value + len, in_block + shard.range().len());
        }
        Self {
            rank,
            ranks,
            units,
            lens: lens.to_vec(),
        }
    }

    /// The units, in the flat order.
    pub fn units(&self) -> &[Unit] {
        &self.units
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The rank count.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Values in the rank's block (padding excluded).
    pub fn block_len(&self) -> usize {
        self.units.iter().map(|u| u.shard.range().len()).sum()
    }

    /// The flat vector's positions the rank's block holds, in block order, each with where it
    /// starts in the block.
    pub fn held(&self) -> Vec<(Range<usize>, usize)> {
        self.units
            .iter()
            .map(|u| {
                let r = u.shard.range();
                (u.values.start + r.start..u.values.start + r.end, u.in_block)
            })
            .filter(|(r, _)| !r.is_empty())
            .collect()
    }

    /// The slices of the parameters that fall in this rank's block, in block order.
    pub fn pieces(&self) -> Vec<Piece> {
        let mut out = Vec::new();
        for u in &self.units {
            for p in u.shard.pieces(&self.lens[u.params.clone()]) {
                out.push(Piece {
                    param: u.params.start + p.param,
                    in_param: p.in_param,
                    in_block: u.in_block + p.in_block.start..u.in_block + p.in_block.end,
                });
            }
        }
        out
    }
}

/// Units of one decoder layer each over parameters named as in HF checkpoints, in their order:
/// the runs of consecutive names with the same `layers.N.` (adapters and critics too); a
/// parameter outside any layer (an embedding, the final norm, a head) is a unit of its own.
pub fn layer_units<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<usize> {
    let mut units: Vec<usize> = Vec::new();
    let mut last = None;
    for name in names {
        let key = layer_of(name);
        match (last, units.last_mut()) {
            (Some(Some(k)), Some(n)) if key == Some(k) => *n += 1,
            _ => units.push(1),
        }
        last = Some(key);
    }
    units
}

/// The `…layers.N` prefix of a parameter name, `None` outside any layer.
fn layer_of(name: &str) -> Option<&str> {
    let at = name.find("layers.")? + "layers.".len();
    let digits = name[at..].bytes().take_while(u8::is_ascii_digit).count();
    (digits > 0).then(|| &name[..at + digits])
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

    #[test]
    fn units_split_alone_and_pieces_place_them_end_to_end_in_the_block() {
        // Parameters of 3, 5 | 2 | 4 values in units of 2, 1 and 1 parameters, over 2 ranks.
        let lens = [3, 5, 2, 4];
        let layouts: Vec<_> = (0..2)
            .map(|r| ShardLayout::new(r, 2, &lens, &[2, 1, 1]))
            .collect();
        // Unit 0 (8 values) gives 4 to each rank, unit 1 (2) gives 1, unit 2 (4) gives 2.
        assert_eq!(layouts[0].block_len(), 7);
        assert_eq!(layouts[1].held(), vec![(4..8, 0), (9..10, 4), (12..14, 5)]);
        let mut covered = [0u8; 14];
        for layout in &layouts {
            let mut next = 0;
            for p in layout.pieces() {
                assert_eq!(p.in_block.start, next, "pieces fill the block in order");
                next = p.in_block.end;
                let offset = [0, 3, 8, 10][p.param];
                for i in p.in_param {
                    covered[offset + i] += 1;
                }
            }
            assert_eq!(next, layout.block_len());
        }
        assert_eq!(covered, [1; 14]);
        // One unit is the flat split of every parameter at once.
        let whole = ShardLayout::new(1, 3, &[3, 5, 2], &[3]);
        assert_eq!(whole.pieces(), FlatShard::new(1, 3, 10).pieces(&[3, 5, 2]));
        // No parameters: no units, the rank still known.
        let empty = ShardLayout::new(1, 2, &[], &[]);
        assert_eq!((empty.rank(), empty.ranks(), empty.block_len()), (1, 2, 0));
    }

    #[test]
    fn layer_units_group_runs_of_one_layer() {
        let names = [
            "lm_head.weight",
            "model.embed_tokens.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.input_layernorm.weight",
            "model.layers.10.input_layernorm.weight",
            "model.norm.weight",
            "score.weight",
        ];
        assert_eq!(layer_units(names), vec![1, 1, 2, 1, 1, 1, 1]);
        assert_eq!(layer_units(std::iter::empty()), Vec::<usize>::new());
    }
}
