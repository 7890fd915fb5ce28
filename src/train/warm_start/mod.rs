//! The warm start: what a run does to its policy before RL. The policy a fresh run starts from
//! and its LoRA adapters (`setup`, which also builds the device and the rollout engine for the
//! rooms above), the copy pretraining of the built-in model ([`copy_pretrain`]) and behaviour
//! cloning on agent transcripts ([`sft`]). It uses the learner's batching; it knows nothing of the
//! run loop.

pub mod copy_pretrain;
pub(crate) mod setup;
pub mod sft;

/// Means of the first and the last few (up to 10) of `xs`: where a loss curve starts and ends.
pub fn first_and_final(xs: &[f64]) -> (f64, f64) {
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    let k = (xs.len() / 2).clamp(1, 10).min(xs.len());
    (mean(&xs[..k]), mean(&xs[xs.len() - k..]))
}
