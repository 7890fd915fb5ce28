//! The Python that runs `examples/` (gymnasium, the official `openai` client) for the tests that
//! drive it: `$STEPPPO_PYTHON`, else the venv `scripts/examples_venv.sh` makes. Without one a
//! test skips and says so on the terminal, where plain `cargo test` shows it; with
//! `STEPPPO_REQUIRE_PYTHON=1` (as `.ci/run` sets it) a missing Python fails the test instead.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The examples' Python, or `None` after printing why the caller skips.
pub fn examples_python(test: &str) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("STEPPPO_PYTHON") {
        return Some(path.into());
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/examples-venv/bin/python");
    if venv.exists() {
        return Some(venv);
    }
    let why = "no Python for examples/ (run `bash scripts/examples_venv.sh` or set STEPPPO_PYTHON)";
    if std::env::var_os("STEPPPO_REQUIRE_PYTHON").is_some() {
        panic!("{test}: {why}, and STEPPPO_REQUIRE_PYTHON is set");
    }
    // Straight to the process's stderr: libtest captures `eprintln!` of a passing test.
    let _ = writeln!(std::io::stderr(), "skipped: {test}: {why}");
    None
}
