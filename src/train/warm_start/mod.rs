//! The warm start: what a run does to its policy before RL. The policy a fresh run starts from
//! and its LoRA adapters (`setup`, which also builds the device and the rollout engine for the
//! rooms above), the copy pretraining of the built-in model ([`copy_pretrain`]) and behaviour
//! cloning on agent transcripts ([`sft`]). It uses the learner's batching; it knows nothing of the
//! run loop.

pub mod copy_pretrain;
pub(crate) mod setup;
pub mod sft;
