//! `stepppo bench prefix --json`: one object per workload and arm with the documented keys.

use std::process::Command;

#[test]
fn bench_prefix_json_reports_every_arm() {
    let out = Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args([
            "bench",
            "prefix",
            "--json",
            "--model",
            "tiny",
            "--workload",
            "frozen_lake",
        ])
        .output()
        .expect("runs the binary");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let arms: Vec<&str> = rows.iter().map(|r| r["arm"].as_str().unwrap()).collect();
    assert_eq!(
        arms,
        [
            "none",
            "per_traj",
            "group_prompt",
            "radix",
            "radix_no_cascade"
        ]
    );
    for key in [
        "workload",
        "groups",
        "group_size",
        "turns",
        "tokens_prefilled",
        "tokens_from_cache",
        "theoretical_min",
        "stateless_total",
        "wall_s",
    ] {
        assert!(rows.iter().all(|r| !r[key].is_null()), "missing `{key}`");
    }
    let prefilled = |i: usize| rows[i]["tokens_prefilled"].as_u64().unwrap();
    assert_eq!(prefilled(0), rows[0]["stateless_total"].as_u64().unwrap());
    assert!(prefilled(3) < prefilled(1) && prefilled(3) < prefilled(2));
}

#[test]
fn bench_prefix_names_an_unknown_workload() {
    let out = Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(["bench", "prefix", "--workload", "chess"])
        .output()
        .expect("runs the binary");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("chess"));
}
