//! `stepppo train | eval | plot` end to end on a tiny model (one short step), and config errors
//! that name the key.

use std::path::Path;
use std::process::Command;
use stepppo::train::run::metrics::{is_measurement, read_events, read_jsonl};

/// Any config at toy size: the tiny model, one step, two-episode batches.
const TINY_RUN: &[&str] = &[
    "builtin_size=tiny",
    "max_steps=1",
    "eval_steps=1",
    "sft.steps=2",
    "sft.episodes=2",
    "sft.batch_size=2",
    "ppo_mini_batch_size=2",
    "train_env_manager.group_size=2",
    "train_env_manager.num_groups_partition=[1]",
    "val_env_manager.num_groups_partition=[2]",
];

/// The embedded default at toy size.
fn tiny() -> Vec<&'static str> {
    let default_only = [
        "generating_args.max_new_tokens=6",
        "val_generating_args.max_new_tokens=6",
        "custom_envs.SimpleFrozenLake.env_config.max_turns=1",
        "cache.kv_slots=4096",
    ];
    [TINY_RUN, &default_only].concat()
}

fn stepppo(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(args)
        .output()
        .expect("the stepppo binary runs")
}

/// Runs `stepppo args` and checks that it succeeded.
fn stepppo_ok(args: &[&str]) -> std::process::Output {
    let out = stepppo(args);
    assert!(
        out.status.success(),
        "stepppo {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn with_sets<'a>(mut args: Vec<&'a str>, sets: &[&'a str]) -> Vec<&'a str> {
    for s in sets {
        args.push("--set");
        args.push(s);
    }
    args
}

#[test]
fn train_writes_metrics_events_plot_and_a_checkpoint_eval_reads() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    stepppo_ok(&with_sets(vec!["train", "--out", run_s], &tiny()));

    let rows = read_jsonl(&run.join("metrics.jsonl")).unwrap();
    let step1: Vec<_> = rows.iter().filter(|(s, _)| *s == 1).collect();
    let value = |name: &str| {
        step1
            .iter()
            .find_map(|(_, m)| m.get(name).copied())
            .unwrap_or_else(|| panic!("metrics.jsonl lacks {name} at step 1"))
    };
    // Each metric within the range its definition allows.
    for (name, low, high) in [
        ("env/SimpleFrozenLake/success", 0.0, 1.0),
        ("env/SimpleFrozenLake/action_is_valid", 0.0, 1.0),
        ("rollout/in_group_reward_std", 0.0, f64::MAX),
        ("rollout/prefix_hit_ratio", 0.0, 1.0),
        ("actor/pg_loss", f64::MIN, f64::MAX),
        ("actor/entropy", f64::MIN_POSITIVE, f64::MAX),
        ("actor/grad_norm", 0.0, f64::MAX),
        ("response_length/mean", 1.0, 6.0),
        ("time/rollout", f64::MIN_POSITIVE, f64::MAX),
        ("throughput/tokens_per_s", f64::MIN_POSITIVE, f64::MAX),
        // The step's resident-set peak: at least the 1 MiB any process holds.
        ("memory/peak_gib", 1.0 / 1024.0, f64::MAX),
        ("memory/planned_peak_gib", f64::MIN_POSITIVE, f64::MAX),
        ("val/SimpleFrozenLake/success", 0.0, 1.0),
    ] {
        let v = value(name);
        assert!(v.is_finite() && (low..=high).contains(&v), "{name} = {v}");
    }
    // Both turns of a group start from the same prompt, so the second reads the first's prefix.
    assert!(value("rollout/prefix_hit_ratio") > 0.0);
    let tb = std::fs::read_dir(run.join("tb"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let events = read_events(&tb).unwrap();
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    assert!(events
        .iter()
        .any(|e| e.step == 1 && e.scalars.iter().any(|(t, _)| t == "actor/pg_loss")));
    assert!(run.join("learning_curves.svg").is_file());
    assert!(run.join("ckpt-1/policy/model.safetensors").is_file());

    let ckpt = run.join("ckpt-latest");
    let out = stepppo_ok(&[
        "eval",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--episodes",
        "2",
        "--json",
    ]);
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary[0]["tag"], "SimpleFrozenLake");
    assert_eq!(summary[0]["episodes"], 2);
    // The checkpoint is step 1's policy and eval plays validation's held-out seeds with its
    // decoding: the same success as step 1's validation.
    let validated = step1
        .iter()
        .find_map(|(_, m)| m.get("val/SimpleFrozenLake/success").copied())
        .unwrap();
    assert_eq!(summary[0]["success"].as_f64().unwrap(), validated);

    std::fs::remove_file(run.join("learning_curves.svg")).unwrap();
    stepppo_ok(&["plot", run_s]);
    assert!(run.join("learning_curves.svg").is_file());
}

/// The shipped search-QA config.
const SEARCH_QA_CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/hotpotqa_steppo.yaml");

/// Search-QA sets for a toy run beyond [`TINY_RUN`]: short replies, no checkpoints.
const QA_TOY: &[&str] = &[
    "save_steps=0",
    "generating_args.max_new_tokens=8",
    "val_generating_args.max_new_tokens=8",
];

/// `stepppo train` of the search-QA config into `run`.
fn search_qa_train(run: &Path) -> Vec<&str> {
    vec![
        "train",
        "--config",
        SEARCH_QA_CONFIG,
        "--out",
        run.to_str().unwrap(),
    ]
}

/// `configs/hotpotqa_steppo.yaml` end to end at toy size: copy pre-training, the oracle warm start,
/// one StepPO step with its separate critic, and validation's search-QA metrics.
#[test]
fn the_search_qa_config_trains_one_step() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let copy = [
        "sft.copy.steps=3",
        "sft.copy.max_steps=4",
        "sft.copy.batch_size=2",
        "sft.copy.length=8",
    ];
    let qa_only = [QA_TOY, &copy].concat();
    let out = stepppo_ok(&with_sets(
        search_qa_train(&run),
        &[TINY_RUN, &qa_only].concat(),
    ));
    let printed = [out.stdout, out.stderr].concat();
    let printed = String::from_utf8_lossy(&printed);
    // The config's copy target is out of a toy model's reach: one more step, to the cap.
    assert!(printed.contains("copy pre-training: 4 steps"), "{printed}");
    assert!(printed.contains("(checks: "), "{printed}");
    assert!(printed.contains("warm start: 2 steps"), "{printed}");
    let rows = read_jsonl(&run.join("metrics.jsonl")).unwrap();
    let has = |name: &str| rows.iter().any(|(s, m)| *s == 1 && m.contains_key(name));
    for name in [
        "val/HotpotQAVal/success",
        "val/HotpotQAVal/action_is_valid",
        "critic/vf_explained_var",
        "rollout/prefix_hit_ratio",
    ] {
        assert!(has(name), "metrics.jsonl lacks {name}");
    }

    // A second run from the saved warm start, with the warm start off, takes the very same first
    // step: every figure but the clocks is equal.
    let warm_start = run.join("warm_start");
    let pretrain = format!("pretrain={}", warm_start.display());
    let again = dir.path().join("again");
    let off = [&pretrain, "sft.steps=0", "sft.copy.steps=0"];
    stepppo_ok(&with_sets(
        search_qa_train(&again),
        &[TINY_RUN, &qa_only, &off].concat(),
    ));
    let figures = |dir: &Path| -> Vec<(String, f64)> {
        let rows = read_jsonl(&dir.join("metrics.jsonl")).unwrap();
        let (_, step1) = rows.into_iter().find(|(s, _)| *s == 1).unwrap();
        step1
            .into_iter()
            .filter(|(k, _)| !is_measurement(k))
            .collect()
    };
    assert_eq!(figures(&again), figures(&run));

    // --overwrite would clear the run's warm_start/ before loading it: refused, nothing removed.
    let mut args = search_qa_train(&run);
    args.push("--overwrite");
    let out = stepppo(&with_sets(args, &[TINY_RUN, &qa_only, &off].concat()));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--overwrite would clear"),
        "{stderr}"
    );
    assert!(warm_start.join("model.safetensors").is_file());
}

/// `pretrain` naming a model config file starts the run from a model of that shape over the
/// built-in tokenizer; a shape whose vocabulary cannot hold the tokenizer's ids is refused by name.
#[test]
fn a_model_config_file_starts_a_run_of_its_shape() {
    let dir = tempfile::tempdir().unwrap();
    let shape = |vocab: usize| {
        serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "vocab_size": vocab, "hidden_size": 48, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": true, "hidden_act": "silu"
        })
    };
    let file = dir.path().join("shape.json");
    std::fs::write(&file, shape(8192).to_string()).unwrap();
    let run = dir.path().join("run");
    let pretrain = format!("pretrain={}", file.display());
    let sets = [&tiny()[..], &[&pretrain, "sft.steps=0", "save_steps=1"]].concat();
    stepppo_ok(&with_sets(
        vec!["train", "--out", run.to_str().unwrap()],
        &sets,
    ));
    let saved: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run.join("ckpt-1/policy/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(saved["hidden_size"], 48);
    assert_eq!(saved["vocab_size"], 8192);

    std::fs::write(&file, shape(100).to_string()).unwrap();
    let out = stepppo(&with_sets(
        vec!["train", "--out", dir.path().join("small").to_str().unwrap()],
        &sets,
    ));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("shape.json") && stderr.contains("vocab_size 100 is below"),
        "{stderr}"
    );
}

/// The default has no critic; StepPO with the shared-trunk critic logs the critic's metrics.
#[test]
fn step_gae_with_a_critic_logs_the_critic_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let sets = [
        &tiny()[..],
        &[
            "adv_estimator=step_gae",
            "critic.mode=shared",
            "critic.history_batches=1",
        ],
    ]
    .concat();
    stepppo_ok(&with_sets(
        vec!["train", "--out", run.to_str().unwrap()],
        &sets,
    ));
    let rows = read_jsonl(&run.join("metrics.jsonl")).unwrap();
    let step1 = rows.iter().find(|(s, _)| *s == 1).expect("a step-1 row");
    for name in ["critic/vf_loss", "critic/vf_explained_var"] {
        let value = step1.1.get(name).copied();
        assert!(
            value.is_some_and(f64::is_finite),
            "metrics.jsonl step 1: {name} = {value:?}"
        );
    }
}

/// Stores `episodes` non-slippery FrozenLake episodes of `agent` in `out`.
fn collect_frozen_lake(agent: &str, episodes: usize, out: &Path) {
    let episodes = episodes.to_string();
    stepppo_ok(&[
        "collect",
        "--env",
        "frozen_lake",
        "--agent",
        agent,
        "--episodes",
        &episodes,
        "--set",
        "is_slippery=false",
        "--out",
        out.to_str().unwrap(),
    ]);
}

/// `stepppo sft` of `data` into a tiny built-in model at `model`, plus `extra` arguments.
fn sft_tiny(data: &Path, model: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "sft",
        "--dataset",
        data.to_str().unwrap(),
        "--out",
        model.to_str().unwrap(),
        "--set",
        "builtin_size=tiny",
    ];
    args.extend_from_slice(extra);
    stepppo_ok(&args)
}

#[test]
fn sft_clones_a_stored_dataset_into_a_loadable_model() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("oracle");
    let model = dir.path().join("model");
    collect_frozen_lake("oracle", 4, &data);
    sft_tiny(
        &data,
        &model,
        &["--set", "sft.steps=4", "--set", "sft.batch_size=2"],
    );
    let (policy, _) =
        stepppo::model::checkpoint::load_policy(model.to_str().unwrap(), &candle_core::Device::Cpu)
            .unwrap();
    assert_eq!(policy.config().hidden_size, 32);
    // `eval` takes the model directory itself (validation envs from the embedded default).
    let out = stepppo_ok(&[
        "eval",
        "--checkpoint",
        model.to_str().unwrap(),
        "--episodes",
        "3",
        "--json",
    ]);
    let summaries: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summaries[0]["episodes"], 3, "{summaries}");
}

/// The sequence count `stepppo sft` reports ("… steps on N sequences …").
fn cloned_sequences(stdout: &[u8]) -> usize {
    let text = String::from_utf8_lossy(stdout);
    let after = text
        .split(" steps on ")
        .nth(1)
        .expect("sft reports its sequences");
    after.split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn sft_successful_only_clones_the_solved_trajectories() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("random");
    collect_frozen_lake("random", 60, &data);
    let model = dir.path().join("model");
    let clone = |extra: &[&str]| {
        let args = [&["--set", "sft.steps=1"], extra].concat();
        cloned_sequences(&sft_tiny(&data, &model, &args).stdout)
    };
    let (all, solved) = (clone(&[]), clone(&["--successful-only"]));
    assert_eq!(all, 60);
    assert!(0 < solved && solved < all, "{solved} of {all}");
}

#[test]
fn config_errors_name_the_key() {
    let out = stepppo(&["train", "--set", "ppo_epocs=2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ppo_epocs"), "{err}");
    let out = stepppo(&["train", "--set", "rollout_batch_size=7"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("with --set rollout_batch_size=7: key `rollout_batch_size`")
            && err.contains("got 7"),
        "{err}"
    );
    let out = stepppo(&["train", "--set", "gateway.listen=localhost"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("gateway.listen") && err.contains("host:port"),
        "{err}"
    );
}

#[test]
fn a_config_that_fails_leaves_no_run_directory_behind() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let missing = dir.path().join("no-such-model");
    let pretrain = format!("pretrain={}", missing.display());
    let args = with_sets(vec!["train", "--out", run.to_str().unwrap()], &tiny());
    let out = stepppo(&with_sets(args, &[pretrain.as_str()]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no-such-model"), "{err}");
    assert!(!run.exists(), "a failed start created {}", run.display());
}

/// Search QA's state critic reads the env's privileged facts (the gold found so far): a run
/// with it trains, and its critic is fitted and logged.
#[test]
fn a_state_critic_trains_on_search_qas_privileged_facts() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let sets = [
        "sft.copy.steps=0",
        "critic.mode=state",
        "critic.ppo_epochs=3",
    ];
    stepppo_ok(&with_sets(
        search_qa_train(&run),
        &[TINY_RUN, QA_TOY, &sets].concat(),
    ));
    let rows = read_jsonl(&run.join("metrics.jsonl")).unwrap();
    let logged = |name: &str| rows.iter().any(|(s, m)| *s == 1 && m.contains_key(name));
    assert!(logged("critic/vf_explained_var"), "no critic metrics");
}

#[test]
fn a_state_critic_on_an_env_without_a_critic_state_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = stepppo(&[
        "train",
        "--config",
        "configs/bandit_grpo.yaml",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "adv_estimator=step_gae",
        "--set",
        "reward_normalization={}",
        "--set",
        "critic.mode=state",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("critic.mode state") && err.contains("bandit supplies no critic state"),
        "{err}"
    );
    assert!(!run.exists(), "a failed start created {}", run.display());
}

#[test]
fn a_critic_the_estimator_never_reads_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let args = ["train", "--out", run.to_str().unwrap()];
    let out = stepppo(&with_sets(args.to_vec(), &["adv_estimator=grpo"]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("critic.mode: state is set, but adv_estimator reinforce reads no critic"),
        "{err}"
    );
    assert!(!run.exists(), "a failed start created {}", run.display());
}

/// A launcher's ranks in a build without the `mpi` feature: each says which feature to build
/// with, and no run directory is made.
#[cfg(not(feature = "mpi"))]
#[test]
fn ranks_launched_without_the_mpi_feature_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(with_sets(
            vec!["train", "--out", run.to_str().unwrap()],
            &tiny(),
        ))
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("2 ranks") && err.contains("--features mpi"),
        "{err}"
    );
    assert!(!run.exists());
}

/// A sharding mode that cannot apply is refused naming the key, before a run directory exists.
#[test]
fn a_sharding_mode_that_cannot_apply_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for (mode, says) in [
        ("gradients", "this run is one process"),
        ("optimizer", "this run is one process"),
        ("parameters", "not available yet"),
    ] {
        let run = dir.path().join(mode);
        let setting = format!("sharding={mode}");
        let sets = [&tiny()[..], &[setting.as_str()]].concat();
        let out = stepppo(&with_sets(
            vec!["train", "--out", run.to_str().unwrap()],
            &sets,
        ));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{mode}: {stderr}");
        assert!(
            stderr.contains("sharding") && stderr.contains(says),
            "{mode}: {stderr}"
        );
        assert!(!run.exists(), "{mode}: a refused run leaves no directory");
    }
}
