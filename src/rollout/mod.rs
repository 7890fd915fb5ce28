//! Batched generation and the agent loop (issue 5).
