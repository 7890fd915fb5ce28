//! Statistics and normalisations shared by the estimators: unbiased mean/std, ROLL reward
//! normalisation per group (with its zero-std rule), StepPO step-row whitening, ROLL token
//! whitening (`masked_whiten`) and clipping. Grouping keys are decided by the estimators.

use std::collections::HashMap;
use std::hash::Hash;

use super::config::NormMethod;

/// ε added to the std in group normalisation (GRPO, ROLL, GiGPO).
pub const GROUP_STD_EPS: f64 = 1e-6;
/// ε of whitening.
pub const WHITEN_EPS: f64 = 1e-8;

/// Mean and unbiased standard deviation (std = 0 for fewer than two values).
pub fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len();
    if n == 0 {
        return (0.0, 0.0);
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, var.sqrt())
}

/// Normalises one group's values in place by `method`, ROLL semantics: under `mean_std` /
/// `asym_clip`, a group with ≤ 1 member or std ≤ 1e-6 becomes all zeros; else
/// (x − mean)/(std + 1e-6). `mean` subtracts the mean; `identity` leaves the values.
pub fn normalize_group(values: &mut [f64], method: NormMethod) {
    let (mean, std) = mean_std(values);
    match method {
        NormMethod::Identity => {}
        NormMethod::Mean => values.iter_mut().for_each(|v| *v -= mean),
        NormMethod::MeanStd | NormMethod::AsymClip => {
            if values.len() <= 1 || std <= GROUP_STD_EPS {
                values.iter_mut().for_each(|v| *v = 0.0);
            } else {
                values
                    .iter_mut()
                    .for_each(|v| *v = (*v - mean) / (std + GROUP_STD_EPS));
            }
        }
    }
}

/// Normalises `values[i]` within the groups given by `keys[i]`; returns the group sizes.
pub fn normalize_by_key<K: Hash + Eq + Copy>(
    values: &mut [f64],
    keys: &[K],
    method: NormMethod,
) -> Vec<usize> {
    let mut members: HashMap<K, Vec<usize>> = HashMap::new();
    let mut order = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        members
            .entry(*k)
            .or_insert_with(|| {
                order.push(*k);
                Vec::new()
            })
            .push(i);
    }
    let mut sizes = Vec::with_capacity(order.len());
    let mut group = Vec::new();
    for k in order {
        let idx = &members[&k];
        group.clear();
        group.extend(idx.iter().map(|&i| values[i]));
        normalize_group(&mut group, method);
        for (&i, &v) in idx.iter().zip(&group) {
            values[i] = v;
        }
        sizes.push(idx.len());
    }
    sizes
}

/// StepPO step-row whitening: (x − mean)/(std + 1e-8), unweighted; unchanged for ≤ 1 value.
pub fn whiten_rows(values: &mut [f64]) {
    if values.len() <= 1 {
        return;
    }
    let (mean, std) = mean_std(values);
    values
        .iter_mut()
        .for_each(|v| *v = (*v - mean) / (std + WHITEN_EPS));
}

/// ROLL `masked_whiten` over tokens: token-weighted mean, unbiased variance,
/// (x − mean)·rsqrt(var + 1e-8); unchanged when there is at most one token.
pub fn whiten_tokens(rows: &mut [Vec<f64>]) {
    let flat: Vec<f64> = rows.iter().flatten().copied().collect();
    if let Some((mean, scale)) = token_whitening_map(&flat) {
        rows.iter_mut()
            .flatten()
            .for_each(|v| *v = (*v - mean) * scale);
    }
}

/// (mean, 1/sqrt(var + 1e-8)) of `masked_whiten` over `tokens`; `None` for ≤ 1 token.
pub fn token_whitening_map(tokens: &[f64]) -> Option<(f64, f64)> {
    if tokens.len() <= 1 {
        return None;
    }
    let (mean, std) = mean_std(tokens);
    Some((mean, 1.0 / (std * std + WHITEN_EPS).sqrt()))
}

/// Clamps every value to ±c; returns how many were changed.
pub fn clip_abs<'a>(values: impl IntoIterator<Item = &'a mut f64>, c: f64) -> usize {
    let mut clipped = 0;
    for v in values {
        if v.abs() > c {
            *v = v.clamp(-c, c);
            clipped += 1;
        }
    }
    clipped
}

/// Discounted reward-to-go G_t = Σ_{k≥t} γ^{k−t} r_k of an ordered sequence.
pub fn discounted_returns(rewards: &[f64], gamma: f64) -> Vec<f64> {
    let mut out = vec![0.0; rewards.len()];
    let mut acc = 0.0;
    for (o, r) in out.iter_mut().zip(rewards).rev() {
        acc = r + gamma * acc;
        *o = acc;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unbiased_std() {
        // values 1, 2, 3, 4: mean 2.5, sample variance (2.25+0.25+0.25+2.25)/3 = 5/3
        let (m, s) = mean_std(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m, 2.5);
        assert!((s - (5.0f64 / 3.0).sqrt()).abs() < 1e-12);
    }

    #[test]
    fn zero_std_and_singleton_groups_become_zero_under_mean_std() {
        let mut v = [0.7, 0.7, 0.7];
        normalize_group(&mut v, NormMethod::MeanStd);
        assert_eq!(v, [0.0; 3]);
        let mut one = [5.0];
        normalize_group(&mut one, NormMethod::MeanStd);
        assert_eq!(one, [0.0]);
        let mut one = [5.0];
        normalize_group(&mut one, NormMethod::Identity);
        assert_eq!(one, [5.0]);
    }

    #[test]
    fn group_normalisation_by_key() {
        // group a: 1, 3 → mean 2, std sqrt(2) → ±1/(sqrt2+1e-6); group b: 4, 6 under `mean` would differ
        let mut v = [1.0, 4.0, 3.0, 4.0];
        let sizes = normalize_by_key(&mut v, &['a', 'b', 'a', 'b'], NormMethod::MeanStd);
        assert_eq!(sizes, vec![2, 2]);
        let e = 1.0 / (2f64.sqrt() + 1e-6);
        assert!((v[0] + e).abs() < 1e-12 && (v[2] - e).abs() < 1e-12);
        assert_eq!((v[1], v[3]), (0.0, 0.0));
    }

    #[test]
    fn token_whitening_is_token_weighted() {
        // tokens 0, 0, 3 (one row of two, one of one): mean 1, var (1+1+4)/2 = 3
        let mut rows = vec![vec![0.0, 0.0], vec![3.0]];
        whiten_tokens(&mut rows);
        let s = 1.0 / (3.0f64 + 1e-8).sqrt();
        assert!((rows[0][0] + s).abs() < 1e-12 && (rows[1][0] - 2.0 * s).abs() < 1e-12);
    }

    #[test]
    fn discounting() {
        let g = discounted_returns(&[0.0, 1.0, 2.0], 0.5);
        assert_eq!(g, vec![1.0, 2.0, 2.0]);
    }
}
