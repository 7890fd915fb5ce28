//! The Python that runs `examples/` (gymnasium, the official `openai` client, and the env hubs) for
//! the tests that drive it: `$STEPPPO_PYTHON`, else the venv `scripts/examples_venv.sh` makes.
//! Without one (or, for [`hub_python`], without the hub's package) a test skips and says so on the
//! terminal, where plain `cargo test` shows it; with `STEPPPO_REQUIRE_PYTHON=1` (as `.ci/run` sets
//! it) a missing Python or package fails the test instead.

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

/// The examples' Python when it imports `module` (an env hub: `gem`, `textarena`,
/// `textworld`), or `None` after printing why the caller skips.
#[allow(dead_code)] // only the hub tests call it
pub fn hub_python(test: &str, module: &str) -> Option<PathBuf> {
    let python = examples_python(test)?;
    let imports = std::process::Command::new(&python)
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|out| out.status.success());
    if imports {
        return Some(python);
    }
    let why = format!(
        "{} cannot import {module} (run `STEPPPO_EXAMPLES_HUBS=1 bash scripts/examples_venv.sh`)",
        python.display()
    );
    if std::env::var_os("STEPPPO_REQUIRE_PYTHON").is_some() {
        panic!("{test}: {why}, and STEPPPO_REQUIRE_PYTHON is set");
    }
    let _ = writeln!(std::io::stderr(), "skipped: {test}: {why}");
    None
}
