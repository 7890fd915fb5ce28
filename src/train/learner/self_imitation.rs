//! Self-imitation replay (after Oh et al. 2018, "Self-Imitation Learning", in a critic-free,
//! step-level form; config section `self_imitation`). After each rollout, wherever a trajectory
//! group made a choice whose outcome the others did not match, the better choice goes to a replay
//! buffer keyed by where it was made: a newer verdict on the same place replaces the older one,
//! and the oldest entries leave first when the buffer is full. Every actor mini-batch then adds
//! `coef ×` the mean negative log-likelihood of `batch_size` buffer entries (their response
//! tokens, under the same constrained-decoding masks as the policy loss) to the actor loss.
//!
//! What a choice is follows the context layout. In the `window` layout it is one step: every
//! anchor state (steps with the same `state_hash` in one group, GiGPO's anchors) visited with
//! different responses, where one response's mean discounted return (γ = `step_reward_gamma`)
//! beat every other response's by at least `margin`, sends that step. In the `concat` layout a
//! step's prompt is the whole history, so the choice is the whole trajectory: the trajectories of
//! one group start from the same prompt, and a trajectory whose return beat every other distinct
//! trajectory's by `margin` is replayed whole, keyed by its first prompt. The decisive choices
//! are few per rollout; replay revisits them across many updates instead of once. The buffer is
//! written into every checkpoint as a store dataset (`ckpt-N/self_imitation/`), so `--resume`
//! continues with the same buffer.

use crate::config::ContextLayout;
use crate::dist::Collective;
use crate::model::Model;
use crate::seed;
use crate::store::{Dataset, DatasetWriter, StepRecord, WriterOptions};
use crate::train::learner::batch::{pack, trajectories, PackedBatch};
use crate::train::learner::device_batch::{BatchLayout, DeviceBatch};
use crate::train::learner::masks::ResponseMasks;
use crate::train::TrainError;
use candle_core::Tensor;
use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

/// Name of the buffer's dataset inside a checkpoint directory.
pub const CHECKPOINT_DIR: &str = "self_imitation";

/// The replay buffer: better choices, oldest first, at most one per place. Each entry is one
/// training sequence of the layout: a step (`window`) or a whole trajectory (`concat`), stored
/// as a span of `records`.
#[derive(Clone, Debug)]
pub struct ReplayBuffer {
    capacity: usize,
    layout: ContextLayout,
    records: Vec<StepRecord>,
    spans: Vec<Range<usize>>,
}

impl ReplayBuffer {
    /// An empty buffer of at most `capacity` entries, each one training sequence of `layout`.
    pub fn new(capacity: usize, layout: ContextLayout) -> Self {
        Self {
            capacity,
            layout,
            records: Vec::new(),
            spans: Vec::new(),
        }
    }

    /// The buffered records, entry after entry, oldest first.
    pub fn records(&self) -> &[StepRecord] {
        &self.records
    }

    /// Each entry's records, as a range of [`records`](Self::records).
    pub fn spans(&self) -> &[Range<usize>] {
        &self.spans
    }

    /// Takes the entries out of the buffer (moved, not copied), leaving it empty.
    fn take_entries(&mut self) -> Vec<Vec<StepRecord>> {
        let mut records = std::mem::take(&mut self.records).into_iter();
        self.spans
            .drain(..)
            .map(|span| records.by_ref().take(span.len()).collect())
            .collect()
    }

    /// Replaces the entries by `entries`, the oldest beyond the capacity left out.
    fn set_entries(&mut self, entries: Vec<Vec<StepRecord>>) {
        let overflow = entries.len().saturating_sub(self.capacity);
        self.records.clear();
        self.spans.clear();
        for entry in entries.into_iter().skip(overflow) {
            let start = self.records.len();
            self.records.extend(entry);
            self.spans.push(start..self.records.len());
        }
    }

    /// Adds the better choices of `records` (discounted step returns `returns`, aligned with
    /// `records`): [`better_steps`] in the window layout, [`better_trajectories`] in the concat
    /// layout. Returns how many were added.
    pub fn admit(&mut self, records: &[StepRecord], returns: &[f64], margin: f64) -> usize {
        let better = match self.layout {
            ContextLayout::Window => better_steps(records, returns, margin)
                .into_iter()
                .map(|i| vec![i])
                .collect(),
            ContextLayout::Concat => better_trajectories(records, returns, margin),
        };
        let mut entries = self.take_entries();
        for sequence in &better {
            let entry: Vec<StepRecord> = sequence.iter().map(|&i| records[i].clone()).collect();
            entries.retain(|e| !self.same_place(e, &entry));
            entries.push(entry);
        }
        self.set_entries(entries);
        better.len()
    }

    /// Whether two entries' choices were made in the same place: the same env and state (a
    /// step) or the same env and first prompt (a trajectory).
    fn same_place(&self, a: &[StepRecord], b: &[StepRecord]) -> bool {
        let (a, b) = (&a[0], &b[0]);
        a.env_tag == b.env_tag
            && match self.layout {
                ContextLayout::Window => a.state_hash == b.state_hash,
                ContextLayout::Concat => a.obs_ids == b.obs_ids,
            }
    }

    /// Writes the buffer as a store dataset in `dir` (which must not hold one).
    pub fn save(&self, dir: &Path) -> Result<(), TrainError> {
        let mut writer = DatasetWriter::create(dir, WriterOptions::default())?;
        for rec in &self.records {
            writer.append(rec)?;
        }
        Ok(writer.seal()?)
    }

    /// Reads a buffer [`save`](Self::save)d in `dir`; a damaged one is an error naming the
    /// segment file and byte offset. An entry starts at every record with a fresh context
    /// (`context_len` 0), as it did when it was saved.
    pub fn load(dir: &Path, capacity: usize, layout: ContextLayout) -> Result<Self, TrainError> {
        let dataset = Dataset::open(dir)?;
        if let Some(problem) = dataset.problems().first() {
            return Err(TrainError::Data(format!(
                "self-imitation buffer {}: {problem}",
                dir.display()
            )));
        }
        let mut entries: Vec<Vec<StepRecord>> = Vec::new();
        for view in dataset.records() {
            let rec = view.to_record()?;
            match entries.last_mut() {
                Some(entry) if rec.context_len > 0 => entry.push(rec),
                _ => entries.push(vec![rec]),
            }
        }
        let mut buffer = Self::new(capacity, layout);
        buffer.set_entries(entries);
        Ok(buffer)
    }
}

/// Indices of the better steps of `records`: per anchor state (`group_id`, `state_hash`) visited
/// with at least two different responses, one step of the response whose mean `returns` beats
/// every other response's mean by at least `margin` (none when no response does).
pub fn better_steps(records: &[StepRecord], returns: &[f64], margin: f64) -> Vec<usize> {
    let choices = records
        .iter()
        .zip(returns)
        .enumerate()
        .map(|(i, (rec, &g))| Choice {
            place: (rec.group_id, rec.state_hash),
            made: rec.response_ids.clone(),
            value: g,
            index: i,
        });
    let mut better = better_choices(choices, margin);
    better.sort_unstable();
    better
}

/// The better trajectories of `records` (each as its record indices in step order): per group,
/// among at least two different trajectories (by their responses), the one whose mean return
/// from its first step beats every other's mean by at least `margin` (none when none does).
pub fn better_trajectories(
    records: &[StepRecord],
    returns: &[f64],
    margin: f64,
) -> Vec<Vec<usize>> {
    let trajs = trajectories(records);
    let choices = trajs.iter().enumerate().map(|(t, steps)| Choice {
        place: (records[steps[0]].group_id, 0),
        // Responses joined with a separator no token id takes, so that step boundaries count.
        made: steps
            .iter()
            .flat_map(|&i| records[i].response_ids.iter().copied().chain([u32::MAX]))
            .collect(),
        value: returns[steps[0]],
        index: t,
    });
    let mut better: Vec<Vec<usize>> = better_choices(choices, margin)
        .into_iter()
        .map(|t| trajs[t].clone())
        .collect();
    better.sort_unstable();
    better
}

/// One sampled choice: where it was made, what was done, its return and who made it.
struct Choice {
    place: (u64, u64),
    made: Vec<u32>,
    value: f64,
    index: usize,
}

/// Per place with at least two different choices made, the first maker of the choice whose mean
/// value beats every other choice's mean by at least `margin`.
fn better_choices(choices: impl Iterator<Item = Choice>, margin: f64) -> Vec<usize> {
    type Made = BTreeMap<Vec<u32>, (f64, usize, usize)>;
    let mut places: BTreeMap<(u64, u64), Made> = BTreeMap::new();
    for c in choices {
        let slot = places
            .entry(c.place)
            .or_default()
            .entry(c.made)
            .or_insert((0.0, 0, c.index));
        slot.0 += c.value;
        slot.1 += 1;
    }
    places
        .values()
        .filter(|made| made.len() >= 2)
        .filter_map(|made| {
            let mut means: Vec<(f64, usize)> = made
                .values()
                .map(|&(sum, n, first)| (sum / n as f64, first))
                .collect();
            means.sort_by(|a, b| b.0.total_cmp(&a.0));
            (means[0].0 - means[1].0 >= margin).then_some(means[0].1)
        })
        .collect()
}

/// What one actor mini-batch replays: the buffer, the loss weight, how many steps, and the seed
/// of this mini-batch's draw.
pub struct Replay<'a> {
    /// The buffer's records ([`ReplayBuffer::records`]).
    pub records: &'a [StepRecord],
    /// Each entry's records ([`ReplayBuffer::spans`]).
    pub spans: &'a [Range<usize>],
    /// Weight of the replay's mean negative log-likelihood in the actor loss.
    pub coef: f64,
    /// Buffer entries drawn (with replacement) per mini-batch, across all ranks.
    pub batch_size: usize,
    /// Seed of the draws; with the draw index it picks the entries.
    pub seed: u64,
}

impl Replay<'_> {
    /// This rank's part of the replay of mini-batch `draw`: `batch_size` buffer entries drawn
    /// with replacement (`seed`, `draw` pick them, the same on every rank), dealt round-robin over
    /// the ranks, packed for `policy` in `layout` (an entry drawn twice, or entries of one group,
    /// share their common prefix in a tree). `None` when the buffer is empty.
    pub fn draw(
        &self,
        policy: &Model,
        layout: BatchLayout,
        masks: &ResponseMasks,
        draw: &[u64],
        dist: &dyn Collective,
    ) -> Result<Option<ReplayDraw>, TrainError> {
        if self.spans.is_empty() {
            return Ok(None);
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed::derive(self.seed, draw));
        let picked: Vec<usize> = (0..self.batch_size)
            .map(|_| rng.random_range(0..self.spans.len()))
            .collect();
        let sequences: Vec<Vec<usize>> = (picked.iter().skip(dist.rank()))
            .step_by(dist.size())
            .map(|&e| self.spans[e].clone().collect())
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
        let nll = crate::train::learner::nll::cross_entropy(policy, packed, batch, &hidden)?;
        let value = f64::from(nll.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?);
        Ok(Some((nll.affine(self.coef, 0.0)?, value)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::Single;
    use crate::model::ModelConfig;
    use crate::test_support::{assert_same_step, gradients};
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

    /// A concat-layout trajectory: its steps' responses, each step's prompt 2 tokens (the first
    /// one `prompt`), the reward on its last step.
    fn trajectory(
        traj_id: u64,
        group_id: u64,
        prompt: u32,
        responses: &[u32],
        reward: f32,
    ) -> Vec<StepRecord> {
        let mut context = 0;
        responses
            .iter()
            .enumerate()
            .map(|(i, &action)| {
                let rec = StepRecord {
                    traj_id,
                    step_index: i as u32,
                    context_len: context,
                    obs_ids: vec![prompt + i as u32, 2],
                    reward: if i + 1 == responses.len() {
                        reward
                    } else {
                        0.0
                    },
                    ..step(group_id, 0, action)
                };
                context += 4;
                rec
            })
            .collect()
    }

    #[test]
    fn the_better_trajectory_of_a_group_is_chosen_whole() {
        // Group 0: trajectory [1, 4] succeeds twice, [1, 5] fails: [1, 4] (its first sample,
        // trajectory 0) is chosen. Group 1: [2, 4] and [3] tie. Group 2: one trajectory only.
        let records: Vec<StepRecord> = [
            trajectory(0, 0, 10, &[1, 4], 1.0),
            trajectory(1, 0, 10, &[1, 5], 0.0),
            trajectory(2, 0, 10, &[1, 4], 1.0),
            trajectory(3, 1, 20, &[2, 4], 1.0),
            trajectory(4, 1, 20, &[3], 1.0),
            trajectory(5, 2, 30, &[1], 1.0),
        ]
        .concat();
        let returns = crate::algo::step_returns(&records, 1.0).unwrap();
        assert_eq!(
            better_trajectories(&records, &returns, 0.05),
            vec![vec![0, 1]]
        );
        assert!(better_trajectories(&records, &returns, 1.5).is_empty());

        // In the concat layout the buffer holds the trajectory whole, keyed by its first prompt:
        // a newer verdict on group 0's prompt replaces it.
        let mut buffer = ReplayBuffer::new(4, ContextLayout::Concat);
        assert_eq!(buffer.admit(&records, &returns, 0.05), 1);
        assert_eq!(buffer.spans(), std::slice::from_ref(&(0..2)));
        assert_eq!(buffer.records(), &records[0..2]);
        let again = [
            trajectory(6, 9, 10, &[1, 5], 1.0),
            trajectory(7, 9, 10, &[7], 0.0),
        ]
        .concat();
        let again_returns = crate::algo::step_returns(&again, 1.0).unwrap();
        assert_eq!(buffer.admit(&again, &again_returns, 0.05), 1);
        assert_eq!(
            buffer.records(),
            &again[0..2],
            "the same first prompt is held once"
        );
    }

    #[test]
    fn a_trajectory_buffer_loads_back_entry_by_entry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CHECKPOINT_DIR);
        let mut buffer = ReplayBuffer::new(3, ContextLayout::Concat);
        for (g, prompt) in [(0, 10), (1, 20), (2, 30)] {
            let records = [
                trajectory(2 * g, g, prompt, &[1, 2, 3], 1.0),
                trajectory(2 * g + 1, g, prompt, &[4], 0.0),
            ]
            .concat();
            buffer.admit(
                &records,
                &crate::algo::step_returns(&records, 1.0).unwrap(),
                0.05,
            );
        }
        assert_eq!(buffer.spans(), &[0..3, 3..6, 6..9]);
        buffer.save(&path).unwrap();
        let back = ReplayBuffer::load(&path, 3, ContextLayout::Concat).unwrap();
        assert_eq!(
            (back.records(), back.spans()),
            (buffer.records(), buffer.spans())
        );
        let smaller = ReplayBuffer::load(&path, 1, ContextLayout::Concat).unwrap();
        assert_eq!(smaller.records(), &buffer.records()[6..]);
        assert_eq!(smaller.spans(), std::slice::from_ref(&(0..3)));
    }

    #[test]
    fn a_newer_verdict_replaces_the_state_and_the_oldest_leave_first() {
        let mut buffer = ReplayBuffer::new(2, ContextLayout::Window);
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
        let mut buffer = ReplayBuffer::new(4, ContextLayout::Window);
        buffer.admit(
            &[step(0, 5, 1), step(0, 5, 2), step(0, 6, 2), step(0, 6, 3)],
            &[1.0, 0.0, 0.3, 0.9],
            0.1,
        );
        buffer.save(&dir.path().join(CHECKPOINT_DIR)).unwrap();
        let back =
            ReplayBuffer::load(&dir.path().join(CHECKPOINT_DIR), 4, ContextLayout::Window).unwrap();
        assert_eq!(back.records(), buffer.records());
        let smaller =
            ReplayBuffer::load(&dir.path().join(CHECKPOINT_DIR), 1, ContextLayout::Window).unwrap();
        assert_eq!(smaller.records(), &buffer.records()[1..]);

        // A torn segment: the error names the buffer and the damaged file.
        let segment = std::fs::read_dir(dir.path().join(CHECKPOINT_DIR))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| !p.ends_with(crate::store::MANIFEST_FILE))
            .unwrap();
        let bytes = std::fs::read(&segment).unwrap();
        std::fs::write(&segment, &bytes[..bytes.len() - 5]).unwrap();
        let err = ReplayBuffer::load(&dir.path().join(CHECKPOINT_DIR), 4, ContextLayout::Window)
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
        let spans: Vec<Range<usize>> = (0..buffer.len()).map(|i| i..i + 1).collect();
        assert_eq!(tree_and_padded_draws_agree(&buffer, &spans), 8);
    }

    #[test]
    fn a_trajectory_replay_trains_every_step_and_the_tree_gives_the_padded_loss() {
        // Two trajectories of one group (3 and 1 steps, the same first prompt) and one of
        // another: every replayed trajectory contributes all its steps' responses.
        let buffer: Vec<StepRecord> = [
            trajectory(0, 0, 10, &[1, 4, 5], 1.0),
            trajectory(1, 0, 10, &[6], 1.0),
            trajectory(2, 1, 20, &[3, 3], 1.0),
        ]
        .concat();
        let spans = [0..3, 3..4, 4..6];
        let rows = tree_and_padded_draws_agree(&buffer, &spans);
        assert!(rows > 8, "eight trajectories drawn, {rows} steps");
    }

    /// Draws eight entries of `records` (entries `spans`) in the tree and the padded layout and
    /// checks that both give the same loss and gradients; returns the steps drawn.
    fn tree_and_padded_draws_agree(records: &[StepRecord], spans: &[Range<usize>]) -> usize {
        let policy = Model::new(&ModelConfig::tiny(32), 1, &Device::Cpu).unwrap();
        let replay = Replay {
            records,
            spans,
            coef: 0.5,
            batch_size: 8,
            seed: 3,
        };
        let run = |tree| {
            let layout = BatchLayout { pad_id: 0, tree };
            let masks = ResponseMasks::default();
            let draw = replay.draw(&policy, layout, &masks, &[0, 1], &Single);
            let draw = draw.unwrap().unwrap();
            let (loss, _) = draw.loss(&policy).unwrap().unwrap();
            let value = loss.to_scalar::<f32>().unwrap();
            (value, gradients(&loss, policy.named_vars()), draw.rows())
        };
        let ((tree_loss, tree, rows), (padded_loss, padded, _)) = (run(true), run(false));
        assert_same_step((tree_loss, &tree), (padded_loss, &padded));
        rows
    }
}
