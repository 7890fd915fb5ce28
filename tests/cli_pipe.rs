//! The command line when its reader goes away early (`stepppo replay … | head`): it stops quietly
//! with success instead of printing an error.

use std::io::Read;
use std::process::{Command, Stdio};

fn stepppo() -> Command {
    Command::new(env!("CARGO_BIN_EXE_stepppo"))
}

#[test]
fn replay_into_a_closed_pipe_exits_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let dataset = dir.path().join("random");
    let collect = stepppo()
        .args(["collect", "--env", "frozen_lake", "--agent", "random"])
        .args(["--episodes", "400", "--out"])
        .arg(&dataset)
        .output()
        .unwrap();
    assert!(collect.status.success(), "{collect:?}");

    let mut replay = stepppo()
        .arg("replay")
        .arg(&dataset)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read one chunk (far less than the transcript, which exceeds any pipe buffer), then hang up.
    let mut first = [0u8; 1024];
    let mut stdout = replay.stdout.take().unwrap();
    stdout.read_exact(&mut first).unwrap();
    drop(stdout);
    let output = replay.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "status {:?}, stderr {stderr}",
        output.status
    );
    assert!(stderr.is_empty(), "stderr: {stderr}");
}
