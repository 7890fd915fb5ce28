//! HF-layout checkpoints: save → load gives identical logits; a hand-written sharded directory
//! (config.json + shards + index + tokenizer.json) loads by name; missing or mis-shaped tensors
//! fail with errors naming the tensor.

use std::path::Path;

use candle_core::{Device, Tensor};
use stepppo::model::checkpoint::{write_safetensors, INDEX_FILE};
use stepppo::model::{Critic, Model, ModelConfig, PaddedBatch};
use stepppo::tokenizer::Tokenizer;

fn batch() -> PaddedBatch {
    let seqs = vec![vec![5u32, 6, 7, 8], vec![100, 3]];
    PaddedBatch::right_padded(&seqs, 0, &Device::Cpu).unwrap()
}

fn logits(model: &Model) -> Vec<f32> {
    let b = batch();
    model
        .forward_train(&b.input_ids, &b.attention_mask)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn named_tensors(model: &Model) -> Vec<(String, Tensor)> {
    model
        .named_vars()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect()
}

#[test]
fn save_then_load_gives_identical_logits() {
    let tok = Tokenizer::builtin();
    for tied in [true, false] {
        let cfg = ModelConfig {
            tie_word_embeddings: tied,
            ..ModelConfig::tiny(tok.vocab_size())
        };
        let model = Model::new(&cfg, 1, &Device::Cpu).unwrap();
        let dir = tempfile::tempdir().unwrap();
        model.save(dir.path(), Some(&tok)).unwrap();
        let loaded = Model::load(dir.path(), &Device::Cpu).unwrap();
        assert_eq!(loaded.config(), model.config());
        assert_eq!(logits(&loaded), logits(&model));
        let tok2 = Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
        assert_eq!(
            tok2.encode("Turn 1:\nState:"),
            tok.encode("Turn 1:\nState:")
        );
    }
}

/// Writes an HF-style directory by hand: Qwen-like config.json, two shards, index, tokenizer.
fn write_sharded_dir(dir: &Path, tensors: &[(String, Tensor)], vocab: usize) {
    let config = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        "torch_dtype": "float32", "use_sliding_window": false, "sliding_window": 4096
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    let (first, second) = tensors.split_at(tensors.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        write_safetensors(&dir.join(file), part).unwrap();
        for (name, _) in part {
            weight_map.insert(name.clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
    Tokenizer::builtin()
        .save(dir.join("tokenizer.json"))
        .unwrap();
}

#[test]
fn hand_written_sharded_directory_loads_by_name() {
    let vocab = Tokenizer::builtin().vocab_size();
    let cfg = ModelConfig {
        tie_word_embeddings: false,
        ..ModelConfig::tiny(vocab)
    };
    let source = Model::new(&cfg, 2, &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut tensors = named_tensors(&source);
    tensors.reverse();
    write_sharded_dir(dir.path(), &tensors, vocab);
    let loaded = Model::load(dir.path(), &Device::Cpu).unwrap();
    assert_eq!(logits(&loaded), logits(&source));
    assert_eq!(loaded.config().extra["sliding_window"], 4096);
    assert!(Tokenizer::from_file(dir.path().join("tokenizer.json")).is_ok());
}

#[test]
fn missing_or_misshaped_tensors_are_named() {
    let vocab = Tokenizer::builtin().vocab_size();
    let cfg = ModelConfig {
        tie_word_embeddings: false,
        ..ModelConfig::tiny(vocab)
    };
    let source = Model::new(&cfg, 2, &Device::Cpu).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let missing: Vec<_> = named_tensors(&source)
        .into_iter()
        .filter(|(n, _)| n != "model.layers.1.self_attn.k_proj.bias")
        .collect();
    write_sharded_dir(dir.path(), &missing, vocab);
    let err = Model::load(dir.path(), &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model.layers.1.self_attn.k_proj.bias") && err.contains("missing"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let reshaped: Vec<_> = named_tensors(&source)
        .into_iter()
        .map(|(n, t)| {
            let t = if n == "model.layers.0.mlp.up_proj.weight" {
                t.narrow(0, 0, 10).unwrap()
            } else {
                t
            };
            (n, t)
        })
        .collect();
    write_sharded_dir(dir.path(), &reshaped, vocab);
    let err = Model::load(dir.path(), &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model.layers.0.mlp.up_proj.weight") && err.contains("[10, 32]"),
        "{err}"
    );
    assert!(err.contains(".safetensors"), "{err}");

    let empty = tempfile::tempdir().unwrap();
    let err = Model::load(empty.path(), &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn critic_round_trips_and_starts_from_a_policy_directory() {
    let cfg = ModelConfig::tiny(Tokenizer::builtin().vocab_size());
    let b = batch();
    let critic = Critic::new(&cfg, 4, &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    critic.save(dir.path()).unwrap();
    let loaded = Critic::load(dir.path(), &Device::Cpu, 99).unwrap();
    let values = |c: &Critic| {
        c.values(&b.input_ids, &b.attention_mask)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_eq!(values(&loaded), values(&critic));

    let policy = Model::new(&cfg, 5, &Device::Cpu).unwrap();
    let pdir = tempfile::tempdir().unwrap();
    policy.save(pdir.path(), None).unwrap();
    let from_policy = Critic::load(pdir.path(), &Device::Cpu, 6).unwrap();
    let trunk_equal = from_policy
        .named_vars()
        .iter()
        .filter(|(n, _)| n.starts_with("model."))
        .all(|(n, v)| {
            let p = policy
                .named_vars()
                .into_iter()
                .find(|(pn, _)| pn == n)
                .unwrap()
                .1;
            v.as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                == p.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
        });
    assert!(trunk_equal);
}
