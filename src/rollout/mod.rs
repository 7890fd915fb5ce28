//! Batched generation and the agent loop (issue 5). [`sampling`] turns one row of logits into a
//! token and its log-prob.

pub mod engine;
pub mod sampling;
pub mod workload;
