//! The tree layout of a packed mini-batch (`tree_forward`). The sequences of one group (records
//! of one `group_id`: the same env seed, so the same first prompt) share the longest common prefix
//! of their inputs: it is packed once, as a root segment, and each sequence's rest as a branch
//! under it; a sequence alone in its group of the mini-batch (or sharing no token) is a root of
//! its own. This module owns that grouping and the remapping of a [`PackedBatch`]'s gather
//! indices (flat positions of the padded `[B, T]` outputs) onto the packed positions; forwarding
//! the tree is the model's ([`crate::model::TreeBatch`]).

use crate::model::Segment;
use crate::train::learner::batch::PackedBatch;
use std::collections::BTreeMap;

/// The packed tokens and segments of a mini-batch, and where each sequence's positions lie.
#[derive(Debug)]
pub struct PrefixTree {
    /// The packed token ids: each group's root, then its branches.
    pub ids: Vec<u32>,
    /// The segments tiling `ids`, for [`crate::model::TreeBatch::new`].
    pub segments: Vec<Segment>,
    places: Vec<Place>,
    /// The padded length T of the batch's flat indices.
    seq_len: usize,
}

/// Where one sequence lies: its first `shared` positions in its group's root, the rest from
/// `own_start` in its branch.
#[derive(Clone, Copy, Debug, Default)]
struct Place {
    shared: usize,
    root_start: usize,
    own_start: usize,
}

impl Place {
    fn at(&self, pos: usize) -> usize {
        if pos < self.shared {
            self.root_start + pos
        } else {
            self.own_start + pos - self.shared
        }
    }
}

impl PrefixTree {
    /// The tree of `p`'s sequences, the `b`-th of group `groups[b]`.
    pub fn new(p: &PackedBatch, groups: &[u64]) -> Self {
        let mut by_group: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for (b, &g) in groups.iter().enumerate() {
            by_group.entry(g).or_default().push(b);
        }
        let mut members: Vec<Vec<usize>> = by_group.into_values().collect();
        members.sort_by_key(|m| m[0]);
        let mut tree = Self {
            ids: Vec::new(),
            segments: Vec::new(),
            places: vec![Place::default(); p.inputs.len()],
            seq_len: p.seq_len,
        };
        for group in members {
            tree.add_group(&p.inputs, &group);
        }
        tree
    }

    /// Packs `group`'s sequences (indices into `inputs`): a root of their common prefix and a
    /// branch each when two or more share a token, else a root each.
    fn add_group(&mut self, inputs: &[Vec<u32>], group: &[usize]) {
        let shared = match group {
            [first, rest @ ..] if !rest.is_empty() => rest
                .iter()
                .map(|&b| common_prefix(&inputs[*first], &inputs[b]))
                .min()
                .unwrap_or(0),
            _ => 0,
        };
        let root = (shared > 0).then(|| self.push(&inputs[group[0]][..shared], None));
        for &b in group {
            self.places[b] = Place {
                shared,
                root_start: root.map_or(0, |r| self.segments[r].start),
                own_start: self.ids.len(),
            };
            let own = &inputs[b][shared..];
            if !own.is_empty() {
                self.push(own, root);
            }
        }
    }

    /// Appends a segment of the (non-empty) `ids` under `root`; returns its index.
    fn push(&mut self, ids: &[u32], root: Option<usize>) -> usize {
        self.segments.push(Segment {
            start: self.ids.len(),
            len: ids.len(),
            root,
        });
        self.ids.extend_from_slice(ids);
        self.segments.len() - 1
    }

    /// A flat index into the padded `[B, T]` outputs → the packed position of the same token.
    pub fn packed(&self, flat: u32) -> u32 {
        let (b, pos) = (flat as usize / self.seq_len, flat as usize % self.seq_len);
        self.places[b].at(pos) as u32
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StepRecord;
    use crate::train::learner::batch::pack;

    fn rec(traj: u64, group: u64, step: u32, ctx: u32, obs: &[u32], resp: &[u32]) -> StepRecord {
        StepRecord {
            traj_id: traj,
            group_id: group,
            step_index: step,
            context_len: ctx,
            obs_ids: obs.to_vec(),
            response_ids: resp.to_vec(),
            response_logprobs: vec![-1.0; resp.len()],
            ..Default::default()
        }
    }

    #[test]
    fn a_group_shares_its_common_prefix_and_indices_follow_their_tokens() {
        // Group 7: two trajectories sharing [1, 2, 3] (the prompt and the first response token);
        // group 9: one trajectory, a root of its own.
        let records = vec![
            rec(0, 7, 0, 0, &[1, 2], &[3, 4]),
            rec(1, 9, 0, 0, &[1, 2], &[8]),
            rec(2, 7, 0, 0, &[1, 2], &[3, 5, 6]),
        ];
        let p = pack(&records, &[vec![0], vec![1], vec![2]]).unwrap();
        let tree = PrefixTree::new(&p, &[7, 9, 7]);
        // Inputs [1,2,3], [1,2], [1,2,3,5]: root [1,2,3], branch [5] (the first input is all
        // prefix), then [1,2] alone.
        assert_eq!(tree.ids, vec![1, 2, 3, 5, 1, 2]);
        let roots: Vec<_> = tree
            .segments
            .iter()
            .map(|s| (s.start, s.len, s.root))
            .collect();
        assert_eq!(roots, vec![(0, 3, None), (3, 1, Some(0)), (4, 2, None)]);
        // Every scored position still reads its own token.
        let (t, flat_ids) = (p.seq_len, |b: usize, pos: usize| p.inputs[b][pos]);
        for (i, &ix) in p.token_index.iter().enumerate() {
            if p.token_mask[i] > 0.0 {
                let (b, pos) = (ix as usize / t, ix as usize % t);
                assert_eq!(tree.ids[tree.packed(ix) as usize], flat_ids(b, pos));
            }
        }
        assert_eq!(tree.packed((2 * t + 3) as u32), 3);
    }
}
