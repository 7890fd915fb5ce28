//! Token sampling from one row of logits: greedy, or temperature with optional top-k and top-p
//! truncation, drawing from a caller-owned RNG. The returned log-prob is the token's under the
//! temperature-scaled, *untruncated* distribution — the quantity the training path recomputes
//! (`Model::logprobs_entropy_at` with the same temperature), so PPO ratios start at 1. Under a
//! response grammar ([`sample_allowed`]) the distribution is renormalised over the allowed tokens,
//! as the update renormalises it.

use rand::Rng;

use crate::rollout::grammar::Allowed;

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// Logits are divided by this; ≤ 0 or non-finite behaves as greedy.
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens whose mass reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Take the most likely token; its log-prob is reported at temperature 1.
    pub greedy: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            greedy: false,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            greedy: true,
            ..Self::default()
        }
    }

    /// The temperature the returned log-probs are computed under (1 for greedy).
    pub fn logprob_temperature(&self) -> f32 {
        if self.is_greedy() {
            1.0
        } else {
            self.temperature
        }
    }

    fn is_greedy(&self) -> bool {
        self.greedy || !(self.temperature.is_finite() && self.temperature > 0.0)
    }
}

/// Samples a token from `logits` and returns it with its log-prob under the temperature-scaled
/// distribution. Empty logits give token 0 with log-prob −∞.
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut impl Rng) -> (u32, f32) {
    let logp = log_softmax(logits, params.logprob_temperature());
    if logp.is_empty() {
        return (0, f32::NEG_INFINITY);
    }
    let token = if params.is_greedy() {
        argmax(&logp)
    } else {
        draw(&logp, params, rng)
    };
    (token as u32, logp[token] as f32)
}

/// [`sample`] restricted to the `allowed` tokens (all when `None`): the distribution and the
/// returned log-prob are renormalised over them, so a forced token has log-prob 0. An empty
/// allowed set falls back to the whole vocabulary.
pub fn sample_allowed(
    logits: &[f32],
    allowed: Option<&Allowed>,
    params: &SamplingParams,
    rng: &mut impl Rng,
) -> (u32, f32) {
    let candidates = allowed.map(|a| a.ids(logits.len())).unwrap_or_default();
    if candidates.is_empty() {
        return sample(logits, params, rng);
    }
    let sub: Vec<f32> = candidates.iter().map(|&t| logits[t as usize]).collect();
    let (i, logprob) = sample(&sub, params, rng);
    (candidates[i as usize], logprob)
}

/// `log_softmax(logits / temperature)` in f64; NaN logits count as −∞.
pub(crate) fn log_softmax(logits: &[f32], temperature: f32) -> Vec<f64> {
    let t = f64::from(temperature);
    let scaled: Vec<f64> = logits
        .iter()
        .map(|&x| {
            if x.is_nan() {
                f64::NEG_INFINITY
            } else {
                f64::from(x) / t
            }
        })
        .collect();
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !max.is_finite() {
        let uniform = -(scaled.len() as f64).ln();
        return vec![uniform; scaled.len()];
    }
    let log_z = max + scaled.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    scaled.iter().map(|x| x - log_z).collect()
}

/// Index of the largest entry (the first on ties).
fn argmax(v: &[f64]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |best, (i, x)| if *x > v[best] { i } else { best })
}

/// Draws from the distribution `exp(logp)` after top-k / top-p truncation.
fn draw(logp: &[f64], params: &SamplingParams, rng: &mut impl Rng) -> usize {
    let truncate = params.top_k > 0 || params.top_p < 1.0;
    let candidates: Vec<usize> = if truncate {
        truncated(logp, params)
    } else {
        (0..logp.len()).collect()
    };
    let mass: f64 = candidates.iter().map(|&i| logp[i].exp()).sum();
    let mut r = rng.random::<f64>() * mass;
    for &i in &candidates {
        r -= logp[i].exp();
        if r < 0.0 {
            return i;
        }
    }
    *candidates.last().expect("at least one candidate")
}

/// The most likely tokens kept by top-k then top-p, most likely first (at least one).
fn truncated(logp: &[f64], params: &SamplingParams) -> Vec<usize> {
    let mut order: Vec<usize> = (0..logp.len()).collect();
    order.sort_by(|&a, &b| logp[b].total_cmp(&logp[a]).then(a.cmp(&b)));
    if params.top_k > 0 {
        order.truncate(params.top_k);
    }
    if params.top_p < 1.0 {
        let mut cumulative = 0.0;
        let keep = order
            .iter()
            .position(|&i| {
                cumulative += logp[i].exp();
                cumulative >= f64::from(params.top_p)
            })
            .map_or(order.len(), |last| last + 1);
        order.truncate(keep.max(1));
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn greedy_takes_the_argmax_with_its_temperature_one_logprob() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let (tok, lp) = sample(&[0.0, 2.0, 1.0], &SamplingParams::greedy(), &mut rng);
        assert_eq!(tok, 1);
        let z = (0f32.exp() + 2f32.exp() + 1f32.exp()).ln();
        assert!((lp - (2.0 - z)).abs() < 1e-6);
    }

    #[test]
    fn top_k_one_is_greedy_but_reports_the_scaled_logprob() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let params = SamplingParams {
            temperature: 0.5,
            top_k: 1,
            ..SamplingParams::default()
        };
        let (tok, lp) = sample(&[0.0, 2.0, 1.0], &params, &mut rng);
        assert_eq!(tok, 1);
        let z = (0f32.exp() + 4f32.exp() + 2f32.exp()).ln();
        assert!((lp - (4.0 - z)).abs() < 1e-6);
    }

    #[test]
    fn top_p_excludes_the_tail_and_sampling_follows_the_distribution() {
        let logits = [3.0f32, 2.0, -5.0];
        let params = SamplingParams {
            top_p: 0.9,
            ..SamplingParams::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let mut counts = [0usize; 3];
        for _ in 0..4000 {
            counts[sample(&logits, &params, &mut rng).0 as usize] += 1;
        }
        assert_eq!(counts[2], 0);
        let p0 = 3f64.exp() / (3f64.exp() + 2f64.exp());
        assert!((counts[0] as f64 / 4000.0 - p0).abs() < 0.03, "{counts:?}");
    }

    #[test]
    fn allowed_tokens_are_sampled_from_the_renormalised_distribution() {
        let logits = [5.0f32, 0.0, 1.0, 0.0];
        let allowed = Allowed::Only(vec![1, 2]);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut counts = [0usize; 4];
        for _ in 0..2000 {
            let (tok, lp) = sample_allowed(
                &logits,
                Some(&allowed),
                &SamplingParams::default(),
                &mut rng,
            );
            let z = (0f32.exp() + 1f32.exp()).ln();
            assert!((lp - (logits[tok as usize] - z)).abs() < 1e-6);
            counts[tok as usize] += 1;
        }
        assert_eq!(counts[0] + counts[3], 0);
        let p2 = 1f64.exp() / (1.0 + 1f64.exp());
        assert!((counts[2] as f64 / 2000.0 - p2).abs() < 0.04, "{counts:?}");
        let forced = Allowed::Only(vec![3]);
        assert_eq!(
            sample_allowed(&logits, Some(&forced), &SamplingParams::greedy(), &mut rng),
            (3, 0.0)
        );
        let greedy = sample_allowed(
            &logits,
            Some(&Allowed::AllBut(vec![0])),
            &SamplingParams::greedy(),
            &mut rng,
        );
        assert_eq!(greedy.0, 2);
    }

    #[test]
    fn same_seed_same_tokens_and_bad_logits_do_not_panic() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let run = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..20)
                .map(|_| sample(&logits, &SamplingParams::default(), &mut rng).0)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(sample(&[], &SamplingParams::default(), &mut rng).0, 0);
        let (tok, _) = sample(&[f32::NAN, f32::NAN], &SamplingParams::default(), &mut rng);
        assert!(tok < 2);
    }
}
