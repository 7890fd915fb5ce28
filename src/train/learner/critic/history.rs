//! The state critic's fitting history (`critic.history_batches`): the step rows of the last N
//! rollout batches (each row's critic state, return target and rollout-time value) that a state
//! critic (`critic.mode: state`) is fitted on after each update. On freshly drawn levels one
//! batch holds a few hundred steps, too few for a value of the whole level to carry over to the
//! next batch's levels; older batches' returns come from slightly older policies, the price of
//! the extra rows (`docs/experiments/critic.md` measures both). A critic state, unlike the
//! policy's features, does not change when the policy does, so old rows stay valid inputs. The
//! history goes into every checkpoint ([`CHECKPOINT_FILE`]), so `--resume` fits on the same rows.

use super::TrainError;
use candle_core::{DType, Device, Tensor};
use std::collections::{HashMap, VecDeque};
use std::path::Path;

/// Name of the history's file inside a checkpoint directory.
pub const CHECKPOINT_FILE: &str = "critic_history.safetensors";

/// Step rows of one or more batches: critic states `width` numbers each, flat, with each row's
/// return target and rollout-time value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StateRows {
    /// Critic states of all rows, row-major (`len() × width` numbers).
    pub states: Vec<f32>,
    /// Return target of each row.
    pub returns: Vec<f32>,
    /// The critic's value of each row at rollout time (the value-clipping anchor).
    pub old_values: Vec<f32>,
}

impl StateRows {
    /// Rows held.
    pub fn len(&self) -> usize {
        self.returns.len()
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.returns.is_empty()
    }

    fn extend(&mut self, other: &StateRows) {
        self.states.extend_from_slice(&other.states);
        self.returns.extend_from_slice(&other.returns);
        self.old_values.extend_from_slice(&other.old_values);
    }
}

/// The rows of the last `capacity` batches, oldest first.
#[derive(Clone, Debug, PartialEq)]
pub struct CriticHistory {
    capacity: usize,
    width: usize,
    batches: VecDeque<StateRows>,
}

impl CriticHistory {
    /// An empty history of `capacity` batches of critic states `width` wide.
    pub fn new(capacity: usize, width: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            width,
            batches: VecDeque::new(),
        }
    }

    /// Width of the critic states.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Adds the newest batch's rows; the oldest batch beyond the capacity leaves.
    pub fn push(&mut self, rows: StateRows) {
        debug_assert_eq!(rows.states.len(), rows.len() * self.width);
        self.batches.push_back(rows);
        while self.batches.len() > self.capacity {
            self.batches.pop_front();
        }
    }

    /// Rows of the newest batch.
    pub fn newest_len(&self) -> usize {
        self.batches.back().map_or(0, StateRows::len)
    }

    /// Every row held, oldest batch first.
    pub fn rows(&self) -> StateRows {
        let mut all = StateRows::default();
        for batch in &self.batches {
            all.extend(batch);
        }
        all
    }

    /// Writes the history to the safetensors file `path`: the rows (`states` `[n, width]`,
    /// `returns`, `old_values`) and each batch's row count (`batch_rows`), oldest first.
    pub fn save(&self, path: &Path) -> Result<(), TrainError> {
        let all = self.rows();
        let n = all.len();
        let counts: Vec<u32> = self.batches.iter().map(|b| b.len() as u32).collect();
        let device = Device::Cpu;
        let tensors = HashMap::from([
            (
                "states".to_string(),
                Tensor::from_vec(all.states, (n, self.width), &device)?,
            ),
            (
                "returns".to_string(),
                Tensor::from_vec(all.returns, n, &device)?,
            ),
            (
                "old_values".to_string(),
                Tensor::from_vec(all.old_values, n, &device)?,
            ),
            (
                "batch_rows".to_string(),
                Tensor::from_vec(counts.clone(), counts.len(), &device)?,
            ),
        ]);
        candle_core::safetensors::save(&tensors, path)?;
        Ok(())
    }

    /// Reads a history [`save`](Self::save)d at `path` for a critic of states `width` wide,
    /// keeping the newest `capacity` batches. A file of another width, or whose tensors do not
    /// fit together, is an error naming the file and the tensor.
    pub fn load(path: &Path, capacity: usize, width: usize) -> Result<Self, TrainError> {
        let bad =
            |what: String| TrainError::Data(format!("critic history {}: {what}", path.display()));
        let tensors =
            candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| bad(e.to_string()))?;
        let get = |name: &str, dtype: DType| -> Result<&Tensor, TrainError> {
            let t = tensors
                .get(name)
                .ok_or_else(|| bad(format!("no tensor `{name}`")))?;
            if t.dtype() != dtype {
                return Err(bad(format!("`{name}` is {:?}, not {dtype:?}", t.dtype())));
            }
            Ok(t)
        };
        let states = get("states", DType::F32)?;
        let (n, stored_width) = states.dims2().map_err(|_| {
            bad(format!(
                "`states` has shape {:?}, not [rows, width]",
                states.dims()
            ))
        })?;
        if stored_width != width {
            return Err(bad(format!(
                "critic states are {stored_width} wide; this run's env gives {width}"
            )));
        }
        let column = |name: &str| -> Result<Vec<f32>, TrainError> {
            let t = get(name, DType::F32)?;
            if t.dims() != [n] {
                return Err(bad(format!("`{name}` has shape {:?}, not [{n}]", t.dims())));
            }
            Ok(t.to_vec1::<f32>()?)
        };
        let (returns, old_values) = (column("returns")?, column("old_values")?);
        let counts = get("batch_rows", DType::U32)?.to_vec1::<u32>()?;
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        if total != n {
            return Err(bad(format!(
                "`batch_rows` add up to {total} rows; `states` holds {n}"
            )));
        }
        let states = states.flatten_all()?.to_vec1::<f32>()?;
        let mut history = Self::new(capacity, width);
        let mut start = 0;
        for count in counts {
            let end = start + count as usize;
            history.push(StateRows {
                states: states[start * width..end * width].to_vec(),
                returns: returns[start..end].to_vec(),
                old_values: old_values[start..end].to_vec(),
            });
            start = end;
        }
        Ok(history)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(first: f32, n: usize) -> StateRows {
        let values: Vec<f32> = (0..n).map(|i| first + i as f32).collect();
        StateRows {
            states: values.iter().flat_map(|&v| [v, -v]).collect(),
            returns: values.iter().map(|v| v * 10.0).collect(),
            old_values: values.iter().map(|v| v * 0.5).collect(),
        }
    }

    #[test]
    fn the_history_keeps_the_newest_batches_in_order() {
        let mut h = CriticHistory::new(2, 2);
        h.push(batch(0.0, 3));
        h.push(batch(100.0, 1));
        assert_eq!(h.rows().returns, vec![0.0, 10.0, 20.0, 1000.0]);
        h.push(batch(200.0, 2));
        assert_eq!(h.newest_len(), 2);
        let rows = h.rows();
        assert_eq!(rows.returns, vec![1000.0, 2000.0, 2010.0]);
        assert_eq!(
            rows.states,
            vec![100.0, -100.0, 200.0, -200.0, 201.0, -201.0]
        );
        assert_eq!(rows.old_values, vec![50.0, 100.0, 100.5]);
    }

    #[test]
    fn a_saved_history_loads_back_and_a_smaller_capacity_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CHECKPOINT_FILE);
        let mut h = CriticHistory::new(3, 2);
        h.push(batch(0.0, 2));
        h.push(batch(10.0, 0));
        h.push(batch(20.0, 3));
        h.save(&path).unwrap();
        assert_eq!(CriticHistory::load(&path, 3, 2).unwrap(), h);
        let newest = CriticHistory::load(&path, 1, 2).unwrap();
        assert_eq!(newest.rows(), batch(20.0, 3));
        let err = CriticHistory::load(&path, 3, 5).unwrap_err().to_string();
        assert!(
            err.contains(CHECKPOINT_FILE) && err.contains("2 wide"),
            "{err}"
        );
    }

    #[test]
    fn a_history_whose_tensors_disagree_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CHECKPOINT_FILE);
        let device = Device::Cpu;
        let tensors = HashMap::from([
            (
                "states".to_string(),
                Tensor::zeros((3, 2), DType::F32, &device).unwrap(),
            ),
            (
                "returns".to_string(),
                Tensor::zeros(3, DType::F32, &device).unwrap(),
            ),
            (
                "old_values".to_string(),
                Tensor::zeros(3, DType::F32, &device).unwrap(),
            ),
            (
                "batch_rows".to_string(),
                Tensor::new(&[2u32], &device).unwrap(),
            ),
        ]);
        candle_core::safetensors::save(&tensors, &path).unwrap();
        let err = CriticHistory::load(&path, 3, 2).unwrap_err().to_string();
        assert!(err.contains("`batch_rows` add up to 2 rows"), "{err}");
    }
}
