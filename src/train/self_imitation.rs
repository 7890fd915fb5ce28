//! Self-imitation replay (after Oh et al. 2018, "Self-Imitation Learning", in a critic-free,
//! step-level form; config section `self_imitation`). After each rollout, every anchor state of a
//! trajectory group (steps with the same `state_hash` in one group, GiGPO's anchors) where
//! different responses were sampled and one response's mean discounted return
//! (γ = `step_reward_gamma`) beat every other response's by at least `margin` sends that better
//! step to a replay buffer keyed by state: a newer verdict on a state replaces the older one, and
//! the oldest entries leave first when the buffer is full. Every actor mini-batch then adds
//! `coef ×` the mean negative log-likelihood of `batch_size` buffer steps (their response tokens,
//! under the same constrained-decoding masks as the policy loss) to the actor loss. The states
//! where a choice decided the outcome are few per rollout; replay revisits them across many
//! updates instead of once. The buffer is written into every checkpoint as a store dataset
//! (`ckpt-N/self_imitation/`), so `--resume` continues with the same buffer.

use super::batch::{pack, PackedBatch};
use super::device_batch::{BatchLayout, DeviceBatch};
use super::masks::ResponseMasks;
use super::TrainError;
use crate::dist::Collective;
use crate::model::Model;
use crate::seed;
use crate::store::{Dataset, DatasetWriter, StepRecord, WriterOptions};
use candle_core::Tensor;
use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::path::Path;

/// Name of the buffer's dataset inside a checkpoint directory.
pub const CHECKPOINT_DIR: &str = "self_imitation";

/// The replay buffer: better steps of contrasted states, oldest first, at most one per state.
#[derive(Clone, Debug, Default)]
pub struct ReplayBuffer {
    capacity: usize,
    entries: Vec<StepRecord>,
}

impl ReplayBuffer {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: Vec::new(),
        }
    }

    /// The buffered steps, oldest first.
    pub fn records(&self) -> &[StepRecord] {
        &self.entries
    }

    /// Adds the better steps of `records` ([`better_steps`] with discounted step returns
    /// `returns`, aligned with `records`); returns how many were added.
    pub fn admit(&mut self, records: &[StepRecord], returns: &[f64], margin: f64) -> usize {
        let better = better_steps(records, returns, margin);
        for &i in &better {
            let rec = &records[i];
            self.entries
                .retain(|e| (e.state_hash, &e.env_tag) != (rec.state_hash, &rec.env_tag));
            self.entries.push(rec.clone());
        }
        self.evict_overflow();
        better.len()
    }

    /// Drops the oldest entries beyond the capacity.
    fn evict_overflow(&mut self) {
        let overflow = self.entries.len().saturating_sub(self.capacity);
        self.entries.drain(..overflow);
    }

    /// Writes the buffer as a store dataset in `dir` (which must not hold one).
    pub fn save(&self, dir: &Path) -> Result<(), TrainError> {
        let mut writer = DatasetWriter::create(dir, WriterOptions::default())?;
        for rec in &self.entries {
            writer.append(rec)?;
        }
        Ok(writer.seal()?)
    }

    /// Reads a buffer [`save`](Self::save)d in `dir`; a damaged one is an error naming the
    /// segment file and byte offset.
    pub fn load(dir: &Path, capacity: usize) -> Result<Self, TrainError> {
        let dataset = Dataset::open(dir)?;
        if let Some(problem) = dataset.problems().first() {
            return Err(TrainError::Data(format!(
                "self-imitation buffer {}: {problem}",
                dir.display()
            )));
        }
        let entries = dataset
            .records()
            .map(|v| v.to_record())
            .collect::<Result<Vec<_>, _>>()?;
        let mut buffer = Self { capacity, entries };
        buffer.evict_overflow();
        Ok(buffer)
    }
}

/// Indices of the better steps of `records`: per anchor state (`group_id`, `state_hash`) visited
/// with at least two different responses, one step of the response whose mean `returns` beats
/// every other response's mean by at least `margin` (none when no response does).
pub fn better_steps(records: &[StepRecord], returns: &[f64], margin: f64) -> Vec<usize> {
    type Responses<'a> = BTreeMap<&'a [u32], (f64, usize, usize)>;
    let mut anchors: BTreeMap<(u64, u64), Responses> = BTreeMap::new();
    for (i, (rec, &g)) in records.iter().zip(returns).enumerate() {
        let slot = anchors
            .entry((rec.group_id, rec.state_hash))
            .or_default()
            .entry(rec.response_ids.as_slice())
            .or_insert((0.0, 0, i));
        slot.0 += g;
        slot.1 += 1;
    }
    let mut better: Vec<usize> = anchors
        .values()
        .filter(|responses| responses.len() >= 2)
        .filter_map(|responses| {
            let mut means: Vec<(f64, usize)> = responses
                .values()
                .map(|&(sum, n, first)| (sum / n as f64, first))
                .collect();
            means.sort_by(|a, b| b.0.total_cmp(&a.0));
            (means[0].0 - means[1].0 >= margin).then_some(means[0].1)
        })
        .collect();
    better.sort_unstable();
    better
}

/// What one actor mini-batch replays: the buffer, the loss weight, how many steps, and the seed
/// of this mini-batch's draw.
pub struct Replay<'a> {
    pub records: &'a [StepRecord],
    pub coef: f64,
    pub batch_size: usize,
    pub seed: u64,
}

impl Replay<'_> {
    /// This rank's part of the replay of mini-batch `draw`: `batch_size` buffer steps drawn with
    /// replacement (`seed`, `draw` pick them, the same on every rank), dealt round-robin over the
    /// ranks, packed for `policy` in `layout` (a step drawn twice, or steps of one group, share
    /// their common prefix in a tree). `None` when the buffer is empty.
    pub fn draw(
        &self,
        policy: &Model,
        layout: BatchLayout,
        masks: &ResponseMasks,
        draw: &[u64],
        dist: &dyn Collective,
    ) -> Result<Option<ReplayDraw>, TrainError> {
        if self.records.is_empty() {
            return Ok(None);
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed::derive(self.seed, draw));
        let picked: Vec<usize> = (0..self.batch_size)
            .map(|_| rng.random_range(0..self.records.len()))
            .collect();
        let sequences: Vec<Vec<usize>> = (picked.iter().skip(dist.rank()))
            .step_by(dist.size())
            .map(|&i| vec![i])
            .collect();
        if sequences.is_empty() {
            return Ok(Some(ReplayDraw {
                coef: self.coef,
                part: None,
            }));
        }
        let packed = pack(self.records, &sequences)?;
        let batch =
            DeviceBatch::laid_out(&packed, (self.records, &sequences), layout, policy.device())?
                .constrained(&packed, self.records, masks)?;
        Ok(Some(ReplayDraw {
            coef: self.coef,
            part: Some((packed, batch)),
        }))
    }
}

/// One rank's part of a mini-batch's replay draw.
pub struct ReplayDraw {
    coef: f64,
    part: Option<(PackedBatch, DeviceBatch)>,
}

impl ReplayDraw {
    /// Replayed steps in this part.
    pub fn rows(&self) -> usize {
        self.part.as_ref().map_or(0, |(p, _)| p.rows)
    }

    /// Response tokens in this part (the loss's normaliser).
    pub fn tokens(&self) -> f64 {
        self.part
            .as_ref()
            .map_or(0.0, |(p, _)| p.num_tokens() as f64)
    }

    /// `coef ×` the mean negative log-likelihood of this part's response tokens, and the
    /// unweighted value; `None` for an empty part.
    pub fn loss(&self, policy: &Model) -> Result<Option<(Tensor, f64)>, TrainError> {
        let Some((packed, batch)) = &self.part else {
            return Ok(None);
        };
        let hidden = policy.hidden(&batch.input)?;
        let nll = super::sft::cross_entropy(policy, packed, batch, &hidden)?;
        let value = f64::from(nll.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?);
        Ok(Some((nll.affine(self.coef, 0.0)?, value)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::Single;
    use crate::model::ModelConfig;
    use crate::train::close::{assert_same_step, gradients};
    use candle_core::Device;

    fn step(group_id: u64, state_hash: u64, action: u32) -> StepRecord {
        StepRecord {
            group_id,
            state_hash,
            env_tag: "T".into(),
            obs_ids: vec![1, 2],
            response_ids: vec![9, action],
            response_logprobs: vec![0.0, -0.7],
            ..StepRecord::default()
        }
    }

    #[test]
    fn the_better_response_of_a_contrasted_state_is_chosen() {
        // State 5 of group 0: action 1 averages (1.0 + 0.2) / 2 = 0.6, action 2 scores 0.1.
        // State 6: one response only (no contrast). Group 1's state 5: a tie within the margin.
        let records = [
            step(0, 5, 1),
            step(0, 5, 2),
            step(0, 5, 1),
            step(0, 6, 3),
            step(1, 5, 1),
            step(1, 5, 2),
        ];
        let returns = [1.0, 0.1, 0.2, 0.9, 0.50, 0.48];
        assert_eq!(better_steps(&records, &returns, 0.05), vec![0]);
        assert_eq!(better_steps(&records, &returns, 0.6), Vec::<usize>::new());
        assert_eq!(better_steps(&records, &returns, 0.0), vec![0, 4]);
    }

    #[test]
    fn a_newer_verdict_replaces_the_state_and_the_oldest_leave_first() {
        let mut buffer = ReplayBuffer::new(2);
        assert_eq!(
            buffer.admit(&[step(0, 5, 1), step(0, 5, 2)], &[1.0, 0.0], 0.1),
            1
        );
        assert_eq!(
            buffer.admit(&[step(1, 5, 2), step(1, 5, 1)], &[1.0, 0.0], 0.1),
            1
        );
        assert_eq!(buffer.records().len(), 1, "state 5 is held once");
        assert_eq!(buffer.records()[0].response_ids, vec![9, 2]);
        buffer.admit(&[step(2, 7, 1), step(2, 7, 2)], &[1.0, 0.0], 0.1);
        buffer.admit(&[step(3, 8, 1), step(3, 8, 2)], &[1.0, 0.0], 0.1);
        let states: Vec<u64> = buffer.records().iter().map(|r| r.state_hash).collect();
        assert_eq!(states, vec![7, 8], "capacity 2 drops state 5 first");
    }

    #[test]
    fn a_saved_buffer_loads_back_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let mut buffer = ReplayBuffer::new(4);
        buffer.admit(
            &[step(0, 5, 1), step(0, 5, 2), step(0, 6, 2), step(0, 6, 3)],
            &[1.0, 0.0, 0.3, 0.9],
            0.1,
        );
        buffer.save(&dir.path().join(CHECKPOINT_DIR)).unwrap();
        let back = ReplayBuffer::load(&dir.path().join(CHECKPOINT_DIR), 4).unwrap();
        assert_eq!(back.records(), buffer.records());
        let smaller = ReplayBuffer::load(&dir.path().join(CHECKPOINT_DIR), 1).unwrap();
        assert_eq!(smaller.records(), &buffer.records()[1..]);

        // A torn segment: the error names the buffer and the damaged file.
        let segment = std::fs::read_dir(dir.path().join(CHECKPOINT_DIR))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| !p.ends_with(crate::store::MANIFEST_FILE))
            .unwrap();
        let bytes = std::fs::read(&segment).unwrap();
        std::fs::write(&segment, &bytes[..bytes.len() - 5]).unwrap();
        let err = ReplayBuffer::load(&dir.path().join(CHECKPOINT_DIR), 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("self-imitation buffer"), "{err}");
        assert!(err.contains(&segment.display().to_string()), "{err}");
    }

    #[test]
    fn a_replay_draw_in_the_tree_layout_gives_the_padded_loss_and_gradients() {
        // Four window-layout steps, two per group sharing its 10-token prompt, drawn eight times
        // with replacement: steps drawn twice, and group partners, share their prefix in a tree.
        let buffer: Vec<StepRecord> = (0..4u32)
            .map(|i| StepRecord {
                group_id: u64::from(i / 2),
                obs_ids: (0..10).map(|t| 2 + (i / 2 * 11 + t * 3) % 28).collect(),
                response_ids: vec![4 + i, 9, 20 + i],
                response_logprobs: vec![0.0; 3],
                ..StepRecord::default()
            })
            .collect();
        let policy = Model::new(&ModelConfig::tiny(32), 1, &Device::Cpu).unwrap();
        let replay = Replay {
            records: &buffer,
            coef: 0.5,
            batch_size: 8,
            seed: 3,
        };
        let run = |tree| {
            let layout = BatchLayout { pad_id: 0, tree };
            let masks = ResponseMasks::default();
            let draw = replay.draw(&policy, layout, &masks, &[0, 1], &Single);
            let (loss, _) = draw.unwrap().unwrap().loss(&policy).unwrap().unwrap();
            let value = loss.to_scalar::<f32>().unwrap();
            (value, gradients(&loss, policy.named_vars()))
        };
        let ((tree_loss, tree), (padded_loss, padded)) = (run(true), run(false));
        assert_same_step((tree_loss, &tree), (padded_loss, &padded));
    }
}
