//! Crash points: named places where a fault-injection test can kill the process as a power cut
//! or `kill -9` would, so that "the run directory is consistent after a crash at X" is tested at
//! every X that matters instead of at whatever instant a timer happens to hit.
//!
//! `STEPPPO_CRASH_AT=NAME` (or `NAME@N`) makes the process send itself SIGKILL the first (the
//! N-th) time execution passes the point `NAME`; nothing is flushed, no destructor runs. Unset,
//! the normal case, a crash point costs one atomic load. The names in use are listed in
//! [`POINTS`]; a name outside it is rejected when the variable is read, so a misspelt test cannot
//! pass by never crashing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Environment variable naming the crash point (`NAME` or `NAME@N`).
pub const ENV_VAR: &str = "STEPPPO_CRASH_AT";

/// Every crash point of the code base, in the order a training step passes them.
pub const POINTS: &[&str] = &[
    // The rollout of a step is done; nothing of it is stored yet.
    "train.rollout_done",
    // Half of a step's records are in the dataset file, the other half not.
    "train.store_write",
    // The step's records and its metrics row are written; no checkpoint covers them yet.
    "train.step_logged",
    // A checkpoint's temporary directory holds the policy but not the rest.
    "checkpoint.partial",
    // The checkpoint directory has its final name; `ckpt-latest` still names the previous one.
    "checkpoint.renamed",
    // The checkpoint is complete and `ckpt-latest` names it.
    "checkpoint.committed",
];

struct Armed {
    name: String,
    hit: u64,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let spec = std::env::var(ENV_VAR).ok()?;
            let (name, hit) = match spec.split_once('@') {
                Some((name, n)) => (name, n.parse().unwrap_or(0)),
                None => (spec.as_str(), 1),
            };
            assert!(
                POINTS.contains(&name) && hit >= 1,
                "{ENV_VAR}={spec}: expected NAME or NAME@N (N ≥ 1) with NAME one of {POINTS:?}"
            );
            Some(Armed {
                name: name.to_string(),
                hit,
            })
        })
        .as_ref()
}

/// Whether this pass of `name` is the one `STEPPPO_CRASH_AT` names (counts the passes).
fn fires(name: &str) -> bool {
    static PASSES: AtomicU64 = AtomicU64::new(0);
    match armed() {
        Some(a) if a.name == name => PASSES.fetch_add(1, Ordering::Relaxed) + 1 == a.hit,
        _ => false,
    }
}

/// Kills the process here when `STEPPPO_CRASH_AT` names this pass of `name`.
pub fn point(name: &str) {
    if fires(name) {
        kill_self();
    }
}

/// As [`point`], but runs `before` first when it fires (e.g. to push buffered bytes into the
/// file so the crash leaves a partly written state behind).
pub fn point_after<E>(name: &str, before: impl FnOnce() -> Result<(), E>) {
    if fires(name) {
        // Whatever `before` managed to write is the state under test; its error changes nothing.
        let _ = before();
        kill_self();
    }
}

#[cfg(unix)]
fn kill_self() -> ! {
    // SAFETY: raise() has no memory-safety preconditions; SIGKILL cannot be caught, so the
    // process ends here without unwinding or flushing, as under `kill -9`.
    unsafe {
        libc::raise(libc::SIGKILL);
    }
    unreachable!("SIGKILL ends the process")
}

#[cfg(not(unix))]
fn kill_self() -> ! {
    std::process::abort()
}
