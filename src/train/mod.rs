//! The training loop, checkpoints, metrics and evaluation (issue 7).
