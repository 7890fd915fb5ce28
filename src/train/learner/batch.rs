//! Packing step records into training sequences.
//!
//! In the `concat` layout a trajectory is ONE sequence: the obs and response tokens of its steps
//! laid end to end (step t+1's context extends step t's), so one forward pass serves every step.
//! In the `window` layout each step is its own sequence (`context_len == 0`). A sequence of length
//! L is fed as input `ids[..L-1]` with targets `ids[1..]`, so output position i scores token i+1.
//! For every step row the packer records where its response tokens are scored (a row-padded
//! `[rows, max_len]` index into the flattened `[B, T]` outputs, with a mask) and where its
//! step-start value is read (the output position of its last pre-response token). Loss aggregation
//! then stays per step row whatever the layout. This module owns the index arithmetic and the
//! host-side views of a batch of records by trajectory ([`trajectories`], the discounted return of
//! each step); putting the sequences on a device is `device_batch`'s.

use crate::store::StepRecord;
use std::collections::BTreeMap;

/// Errors of packing; each names the trajectory and step.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// A record that does not fit its trajectory or itself (context length, log-prob count, empty
    /// context).
    #[error("trajectory {traj_id} step {step_index}: {msg}")]
    Inconsistent {
        /// The record's trajectory.
        traj_id: u64,
        /// The record's step within the trajectory.
        step_index: u32,
        /// What does not add up.
        msg: String,
    },
}

/// A mini-batch of sequences and the per-step-row gather indices into their outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedBatch {
    /// Model inputs, one per sequence (`ids[..L-1]`), unpadded.
    pub inputs: Vec<Vec<u32>>,
    /// Targets, one per sequence (`ids[1..]`), unpadded (same lengths as `inputs`).
    pub targets: Vec<Vec<u32>>,
    /// Padded sequence length T (the longest input).
    pub seq_len: usize,
    /// Number of step rows.
    pub rows: usize,
    /// Longest response of a row (the padded row width).
    pub max_response_len: usize,
    /// `[rows * max_response_len]` flat indices into `[B * T]` outputs (0 where masked).
    pub token_index: Vec<u32>,
    /// `[rows * max_response_len]` 1 for a response token, 0 for padding.
    pub token_mask: Vec<f32>,
    /// `[rows]` flat index of each row's step-start position (predicts its first response token).
    pub value_index: Vec<u32>,
    /// For each row, the index of its record in the slice handed to [`pack`].
    pub record_of_row: Vec<usize>,
}

impl PackedBatch {
    /// The target token at each scored position of `token_index` (0 at a padded one).
    pub fn token_targets(&self) -> Vec<u32> {
        let t = self.seq_len;
        self.token_index
            .iter()
            .map(|&i| {
                self.targets[i as usize / t]
                    .get(i as usize % t)
                    .copied()
                    .unwrap_or(0)
            })
            .collect()
    }

    /// Moves each row's value position past the first `forced(record)` tokens of its response
    /// (at most to the position that predicts its last token): with constrained decoding the
    /// tags before the model's first free choice are forced, so the position before them predicts
    /// a constant and carries no trained state features, while the position of the first free
    /// choice is where the policy reads the state.
    pub fn read_values_after_forced<E>(
        &mut self,
        records: &[StepRecord],
        forced: impl Fn(&StepRecord) -> Result<usize, E>,
    ) -> Result<(), E> {
        for (row, &r) in self.record_of_row.iter().enumerate() {
            let len = records[r].response_ids.len();
            let shift = forced(&records[r])?.min(len.saturating_sub(1));
            self.value_index[row] += shift as u32;
        }
        Ok(())
    }

    /// Total response tokens of the batch.
    pub fn num_tokens(&self) -> usize {
        self.token_mask.iter().filter(|&&m| m > 0.0).count()
    }
}

/// Packs `sequences` (each a list of indices into `records`, in step order: a whole trajectory in
/// the `concat` layout, one step in the `window` layout). Steps with an empty response get no row.
pub fn pack(records: &[StepRecord], sequences: &[Vec<usize>]) -> Result<PackedBatch, BatchError> {
    let mut full: Vec<Vec<u32>> = Vec::with_capacity(sequences.len());
    // (record index, sequence index, response start position, response length)
    let mut spans: Vec<(usize, usize, usize, usize)> = Vec::new();
    for (b, seq) in sequences.iter().enumerate() {
        let mut ids: Vec<u32> = Vec::new();
        for &r in seq {
            let rec = &records[r];
            if rec.context_len as usize != ids.len() {
                return Err(BatchError::Inconsistent {
                    traj_id: rec.traj_id,
                    step_index: rec.step_index,
                    msg: format!(
                        "context_len {} but the steps before it hold {} tokens",
                        rec.context_len,
                        ids.len()
                    ),
                });
            }
            ids.extend_from_slice(&rec.obs_ids);
            if rec.response_ids.len() != rec.response_logprobs.len() {
                return Err(BatchError::Inconsistent {
                    traj_id: rec.traj_id,
                    step_index: rec.step_index,
                    msg: format!(
                        "{} response tokens but {} log-probs",
                        rec.response_ids.len(),
                        rec.response_logprobs.len()
                    ),
                });
            }
            if !rec.response_ids.is_empty() {
                if ids.is_empty() {
                    return Err(BatchError::Inconsistent {
                        traj_id: rec.traj_id,
                        step_index: rec.step_index,
                        msg: "a response without any context token".into(),
                    });
                }
                spans.push((r, b, ids.len(), rec.response_ids.len()));
            }
            ids.extend_from_slice(&rec.response_ids);
        }
        full.push(ids);
    }
    let seq_len = full
        .iter()
        .map(|s| s.len().saturating_sub(1))
        .max()
        .unwrap_or(0);
    let max_response_len = spans.iter().map(|s| s.3).max().unwrap_or(0);
    let rows = spans.len();
    let mut token_index = vec![0u32; rows * max_response_len];
    let mut token_mask = vec![0f32; rows * max_response_len];
    let mut value_index = Vec::with_capacity(rows);
    let mut record_of_row = Vec::with_capacity(rows);
    for (row, &(r, b, start, len)) in spans.iter().enumerate() {
        // Output position p-1 scores the token at position p.
        let base = b * seq_len + start - 1;
        for j in 0..len {
            token_index[row * max_response_len + j] = (base + j) as u32;
            token_mask[row * max_response_len + j] = 1.0;
        }
        value_index.push(base as u32);
        record_of_row.push(r);
    }
    let inputs = full
        .iter()
        .map(|s| s[..s.len().saturating_sub(1)].to_vec())
        .collect();
    let targets = full
        .iter()
        .map(|s| s.get(1..).unwrap_or_default().to_vec())
        .collect();
    Ok(PackedBatch {
        inputs,
        targets,
        seq_len,
        rows,
        max_response_len,
        token_index,
        token_mask,
        value_index,
        record_of_row,
    })
}

/// Right-pads `seqs` to `len` with `pad`, and the matching 0/1 attention mask, both row-major.
pub fn pad(seqs: &[Vec<u32>], len: usize, pad: u32) -> (Vec<u32>, Vec<u32>) {
    let mut ids = Vec::with_capacity(seqs.len() * len);
    let mut mask = Vec::with_capacity(seqs.len() * len);
    for s in seqs {
        ids.extend(
            s.iter()
                .copied()
                .chain(std::iter::repeat_n(pad, len - s.len())),
        );
        mask.extend((0..len).map(|t| u32::from(t < s.len())));
    }
    (ids, mask)
}

/// Training sequences: each trajectory's steps in order, a new sequence at every step with a
/// fresh context (`context_len` 0), so a trajectory is one sequence in the concat layout and each
/// step is one in the window layout (a gateway session may mix them).
pub fn context_sequences(records: &[StepRecord]) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    for traj in trajectories(records) {
        for i in traj {
            match out.last_mut() {
                Some(seq) if records[i].context_len > 0 => seq.push(i),
                _ => out.push(vec![i]),
            }
        }
    }
    out
}

/// Groups records into concat-layout sequences: each trajectory's steps in order.
pub fn trajectories(records: &[StepRecord]) -> Vec<Vec<usize>> {
    let mut by_traj: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        by_traj.entry(r.traj_id).or_default().push(i);
    }
    by_traj
        .into_values()
        .map(|mut v| {
            v.sort_by_key(|&i| records[i].step_index);
            v
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(traj: u64, step: u32, ctx: u32, obs: &[u32], resp: &[u32]) -> StepRecord {
        StepRecord {
            traj_id: traj,
            step_index: step,
            context_len: ctx,
            obs_ids: obs.to_vec(),
            response_ids: resp.to_vec(),
            response_logprobs: vec![-1.0; resp.len()],
            ..Default::default()
        }
    }

    #[test]
    fn concat_trajectory_is_one_sequence_with_per_step_rows() {
        // Trajectory: obs [1,2] resp [3,4] | obs [5] resp [6,7,8].
        let records = vec![
            rec(0, 0, 0, &[1, 2], &[3, 4]),
            rec(0, 1, 4, &[5], &[6, 7, 8]),
        ];
        let p = pack(&records, &[vec![0, 1]]).unwrap();
        assert_eq!(p.inputs, vec![vec![1, 2, 3, 4, 5, 6, 7]]);
        assert_eq!(p.targets, vec![vec![2, 3, 4, 5, 6, 7, 8]]);
        assert_eq!((p.rows, p.max_response_len, p.seq_len), (2, 3, 7));
        // Row 0 scores targets at positions 1,2 (tokens 3,4); row 1 at 4,5,6 (tokens 6,7,8).
        assert_eq!(p.token_index, vec![1, 2, 0, 4, 5, 6]);
        assert_eq!(p.token_mask, vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0]);
        for (i, &ix) in p.token_index.iter().enumerate() {
            if p.token_mask[i] > 0.0 {
                let tok = p.targets[0][ix as usize];
                let row = i / 3;
                assert_eq!(tok, records[row].response_ids[i % 3]);
            }
        }
        assert_eq!(p.value_index, vec![1, 4]);
        assert_eq!(p.num_tokens(), 5);
    }

    #[test]
    fn window_steps_are_separate_padded_sequences() {
        let records = vec![
            rec(0, 0, 0, &[1, 2, 3], &[4]),
            rec(0, 1, 0, &[1, 5], &[6, 7]),
        ];
        let p = pack(&records, &[vec![0], vec![1]]).unwrap();
        assert_eq!(p.seq_len, 3);
        assert_eq!(p.value_index, vec![2, 3 + 1]);
        let mut shifted = p.clone();
        // Two forced tokens move the first row's value position by two; the second row's one-token
        // response can only be read where it stands.
        shifted
            .read_values_after_forced(&records, |_| Ok::<_, ()>(2))
            .unwrap();
        let lens: Vec<usize> = shifted
            .record_of_row
            .iter()
            .map(|&r| records[r].response_ids.len())
            .collect();
        let want: Vec<u32> = p
            .value_index
            .iter()
            .zip(&lens)
            .map(|(&v, &len)| v + 2.min(len as u32 - 1))
            .collect();
        assert_eq!(shifted.value_index, want);
        assert_eq!(p.token_index, vec![2, 0, 4, 5]);
        let (ids, mask) = pad(&p.inputs, p.seq_len, 0);
        assert_eq!(ids, vec![1, 2, 3, 1, 5, 6]);
        assert_eq!(mask, vec![1, 1, 1, 1, 1, 1]);
    }

    #[test]
    fn inconsistent_context_is_reported_with_the_step() {
        let records = vec![rec(7, 0, 0, &[1], &[2]), rec(7, 1, 5, &[3], &[4])];
        let err = pack(&records, &[vec![0, 1]]).unwrap_err().to_string();
        assert!(err.contains("trajectory 7 step 1"), "{err}");
    }
}
