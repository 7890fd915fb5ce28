//! How well step-start values explain a batch's returns: the explained variance of a critic's
//! rollout-time values against the Monte-Carlo step returns over every step row of the batch
//! ([`explained_variance`], the figure a critic is judged by), and its ceiling
//! ([`tabular_ceiling`]): the explained variance reached by a table that predicts each step's
//! return by the mean return of the other steps of its group that started in the same state
//! (GiGPO's anchor states: same `group_id` and `state_hash`). The table reads the other
//! trajectories of the same group, on the same level: where levels recur
//! (`train_env_manager.num_levels`) a critic can learn that much, but on a freshly drawn level
//! the return also depends on what the state does not show (a FrozenLake map's holes beyond the
//! render's summary), and a step-start critic stays below the table. Where returns depend on
//! chance (slippery maps, later random moves) even a perfect critic stays below 1.

use super::loss::explained_variance;
use crate::store::StepRecord;
use std::collections::HashMap;

/// The tabular leave-one-out ceiling of one batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TabularCeiling {
    /// Explained variance of the leave-one-out mean return over the covered rows.
    pub explained_var: f64,
    /// Fraction of rows whose state another row of the same group also started in.
    pub coverage: f64,
}

/// The tabular ceiling for `records` with Monte-Carlo returns `returns` (aligned): for each row
/// whose (group, state) another row shares, the mean return of those other rows is its
/// prediction. `None` when fewer than two rows are covered.
pub fn tabular_ceiling(records: &[StepRecord], returns: &[f64]) -> Option<TabularCeiling> {
    let mut by_state: HashMap<(u64, u64), (f64, usize)> = HashMap::new();
    for (rec, &g) in records.iter().zip(returns) {
        let entry = by_state.entry((rec.group_id, rec.state_hash)).or_default();
        entry.0 += g;
        entry.1 += 1;
    }
    let (mut predicted, mut actual) = (Vec::new(), Vec::new());
    for (rec, &g) in records.iter().zip(returns) {
        let (sum, n) = by_state[&(rec.group_id, rec.state_hash)];
        if n >= 2 {
            predicted.push((sum - g) / (n - 1) as f64);
            actual.push(g);
        }
    }
    (actual.len() >= 2).then(|| TabularCeiling {
        explained_var: explained_variance(&predicted, &actual),
        coverage: actual.len() as f64 / records.len() as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(group_id: u64, state_hash: u64) -> StepRecord {
        StepRecord {
            group_id,
            state_hash,
            ..StepRecord::default()
        }
    }

    #[test]
    fn the_ceiling_predicts_each_row_by_the_other_rows_of_its_state() {
        // Group 0, state 7: returns 1, 3 → predictions 3, 1. Group 0, state 8: returns 2, 2, 5 →
        // predictions 3.5, 3.5, 2. Group 1, state 7 has one row: not covered.
        let records = [
            rec(0, 7),
            rec(0, 7),
            rec(0, 8),
            rec(0, 8),
            rec(0, 8),
            rec(1, 7),
        ];
        let returns = [1.0, 3.0, 2.0, 2.0, 5.0, 9.0];
        let c = tabular_ceiling(&records, &returns).unwrap();
        let actual = [1.0, 3.0, 2.0, 2.0, 5.0];
        let predicted = [3.0, 1.0, 3.5, 3.5, 2.0];
        // EV = 1 − Var(residual)/Var(actual), population variances (mean_std's convention).
        let var = |xs: &[f64]| {
            let m = xs.iter().sum::<f64>() / xs.len() as f64;
            xs.iter().map(|x| (x - m).powi(2)).sum::<f64>()
        };
        let residual: Vec<f64> = actual.iter().zip(&predicted).map(|(a, p)| a - p).collect();
        let want = 1.0 - var(&residual) / var(&actual);
        assert!((c.explained_var - want).abs() < 1e-12, "{c:?} vs {want}");
        assert!((c.coverage - 5.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn a_deterministic_state_value_reaches_a_ceiling_of_one() {
        let records = [rec(0, 1), rec(0, 1), rec(0, 2), rec(0, 2)];
        let c = tabular_ceiling(&records, &[0.5, 0.5, -1.0, -1.0]).unwrap();
        assert!((c.explained_var - 1.0).abs() < 1e-12);
        assert!(tabular_ceiling(&[rec(0, 1), rec(0, 2)], &[1.0, 0.0]).is_none());
    }
}
