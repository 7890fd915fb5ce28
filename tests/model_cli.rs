//! `stepppo init-model`, `stepppo generate`, `stepppo score` and `stepppo plan` through the
//! binary.

use std::path::Path;
use std::process::Command;

fn stepppo(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(args)
        .output()
        .unwrap()
}

fn json_of(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn init_model_then_generate_from_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("m");
    let out = stepppo(&[
        "init-model",
        "--config",
        "tiny",
        "--out",
        out_dir.to_str().unwrap(),
        "--seed",
        "3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(out_dir.join(f).exists(), "{f}");
    }
    let args = [
        "generate",
        "--model",
        out_dir.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "5",
    ];
    let sampled = [
        &args[..],
        &[
            "--temperature",
            "0.8",
            "--top-k",
            "50",
            "--seed",
            "9",
            "--json",
        ],
    ]
    .concat();
    let a = json_of(&stepppo(&sampled));
    let b = json_of(&stepppo(&sampled));
    assert_eq!(a, b, "same seed, same output");
    assert_eq!(a["prompt_ids"], serde_json::json!([1, 2, 3]));
    let ids = a["output_ids"].as_array().unwrap();
    assert!(!ids.is_empty() && ids.len() <= 5);
    assert_eq!(a["logprobs"].as_array().unwrap().len(), ids.len());
    assert!(a["output_text"].is_string());

    let greedy = json_of(&stepppo(&[&args[..], &["--greedy", "--json"]].concat()));
    assert!(greedy["logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|l| l.as_f64().unwrap() < 0.0));
}

#[test]
fn score_gives_the_logprobs_generate_sampled_at_temperature_one() {
    let sampled = json_of(&stepppo(&[
        "generate",
        "--prompt-ids",
        "5,6,7,8",
        "--max-new-tokens",
        "12",
        "--seed",
        "4",
        "--json",
    ]));
    let ids: Vec<String> = sampled["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    assert!(!ids.is_empty());
    let scored = json_of(&stepppo(&[
        "score",
        "--prompt-ids",
        "5,6,7,8",
        "--ids",
        &ids.join(","),
        "--json",
    ]));
    let floats = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let (want, got) = (floats(&sampled["logprobs"]), floats(&scored["logprobs"]));
    assert_eq!(want.len(), got.len());
    for (w, g) in want.iter().zip(&got) {
        assert!((w - g).abs() <= 1e-5, "generate {w} vs score {g}");
    }
    let sum = scored["sum_logprob"].as_f64().unwrap();
    assert!((sum - got.iter().sum::<f64>()).abs() < 1e-4 && sum < 0.0);
    let out = stepppo(&["score", "--prompt-ids", "1", "--ids", "999999"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("999999"), "{err}");
}

#[test]
fn builtin_generates_from_text_and_bad_flags_fail() {
    let out = json_of(&stepppo(&[
        "generate",
        "--prompt",
        "Turn 1:",
        "--max-new-tokens",
        "3",
        "--greedy",
        "--json",
    ]));
    let prompt = out["prompt_ids"].as_array().unwrap();
    assert!(prompt.len() > 3, "chat template wraps the prompt");
    let out = stepppo(&["generate", "--prompt", "x", "--temperature", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--temperature"));
    // flash-attention's prefill runs on CUDA only: refused by name on the CPU.
    let out = stepppo(&["generate", "--prompt", "x", "--prefill-attention", "flash"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--prefill-attention") && err.contains("flash"),
        "{err}"
    );
    let out = stepppo(&["generate", "--model", "/nonexistent/dir", "--prompt", "x"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/dir"));
    let out = stepppo(&[
        "init-model",
        "--config",
        "/nonexistent/config.json",
        "--out",
        "/tmp/never",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/config.json"));
}

#[test]
fn plan_prints_each_part_and_lora_shrinks_the_peak() {
    let peak = |extra: &[&str]| -> f64 {
        let mut args = vec![
            "plan",
            "--model",
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/configs/models/qwen2.5-0.5b.json"
            ),
            "--batch-tokens",
            "512",
            "--memory-gib",
            "12",
        ];
        args.extend_from_slice(extra);
        let out = stepppo(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        for part in [
            "weights (494032768 parameters",
            "gradients",
            "optimizer",
            "activations",
        ] {
            assert!(text.contains(part), "{part}: {text}");
        }
        assert!(text.contains("largest forward that fits"), "{text}");
        let line = text
            .lines()
            .find(|l| l.contains("peak of an update"))
            .unwrap();
        line.split("**")
            .nth(3)
            .unwrap()
            .trim_end_matches(" GiB")
            .parse()
            .unwrap()
    };
    let (full, lora) = (peak(&[]), peak(&["--lora-rank", "16"]));
    assert!(full > 8.0 && full < 10.0, "{full}");
    assert!(lora < 0.75 * full, "{lora} vs {full}");
    let bad = stepppo(&["plan", "--model", "no/such/dir"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no/such/dir"));
    // The built-in sizes by name, as `stepppo bench` takes them; `builtin` is `small`.
    let plan_of = |model: &str| {
        let out = stepppo(&["plan", "--model", model, "--memory-gib", "8"]);
        assert!(
            out.status.success(),
            "{model}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(plan_of("builtin"), plan_of("small"));
    assert_ne!(plan_of("tiny"), plan_of("small"));
}

/// Every shape in `configs/models/` plans with the parameter count its model card publishes.
#[test]
fn shipped_model_shapes_have_their_published_sizes() {
    let published = [
        ("qwen2.5-0.5b.json", 494_032_768u64),
        ("qwen2.5-3b.json", 3_085_938_688),
        ("qwen2.5-7b.json", 7_615_616_512),
        ("qwen2.5-32b.json", 32_763_876_352),
    ];
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models");
    let mut shipped: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    shipped.sort();
    let mut listed: Vec<String> = published.iter().map(|(f, _)| f.to_string()).collect();
    listed.sort();
    assert_eq!(
        shipped,
        listed,
        "a shape in {} without its size here",
        dir.display()
    );
    for (file, parameters) in published {
        let path = dir.join(file);
        let out = stepppo(&[
            "plan",
            "--model",
            path.to_str().unwrap(),
            "--memory-gib",
            "1000",
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains(&format!("weights ({parameters} parameters")),
            "{file}: {text}"
        );
    }
}
