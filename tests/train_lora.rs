//! LoRA in the training loop (tiny model, short FrozenLake runs): only the adapters move, the
//! base stays byte for byte what the warm start left; checkpoints hold the adapters alone in
//! PEFT's layout and resume exactly; the KL reference is the base; `pretrain_adapter` starts a
//! run from a saved adapter and must agree with `lora`; a separate critic with `critic.lora`
//! trains its adapters and head only, on the policy's base, and resumes exactly.

mod common;

use std::path::Path;

use candle_core::Device;
use stepppo::model::checkpoint::load_policy;
use stepppo::model::lora::{ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
use stepppo::model::Model;
use stepppo::train::Trainer;

const LORA: &str = "lora={rank: 2, alpha: 4, target_modules: all-linear}";

/// Tensors by name, as flat values.
type Named = Vec<(String, Vec<f32>)>;

fn weights(t: &Trainer) -> Named {
    flat(t.policy_weights())
}

fn flat(tensors: Vec<(String, candle_core::Tensor)>) -> Named {
    tensors
        .into_iter()
        .map(|(n, w)| (n, w.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// The adapters' tensors and the base's.
fn split(weights: Named) -> (Named, Named) {
    weights.into_iter().partition(|(n, _)| n.contains(".lora_"))
}

fn model_weights(model: &Model) -> Named {
    model
        .named_vars()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            )
        })
        .collect()
}

#[test]
fn only_the_adapters_train_and_a_lora_run_resumes_exactly() {
    let cfg = || common::tiny_config(&[LORA]);
    let root = tempfile::tempdir().unwrap();
    let (a, b) = (root.path().join("a"), root.path().join("b"));

    let mut straight = Trainer::create(cfg(), &a).unwrap();
    let (fresh_adapters, _) = split(weights(&straight));
    assert_eq!(
        fresh_adapters.len(),
        2 * 7 * 2,
        "A and B on 7 projections of 2 layers"
    );
    straight.run(4, &mut |_| {}).unwrap();
    let expected = weights(&straight);
    let (adapters, base) = split(expected.clone());
    let (warm, _) = load_policy(&a.join("warm_start").display().to_string(), &Device::Cpu).unwrap();
    assert_eq!(base, model_weights(&warm), "the base must not move");
    assert_ne!(adapters, fresh_adapters, "the adapters must train");

    let ckpt = a.join("ckpt-4/policy");
    assert!(ckpt.join(ADAPTER_CONFIG_FILE).is_file() && ckpt.join(ADAPTER_WEIGHTS_FILE).is_file());
    assert!(
        !ckpt.join("model.safetensors").exists(),
        "a LoRA checkpoint holds no base weights"
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join(ADAPTER_CONFIG_FILE)).unwrap())
            .unwrap();
    assert_eq!(config["r"], 2);
    assert_eq!(config["lora_alpha"], 4.0);
    assert_eq!(
        Path::new(config["base_model_name_or_path"].as_str().unwrap()),
        std::path::absolute(a.join("warm_start")).unwrap()
    );
    let (reloaded, _) = load_policy(&ckpt.display().to_string(), &Device::Cpu).unwrap();
    let names: Vec<String> = reloaded
        .adapters()
        .unwrap()
        .named_vars()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        names,
        adapters.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>()
    );

    let mut first = Trainer::create(cfg(), &b).unwrap();
    first.run(2, &mut |_| {}).unwrap();
    let after_two = weights(&first);
    drop(first);
    assert_ne!(after_two, expected);
    let mut resumed = Trainer::resume(cfg(), &b).unwrap();
    assert_eq!(weights(&resumed), after_two);
    resumed.run(4, &mut |_| {}).unwrap();
    assert_eq!(resumed.state(), straight.state());
    assert_eq!(weights(&resumed), expected);
}

#[test]
fn the_kl_reference_of_a_lora_run_is_the_base() {
    let mut cfg = common::tiny_config(&[LORA]);
    cfg.init_kl_coef = 0.5;
    cfg.use_kl_loss = true;
    cfg.kl_loss_coef = 0.1;
    let root = tempfile::tempdir().unwrap();
    let (mut kl, mut kl_loss) = (Vec::new(), Vec::new());
    let mut t = Trainer::create(cfg, root.path()).unwrap();
    t.run(3, &mut |event| {
        if let stepppo::train::run::trainer::Event::Step { scalars, .. } = event {
            kl.push(scalars["actor/reward_kl_penalty"]);
            kl_loss.push(scalars["actor/kl_loss"]);
        }
    })
    .unwrap();
    assert!(
        !root.path().join("reference").exists(),
        "no second copy of the model"
    );
    // Step 1 samples from fresh adapters (B = 0), which are the base: only the float noise
    // between the rollout and training paths.
    assert!(kl[0].abs() < 1e-3, "{kl:?}");
    assert!(
        kl_loss.iter().all(|&k| k.is_finite() && k >= 0.0),
        "{kl_loss:?}"
    );
    assert!(
        kl_loss[2] > 0.0,
        "the adapters move away from the base: {kl_loss:?}"
    );
}

#[test]
fn a_run_starts_from_a_saved_adapter_that_agrees_with_its_lora() {
    let root = tempfile::tempdir().unwrap();
    let first = root.path().join("first");
    let mut t = Trainer::create(common::tiny_config(&[LORA, "max_steps=2"]), &first).unwrap();
    t.run(2, &mut |_| {}).unwrap();
    let (saved, _) = split(weights(&t));
    drop(t);
    let adapter = first.join("ckpt-2/policy").display().to_string();
    let from = format!("pretrain_adapter={adapter}");
    let warm = format!("pretrain={}", first.join("warm_start").display());
    let plain = common::tiny_config(&[&from, &warm, "sft.steps=0"]);
    let t = Trainer::create(plain, &root.path().join("second")).unwrap();
    assert_eq!(split(weights(&t)).0, saved);

    let other = "lora={rank: 3, alpha: 4}";
    let mismatched = common::tiny_config(&[&from, &warm, "sft.steps=0", other]);
    let err = Trainer::create(mismatched, &root.path().join("third"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("pretrain_adapter") && err.contains("rank 3"),
        "{err}"
    );
}

#[test]
fn a_separate_critic_with_lora_trains_its_adapters_and_head_on_a_frozen_base_and_resumes() {
    let cfg = || {
        common::tiny_config(&[
            LORA,
            "critic.mode=separate",
            "critic.history_batches=1",
            "critic.learning_rate=1e-3",
            "critic.lora={rank: 2, alpha: 4, target_modules: [q_proj, v_proj]}",
        ])
    };
    let root = tempfile::tempdir().unwrap();
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    let mut straight = Trainer::create(cfg(), &a).unwrap();
    let fresh = flat(straight.critic_weights());
    let (fresh_adapters, _) = split(fresh.clone());
    assert_eq!(
        fresh_adapters.len(),
        2 * 2 * 2,
        "A and B on q and v of 2 layers"
    );
    straight.run(4, &mut |_| {}).unwrap();
    let expected = flat(straight.critic_weights());
    let (adapters, rest) = split(expected.clone());
    let (head, base): (Named, Named) = rest.into_iter().partition(|(n, _)| n.starts_with("score."));
    let (fresh_head, fresh_base): (Named, Named) = split(fresh)
        .1
        .into_iter()
        .partition(|(n, _)| n.starts_with("score."));
    assert_ne!(adapters, fresh_adapters, "the critic's adapters must train");
    assert_ne!(head, fresh_head, "the value head must train");
    assert_eq!(base, fresh_base, "the critic's base must not move");
    let (warm, _) = load_policy(&a.join("warm_start").display().to_string(), &Device::Cpu).unwrap();
    let warm_trunk: Named = model_weights(&warm)
        .into_iter()
        .filter(|(n, _)| base.iter().any(|(b, _)| b == n))
        .collect();
    assert_eq!(
        base, warm_trunk,
        "the critic's base is the policy's warm start"
    );

    let ckpt = a.join("ckpt-4/critic");
    assert!(ckpt.join(ADAPTER_CONFIG_FILE).is_file());
    assert!(ckpt
        .join(stepppo::model::checkpoint::VALUE_HEAD_FILE)
        .is_file());
    assert!(
        !ckpt.join("model.safetensors").exists(),
        "no base weights in the checkpoint"
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join(ADAPTER_CONFIG_FILE)).unwrap())
            .unwrap();
    assert_eq!(
        Path::new(config["base_model_name_or_path"].as_str().unwrap()),
        std::path::absolute(a.join("warm_start")).unwrap()
    );

    let mut first = Trainer::create(cfg(), &b).unwrap();
    first.run(2, &mut |_| {}).unwrap();
    let after_two = flat(first.critic_weights());
    drop(first);
    let mut resumed = Trainer::resume(cfg(), &b).unwrap();
    assert_eq!(flat(resumed.critic_weights()), after_two);
    resumed.run(4, &mut |_| {}).unwrap();
    assert_eq!(flat(resumed.critic_weights()), expected);
    assert_eq!(weights(&resumed), weights(&straight));
}

#[test]
fn a_lora_critic_on_a_fresh_trunk_writes_its_base_and_reloads_from_it() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("run");
    let cfg = common::tiny_config(&[
        "critic.mode=separate",
        "critic.pretrain=builtin",
        "critic.history_batches=1",
        "critic.lora={rank: 2, alpha: 4}",
        "max_steps=1",
    ]);
    let mut t = Trainer::create(cfg.clone(), &run).unwrap();
    t.run(1, &mut |_| {}).unwrap();
    let weights = flat(t.critic_weights());
    drop(t);
    assert!(run.join("critic_base/model.safetensors").is_file());
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run.join("ckpt-1/critic").join(ADAPTER_CONFIG_FILE)).unwrap(),
    )
    .unwrap();
    assert_eq!(
        Path::new(config["base_model_name_or_path"].as_str().unwrap()),
        std::path::absolute(run.join("critic_base")).unwrap()
    );
    let resumed = Trainer::resume(cfg, &run).unwrap();
    assert_eq!(flat(resumed.critic_weights()), weights);
}

#[test]
fn lora_configs_that_cannot_be_trained_exactly_are_refused() {
    let refused = |sets: &[&str], key: &str| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let err = stepppo::config::Config::from_yaml_str(
            stepppo::config::EMBEDDED_DEFAULT_YAML,
            "test",
            &sets,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains(key), "{key}: {err}");
    };
    refused(&["lora={rank: 4, alpha: 8, dropout: 0.05}"], "lora.dropout");
    refused(&["lora={rank: 0, alpha: 8}"], "lora.rank");
    refused(
        &["lora={rank: 4, alpha: 8, target_modules: [lm_head]}"],
        "lm_head",
    );
    refused(
        &["lora={rank: 4, alpha: 8}", "critic.mode=shared"],
        "critic.mode",
    );
    refused(&["critic.lora={rank: 4, alpha: 8}"], "critic.lora");
    refused(
        &[
            "critic.mode=separate",
            "critic.history_batches=1",
            "critic.lora={rank: 4, alpha: 8, dropout: 0.1}",
        ],
        "critic.lora.dropout",
    );
}
