//! Early-warning detectors for RL collapse (RAGEN's Echo Trap signals) and degenerate batches:
//! in-group reward std collapsing, token entropy collapsing, gradient-norm spikes, and all-zero
//! advantages. The detector reads the per-step metrics the trainer already logs and returns
//! human-readable warnings; it never changes the run.

use crate::train::Scalars;

/// Metric names the detector reads. This one: the mean over groups of the in-group reward std.
pub const IN_GROUP_STD: &str = "rollout/in_group_reward_std";
/// Metric the detector reads: the actor's mean token entropy.
pub const ENTROPY: &str = "actor/entropy";
/// Metric the detector reads: the actor's global gradient norm before clipping.
pub const GRAD_NORM: &str = "actor/grad_norm";
/// Metric the detector reads: the fraction of step rows with zero advantage.
pub const ZERO_ADV_FRAC: &str = "advantage/zero_fraction";

/// Smoothing of the exponential moving averages (weight of the newest value).
const EMA_ALPHA: f64 = 0.3;
/// A smoothed signal below this fraction of its peak counts as collapsed.
const COLLAPSE_FRACTION: f64 = 0.1;
/// A gradient norm above this multiple of its running average counts as a spike.
const SPIKE_FACTOR: f64 = 5.0;
/// Observations before spike detection starts (the average needs a few values).
const WARMUP: usize = 3;
/// A spike must also exceed SPIKE_FACTOR × this fraction of the run's peak average: once a policy
/// saturates its gradients shrink a hundredfold, and a relative test alone fires on harmless updates.
const SPIKE_FLOOR_OF_PEAK: f64 = 0.1;

/// A warning raised at one step.
#[derive(Clone, Debug, PartialEq)]
pub enum Warning {
    /// The smoothed in-group reward std fell below a tenth of its peak.
    RewardStdCollapse {
        /// Highest smoothed std seen.
        peak: f64,
        /// Smoothed std now.
        now: f64,
    },
    /// The smoothed token entropy fell below a tenth of its peak.
    EntropyCollapse {
        /// Highest smoothed entropy seen.
        peak: f64,
        /// Smoothed entropy now.
        now: f64,
    },
    /// The gradient norm exceeded five times its running average (or a tenth of the peak
    /// average, if larger).
    GradNormSpike {
        /// This step's gradient norm.
        norm: f64,
        /// Exponential moving average of earlier steps' norms.
        average: f64,
    },
    /// Practically every step row (≥ 99.9%) has zero advantage.
    ZeroAdvantages {
        /// Fraction of step rows with zero advantage.
        frac: f64,
    },
}

impl std::fmt::Display for Warning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Warning::RewardStdCollapse { peak, now } => write!(
                f,
                "in-group reward std collapsed ({now:.4} vs peak {peak:.4}): groups no longer disagree, little signal left (Echo Trap warning)"
            ),
            Warning::EntropyCollapse { peak, now } => write!(
                f,
                "token entropy collapsed ({now:.4} vs peak {peak:.4}): the policy became near-deterministic"
            ),
            Warning::GradNormSpike { norm, average } => write!(
                f,
                "gradient-norm spike ({norm:.3} vs running average {average:.3}): a sign of irreversible collapse"
            ),
            Warning::ZeroAdvantages { frac } => write!(
                f,
                "{:.1}% of step rows have zero advantage: this batch carries no policy gradient",
                frac * 100.0
            ),
        }
    }
}

/// Tracks a smoothed signal and its peak; reports once when it falls below a fraction of the peak.
#[derive(Default)]
struct CollapseTracker {
    ema: Option<f64>,
    peak: f64,
    reported: bool,
}

impl CollapseTracker {
    /// Returns (peak, now) the first time the EMA drops under COLLAPSE_FRACTION × peak.
    fn observe(&mut self, x: f64, min_peak: f64) -> Option<(f64, f64)> {
        let ema = self.ema.map_or(x, |e| e + EMA_ALPHA * (x - e));
        self.ema = Some(ema);
        self.peak = self.peak.max(ema);
        let collapsed = self.peak > min_peak && ema < COLLAPSE_FRACTION * self.peak;
        if collapsed && !self.reported {
            self.reported = true;
            return Some((self.peak, ema));
        }
        if !collapsed {
            self.reported = false;
        }
        None
    }
}

/// The per-run detector state.
#[derive(Default)]
pub struct CollapseDetector {
    reward_std: CollapseTracker,
    entropy: CollapseTracker,
    grad_norm_ema: Option<f64>,
    grad_norm_peak: f64,
    grad_norm_seen: usize,
}

impl CollapseDetector {
    /// A detector that has seen no step.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads one step's metrics and returns the warnings it raises.
    pub fn observe(&mut self, scalars: &Scalars) -> Vec<Warning> {
        let mut warnings = Vec::new();
        let get = |k: &str| scalars.get(k).copied().filter(|v| v.is_finite());
        if let Some(std) = get(IN_GROUP_STD) {
            if let Some((peak, now)) = self.reward_std.observe(std, 0.05) {
                warnings.push(Warning::RewardStdCollapse { peak, now });
            }
        }
        if let Some(h) = get(ENTROPY) {
            if let Some((peak, now)) = self.entropy.observe(h, 0.05) {
                warnings.push(Warning::EntropyCollapse { peak, now });
            }
        }
        if let Some(norm) = get(GRAD_NORM) {
            if let Some(avg) = self.grad_norm_ema.filter(|_| self.grad_norm_seen >= WARMUP) {
                let baseline = avg.max(SPIKE_FLOOR_OF_PEAK * self.grad_norm_peak);
                if norm > SPIKE_FACTOR * baseline && norm > 1e-3 {
                    warnings.push(Warning::GradNormSpike { norm, average: avg });
                }
            }
            let ema = self
                .grad_norm_ema
                .map_or(norm, |e| e + EMA_ALPHA * (norm - e));
            self.grad_norm_ema = Some(ema);
            self.grad_norm_peak = self.grad_norm_peak.max(ema);
            self.grad_norm_seen += 1;
        }
        if let Some(frac) = get(ZERO_ADV_FRAC) {
            if frac >= 0.999 {
                warnings.push(Warning::ZeroAdvantages { frac });
            }
        }
        warnings
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(pairs: &[(&str, f64)]) -> Scalars {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn reward_std_collapse_is_reported_once() {
        let mut d = CollapseDetector::new();
        let mut raised = 0;
        for i in 0..30 {
            let std = if i < 5 { 0.5 } else { 0.0 };
            raised += d
                .observe(&step(&[(IN_GROUP_STD, std)]))
                .iter()
                .filter(|w| matches!(w, Warning::RewardStdCollapse { .. }))
                .count();
        }
        assert_eq!(raised, 1);
    }

    #[test]
    fn steady_signals_raise_nothing() {
        let mut d = CollapseDetector::new();
        for _ in 0..20 {
            let w = d.observe(&step(&[
                (IN_GROUP_STD, 0.4),
                (ENTROPY, 1.2),
                (GRAD_NORM, 0.8),
                (ZERO_ADV_FRAC, 0.1),
            ]));
            assert!(w.is_empty(), "{w:?}");
        }
    }

    #[test]
    fn entropy_collapse_grad_spike_and_zero_advantages() {
        let mut d = CollapseDetector::new();
        for _ in 0..5 {
            d.observe(&step(&[(ENTROPY, 2.0), (GRAD_NORM, 1.0)]));
        }
        let w = d.observe(&step(&[(GRAD_NORM, 20.0), (ZERO_ADV_FRAC, 1.0)]));
        assert!(w.iter().any(|w| matches!(w, Warning::GradNormSpike { .. })));
        assert!(w
            .iter()
            .any(|w| matches!(w, Warning::ZeroAdvantages { .. })));
        let collapsed = (0..20).any(|_| {
            d.observe(&step(&[(ENTROPY, 0.01)]))
                .iter()
                .any(|w| matches!(w, Warning::EntropyCollapse { .. }))
        });
        assert!(collapsed);
    }

    #[test]
    fn a_saturated_policy_s_small_gradients_are_no_spike_but_a_large_one_is() {
        let mut d = CollapseDetector::new();
        let spike = |w: Vec<Warning>| w.iter().any(|w| matches!(w, Warning::GradNormSpike { .. }));
        for _ in 0..10 {
            assert!(!spike(d.observe(&step(&[(GRAD_NORM, 1.0)]))));
        }
        for _ in 0..30 {
            assert!(!spike(d.observe(&step(&[(GRAD_NORM, 0.002)]))));
        }
        assert!(!spike(d.observe(&step(&[(GRAD_NORM, 0.2)]))));
        assert!(spike(d.observe(&step(&[(GRAD_NORM, 3.0)]))));
    }
}
