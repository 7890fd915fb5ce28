//! The learner: one update of the actor and the critic on a batch of step records. Packing
//! records into training sequences ([`batch`]), their device tensors (`device_batch`), padded or
//! as a prefix tree ([`prefix_tree`]), constrained-decoding masks on the update side ([`masks`]),
//! forward passes without a gradient ([`scoring`]: reference log-probs, rollout-time values), the
//! PPO update ([`update`]) and the optimizer step it shares with the critic's fit
//! (`optimizer_step`), the critic beside the policy ([`critic`]), self-imitation replay
//! ([`self_imitation`]), the split of a mini-batch over data-parallel ranks (`ranks`) and the
//! memory plan of a run ([`memory_plan`]). It runs no env and writes no run directory.

pub mod batch;
pub mod critic;
pub(crate) mod device_batch;
pub mod masks;
pub mod memory_plan;
pub(crate) mod nll;
pub mod optimizer_step;
pub mod prefix_tree;
pub(crate) mod ranks;
pub mod scoring;
pub mod self_imitation;
pub mod update;
