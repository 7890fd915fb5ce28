//! The run: the training loop ([`trainer`]) and what it writes. Generation ahead of the loop on
//! its own thread ([`async_rollout`]), validation ([`eval`]), checkpoints ([`checkpoint`]), the
//! run directory's consistency across crashes ([`run_dir`]), metric sinks ([`metrics`]: JSONL and
//! TensorBoard), the per-step credit log ([`credit_log`]), learning-curve plots ([`plot`]),
//! collapse warnings ([`collapse`]), the progress bar ([`progress`]) and gateway training mode
//! ([`gateway`]). It drives the warm start and the learner; nothing below uses it.

pub mod async_rollout;
pub mod checkpoint;
pub mod collapse;
pub mod credit_log;
pub mod eval;
pub mod gateway;
pub mod metrics;
pub mod plot;
pub mod progress;
pub mod run_dir;
pub mod trainer;
