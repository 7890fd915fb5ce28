//! Rollouts: batched generation and the agent loop. [`sampling`] turns one row of logits into a
//! token and its log-prob; [`grammar`] is the token grammar of a valid turn that constrained
//! decoding samples within; [`engine`] schedules requests over the KV pool and the radix prefix
//! cache, the one generation path (rollouts, `serve`, `stepppo generate`, the benches);
//! [`teacher_forcing`] scores given tokens on the same decode path; [`agent_loop`] drives env sessions and emits step records; [`workload`] holds the
//! synthetic prefix-reuse workloads of the benchmark. Forward passes belong to [`crate::model`],
//! KV storage and the prefix index to [`crate::kv`].

pub mod agent_loop;
pub mod engine;
pub mod grammar;
pub mod sampling;
pub mod teacher_forcing;
pub mod workload;

pub use teacher_forcing::forced_logprobs;
