//! Batched generation and the agent loop (issue 5): [`sampling`] turns one row of logits into a
//! token and its log-prob; [`engine`] schedules requests over the KV pool and the radix prefix
//! cache; [`agent_loop`] drives env sessions and emits step records; [`workload`] holds the
//! synthetic prefix-reuse workloads of the benchmark.

pub mod agent_loop;
pub mod engine;
pub mod sampling;
pub mod workload;
