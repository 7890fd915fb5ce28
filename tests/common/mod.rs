//! What several integration tests share: the tiny training config they run on.

use stepppo::config::{Config, EMBEDDED_DEFAULT_YAML};

/// The embedded default shrunk to seconds (tiny model, two groups of two short FrozenLake
/// episodes, `step_gae`, four steps validated every two), with `extra` `--set`s on top.
pub fn tiny_config(extra: &[&str]) -> Config {
    let sets: Vec<String> = [
        "builtin_size=tiny",
        "adv_estimator=step_gae",
        "max_steps=4",
        "eval_steps=2",
        "save_steps=0",
        "sft.steps=3",
        "sft.episodes=4",
        "sft.batch_size=2",
        "ppo_mini_batch_size=2",
        "train_env_manager.group_size=2",
        "train_env_manager.num_groups_partition=[2]",
        "val_env_manager.num_groups_partition=[2]",
        "generating_args.max_new_tokens=6",
        "val_generating_args.max_new_tokens=6",
        "custom_envs.SimpleFrozenLake.env_config.max_turns=2",
        "cache.kv_slots=8192",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    Config::from_yaml_str(EMBEDDED_DEFAULT_YAML, "test", &sets).unwrap()
}
