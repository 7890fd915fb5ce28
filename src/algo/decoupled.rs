//! Decoupled PPO (AReaL, arXiv 2505.24298): the correction of an update on responses that an
//! older policy version generated. The clipped ratio is taken against the *proximal* policy (the
//! policy as the update starts) instead of the behaviour policy that sampled, and each token's
//! loss is weighted by π_prox / π_behav, truncated at a cap. Since the weight is ≥ 0 it factors
//! out of the clipped surrogate's max, so it is applied as a factor on each token's advantage.
//! Host-side, per record and response token; the losses themselves are [`super::loss`]'s.

/// Proximal log-probs and truncated behaviour weights, per record and response token.
#[derive(Clone, Debug, PartialEq)]
pub struct ProximalCorrection {
    /// log π_prox of every response token: the clipped ratio's denominator.
    pub logprobs: Vec<Vec<f32>>,
    /// min(π_prox / π_behav, cap) of every response token.
    pub weights: Vec<Vec<f32>>,
}

/// Means of the weights before and after truncation and the truncated share.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WeightStats {
    /// Mean weight over all response tokens, after truncation.
    pub mean: f64,
    /// Largest weight after truncation (at most the cap).
    pub max: f64,
    /// Share of tokens whose weight was above the cap.
    pub truncated: f64,
}

impl ProximalCorrection {
    /// The correction of responses sampled with `behaviour` log-probs, given their `proximal`
    /// log-probs (same shapes), with weights truncated at `cap`.
    pub fn new(proximal: Vec<Vec<f32>>, behaviour: &[Vec<f32>], cap: f64) -> Self {
        let weights = proximal
            .iter()
            .zip(behaviour)
            .map(|(p, b)| {
                assert_eq!(p.len(), b.len(), "one log-prob per response token");
                p.iter()
                    .zip(b)
                    .map(|(&p, &b)| ((p - b) as f64).exp().min(cap) as f32)
                    .collect()
            })
            .collect();
        Self {
            logprobs: proximal,
            weights,
        }
    }

    /// Statistics of the weights over every token (`cap` as given to [`Self::new`]).
    pub fn stats(&self, cap: f64) -> WeightStats {
        let all: Vec<f64> = self.weights.iter().flatten().map(|&w| w as f64).collect();
        if all.is_empty() {
            return WeightStats::default();
        }
        let n = all.len() as f64;
        WeightStats {
            mean: all.iter().sum::<f64>() / n,
            max: all.iter().copied().fold(f64::MIN, f64::max),
            truncated: all.iter().filter(|&&w| w >= cap as f32 as f64).count() as f64 / n,
        }
    }

    /// `advantages` (per record and token) times each token's weight.
    pub fn weighted_advantages(&self, advantages: &[Vec<f32>]) -> Vec<Vec<f32>> {
        advantages
            .iter()
            .zip(&self.weights)
            .map(|(a, w)| {
                assert_eq!(a.len(), w.len(), "one advantage per response token");
                a.iter().zip(w).map(|(a, w)| a * w).collect()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_are_the_probability_ratio_truncated_at_the_cap() {
        let behaviour = vec![vec![(0.5f32).ln(), (0.25f32).ln()], vec![(0.1f32).ln()]];
        // π_prox: 0.5 (weight 1), 0.375 (1.5), 0.9 (9 → capped at 2).
        let proximal = vec![vec![(0.5f32).ln(), (0.375f32).ln()], vec![(0.9f32).ln()]];
        let c = ProximalCorrection::new(proximal.clone(), &behaviour, 2.0);
        assert_eq!(c.logprobs, proximal);
        let w: Vec<f32> = c.weights.iter().flatten().copied().collect();
        for (got, want) in w.iter().zip([1.0, 1.5, 2.0]) {
            assert!((got - want).abs() < 1e-5, "{w:?}");
        }
        let s = c.stats(2.0);
        assert!((s.mean - 4.5 / 3.0).abs() < 1e-5);
        assert!((s.max - 2.0).abs() < 1e-6);
        assert!((s.truncated - 1.0 / 3.0).abs() < 1e-9);
        let adv = c.weighted_advantages(&[vec![-1.0, 2.0], vec![0.5]]);
        assert!((adv[0][0] + 1.0).abs() < 1e-5 && (adv[0][1] - 3.0).abs() < 1e-5);
        assert!((adv[1][0] - 1.0).abs() < 1e-5);
    }

    #[test]
    fn on_policy_responses_keep_their_advantages() {
        let lp = vec![vec![-0.3f32, -1.2, 0.0]];
        let c = ProximalCorrection::new(lp.clone(), &lp, 2.0);
        assert_eq!(c.weights, vec![vec![1.0; 3]]);
        assert_eq!(
            c.weighted_advantages(&[vec![0.4, -0.2, 1.0]]),
            vec![vec![0.4, -0.2, 1.0]]
        );
        assert_eq!(c.stats(2.0).truncated, 0.0);
    }
}
