//! Checkpoints as Hugging Face transformers writes them (`tests/fixtures/hf/`, made by
//! `scripts/make_hf_fixtures.py`): each loads and generates, greedily, the tokens transformers
//! generated, with log-probs within 1e-4 (f32), on both of stepppo's forward paths. Covers
//! Qwen2, Qwen3 and Llama 3, both config layouts, RoPE scaling variants, bf16/f16 weights, shards,
//! the export round trip, and errors for config keys stepppo cannot honour. LoRA adapters PEFT
//! wrote (`tests/fixtures/peft/`, made by `scripts/make_peft_fixtures.py`) are held to the same
//! bound against PEFT's model, attached, merged and after stepppo's own save. Generation in bf16
//! (`scripts/make_bf16_generation_fixtures.py`) is held against transformers' own bf16 model.

use std::path::{Path, PathBuf};

use candle_core::Device;
use stepppo::kv::KvPool;
use stepppo::model::lora::{ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
use stepppo::model::{Adapters, Model, PaddedBatch, Precision};
use stepppo::rollout::engine::{CacheMode, Engine, EngineConfig, GenRequest};
use stepppo::rollout::forced_logprobs;
use stepppo::rollout::sampling::SamplingParams;
use stepppo::tokenizer::Tokenizer;

const MAX_LOGPROB_DIFF: f32 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// transformers' greedy result for a fixture.
struct Expected {
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
}

fn expected(dir: &Path) -> Expected {
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        json[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    Expected {
        prompt: ids("prompt"),
        tokens: ids("tokens"),
        logprobs: json["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect(),
    }
}

/// Largest |Δ log-prob| allowed between stepppo's bf16 generation and transformers' bf16 model on
/// the same sampled tokens; transformers' own bf16-vs-f32 gap on these fixtures is 0.04–0.05.
const MAX_BF16_LOGPROB_DIFF: f32 = 0.05;

/// Log-probs the decode path gives `tokens` after `prompt` (forced, one token a call).
fn forced_decode_logprobs(model: &Model, prompt: &[u32], tokens: &[u32]) -> Vec<f32> {
    let n = prompt.len() + tokens.len();
    let mut pool = KvPool::new(model.config(), n, &Device::Cpu).unwrap();
    forced_logprobs(model, &mut pool, prompt, tokens).unwrap()
}

#[test]
fn bf16_generation_matches_transformers_bf16_and_f32_stays_exact() {
    for name in ["qwen2", "qwen3", "llama3"] {
        let dir = fixture(name);
        let text = std::fs::read_to_string(dir.join("bf16_generation.json")).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let list = |key: &str| -> Vec<f64> {
            json[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        };
        let prompt: Vec<u32> = list("prompt").iter().map(|&v| v as u32).collect();
        let tokens: Vec<u32> = list("tokens").iter().map(|&v| v as u32).collect();
        let want_bf16: Vec<f32> = list("logprobs_bf16").iter().map(|&v| v as f32).collect();
        let want_f32: Vec<f32> = list("logprobs_f32").iter().map(|&v| v as f32).collect();
        assert_eq!(tokens.len(), 64, "{name}");

        let mut model = Model::load(&dir, &Device::Cpu).unwrap();
        let f32 = forced_decode_logprobs(&model, &prompt, &tokens);
        let f32_diff = max_diff(&f32, &want_f32);
        model.set_rollout_precision(Precision::Bf16).unwrap();
        let bf16 = forced_decode_logprobs(&model, &prompt, &tokens);
        let bf16_diff = max_diff(&bf16, &want_bf16);
        let mean_diff = bf16
            .iter()
            .zip(&want_bf16)
            .map(|(a, b)| (a - b).abs())
            .sum::<f32>()
            / bf16.len() as f32;
        let hf_gap = max_diff(&want_bf16, &want_f32);
        eprintln!(
            "{name}: f32 max |Δ log-prob| {f32_diff:.2e}; bf16 vs transformers bf16 max {bf16_diff:.2e} \
             (mean {mean_diff:.2e}); transformers bf16 vs f32 max {hf_gap:.2e}"
        );
        assert!(f32_diff <= MAX_LOGPROB_DIFF, "{name}: f32 {f32_diff}");
        assert!(
            bf16_diff <= MAX_BF16_LOGPROB_DIFF,
            "{name}: bf16 {bf16_diff}"
        );
        // The bf16 path really rounds: it is nearer transformers' bf16 than the f32 path is.
        let f32_vs_bf16 = max_diff(&f32, &want_bf16);
        assert!(
            bf16_diff < f32_vs_bf16,
            "{name}: bf16 {bf16_diff} vs f32 {f32_vs_bf16}"
        );
    }
}

/// A directory with the weight files of `weights` and `config` as its `config.json`.
fn assemble(weights: &Path, config: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(weights).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if name.contains(".safetensors") {
            std::fs::copy(&path, dir.path().join(name)).unwrap();
        }
    }
    std::fs::copy(config, dir.path().join("config.json")).unwrap();
    dir
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Greedy generation on the incremental path and the training path's log-probs of the same
/// tokens, both compared with transformers.
fn check_against_transformers(model_dir: &Path, expected_dir: &Path) {
    let model = Model::load(model_dir, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", model_dir.display()));
    check_model_against(&model, expected_dir);
}

/// [`check_against_transformers`] of a loaded model.
fn check_model_against(model: &Model, expected_dir: &Path) {
    let want = expected(expected_dir);
    let n = want.tokens.len();
    let cfg = EngineConfig {
        cache_mode: CacheMode::None,
        num_slots: want.prompt.len() + n,
        ..EngineConfig::default()
    };
    let request = GenRequest::plain(want.prompt.clone(), SamplingParams::greedy(), 0, n);
    let gens = Engine::for_model(model, cfg)
        .unwrap()
        .generate(model, &Tokenizer::builtin(), &[request])
        .unwrap();
    let got = &gens[0];
    let matched = got
        .tokens
        .iter()
        .zip(&want.tokens)
        .take_while(|(a, b)| a == b)
        .count();
    let name = expected_dir.file_name().unwrap().to_string_lossy();
    assert_eq!(matched, n, "{name}: greedy tokens match {matched} of {n}");
    let rollout_diff = max_diff(&got.logprobs, &want.logprobs);
    let train_diff = max_diff(&training_logprobs(model, &want), &want.logprobs);
    eprintln!(
        "{name}: {matched}/{n} tokens; max |Δ log-prob| rollout {rollout_diff:.2e}, training {train_diff:.2e}"
    );
    assert!(rollout_diff <= MAX_LOGPROB_DIFF, "{name}: {rollout_diff}");
    assert!(train_diff <= MAX_LOGPROB_DIFF, "{name}: {train_diff}");
}

/// Log-probs of the expected tokens from one padded training-path forward pass.
fn training_logprobs(model: &Model, want: &Expected) -> Vec<f32> {
    let full = [want.prompt.clone(), want.tokens.clone()].concat();
    let inputs =
        PaddedBatch::right_padded(&[full[..full.len() - 1].to_vec()], 0, &Device::Cpu).unwrap();
    let targets = PaddedBatch::right_padded(&[full[1..].to_vec()], 0, &Device::Cpu).unwrap();
    let (logp, _) = model
        .token_logprobs_entropy(
            &inputs.input_ids,
            &inputs.attention_mask,
            &targets.input_ids,
            1.0,
        )
        .unwrap();
    let logp = logp.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
    logp[want.prompt.len() - 1..].to_vec()
}

#[test]
fn qwen2_transformers5_layout_matches_transformers() {
    check_against_transformers(&fixture("qwen2"), &fixture("qwen2"));
}

#[test]
fn qwen2_transformers4_layout_matches_transformers() {
    let dir = assemble(&fixture("qwen2"), &fixture("qwen2/config.v4.json"));
    check_against_transformers(dir.path(), &fixture("qwen2"));
}

#[test]
fn qwen3_matches_transformers() {
    check_against_transformers(&fixture("qwen3"), &fixture("qwen3"));
}

#[test]
fn llama3_matches_transformers_in_both_layouts() {
    check_against_transformers(&fixture("llama3"), &fixture("llama3"));
    let dir = assemble(&fixture("llama3"), &fixture("llama3/config.v4.json"));
    check_against_transformers(dir.path(), &fixture("llama3"));
}

#[test]
fn attention_bias_matches_transformers_in_llama_and_qwen3() {
    for name in ["llama-attention-bias", "qwen3-attention-bias"] {
        check_against_transformers(&fixture(name), &fixture(name));
    }
}

#[test]
fn rope_scaling_variants_match_transformers() {
    for variant in ["rope-linear", "rope-dynamic", "rope-yarn"] {
        let dir = assemble(&fixture("qwen2"), &fixture(variant).join("config.json"));
        check_against_transformers(dir.path(), &fixture(variant));
    }
}

#[test]
fn bf16_and_f16_weights_load_as_f32_and_match_transformers() {
    for name in ["qwen2-bf16", "qwen2-f16"] {
        check_against_transformers(&fixture(name), &fixture(name));
    }
}

#[test]
fn sharded_checkpoint_matches_transformers() {
    assert!(fixture("qwen2-sharded")
        .join("model.safetensors.index.json")
        .exists());
    check_against_transformers(&fixture("qwen2-sharded"), &fixture("qwen2-sharded"));
}

/// The fixture's config with `edit` applied, over the fixture's weights; the load error.
fn load_error(
    name: &str,
    edit: impl Fn(&mut serde_json::Map<String, serde_json::Value>),
) -> String {
    let base = fixture(name);
    let text = std::fs::read_to_string(base.join("config.json")).unwrap();
    let mut cfg: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text).unwrap();
    edit(&mut cfg);
    let dir = assemble(&base, &base.join("config.json"));
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    match Model::load(dir.path(), &Device::Cpu) {
        Ok(_) => panic!("{name} with {cfg:?} loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn config_keys_stepppo_cannot_honour_are_errors_naming_key_and_file() {
    use serde_json::json;
    let cases: Vec<(&str, &str, serde_json::Value)> = vec![
        ("qwen2", "use_sliding_window", json!(true)),
        (
            "qwen2",
            "layer_types",
            json!(["full_attention", "sliding_attention"]),
        ),
        ("qwen2", "hidden_act", json!("gelu_pytorch_tanh")),
        (
            "qwen2",
            "quantization_config",
            json!({"quant_method": "gptq", "bits": 4}),
        ),
        ("qwen2", "num_experts", json!(8)),
        ("qwen2", "num_experts_per_tok", json!(2)),
        ("qwen2", "model_type", json!("qwen2_moe")),
        ("qwen2", "attention_dropout", json!(0.1)),
        ("qwen2", "partial_rotary_factor", json!(0.5)),
        ("llama3", "mlp_bias", json!(true)),
        ("llama3", "num_local_experts", json!(8)),
        ("qwen3", "original_max_position_embeddings", json!(16)),
    ];
    for (name, key, value) in cases {
        let err = load_error(name, |cfg| {
            cfg.insert(key.to_string(), value.clone());
        });
        assert!(
            err.contains(&format!("`{key}")) && err.contains("config.json"),
            "{name} with {key} = {value}: {err}"
        );
    }
}

#[test]
fn unsupported_rope_settings_are_errors_naming_the_key() {
    use serde_json::json;
    let cases = [
        (
            json!({"rope_type": "longrope", "rope_theta": 1e6}),
            "rope_parameters.rope_type",
        ),
        (
            json!({"rope_type": "linear", "rope_theta": 1e6}),
            "rope_parameters.factor",
        ),
        (
            json!({"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 2]}),
            "rope_parameters.mrope_section",
        ),
    ];
    for (params, key) in cases {
        let err = load_error("qwen2", |cfg| {
            cfg.insert("rope_parameters".into(), params.clone());
        });
        assert!(err.contains(key) && err.contains("config.json"), "{err}");
    }
    let err = load_error("qwen2", |cfg| {
        cfg.insert("rope_theta".into(), json!(10000.0));
    });
    assert!(err.contains("rope_theta"), "{err}");
}

#[test]
fn qwen3_without_its_qk_norms_is_a_missing_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("qwen3");
    let tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let kept: Vec<_> = tensors
        .into_iter()
        .filter(|(n, _)| !n.ends_with("self_attn.q_norm.weight"))
        .collect();
    stepppo::model::checkpoint::write_safetensors(&dir.path().join("model.safetensors"), &kept)
        .unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let err = Model::load(dir.path(), &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("q_norm.weight") && err.contains("missing"),
        "{err}"
    );
}

#[test]
fn weights_the_config_does_not_account_for_are_an_error() {
    let err = load_error("qwen3", |cfg| {
        cfg.insert("model_type".into(), serde_json::json!("llama"));
    });
    assert!(
        err.contains("self_attn.k_norm.weight") && err.contains("model.safetensors"),
        "{err}"
    );
}

/// Tensor names, shapes and dtypes of a directory's safetensors files.
fn tensor_specs(dir: &Path) -> Vec<(String, Vec<usize>, candle_core::DType)> {
    let mut specs = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            specs.extend(tensor_specs_of(&path));
        }
    }
    specs.sort_by(|a, b| a.0.cmp(&b.0));
    specs
}

fn config_json(dir: &Path) -> serde_json::Map<String, serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn export_writes_what_transformers_wrote() {
    for name in ["qwen2", "qwen3", "llama3", "qwen2-bf16"] {
        let src = fixture(name);
        let model = Model::load(&src, &Device::Cpu).unwrap();
        let out = tempfile::tempdir().unwrap();
        model.save(out.path(), None).unwrap();

        let theirs: Vec<_> = tensor_specs(&src)
            .into_iter()
            .map(|(n, s, _)| (n, s, candle_core::DType::F32))
            .collect();
        assert_eq!(tensor_specs(out.path()), theirs, "{name}: tensors");

        let mut want = config_json(&src);
        want.insert("dtype".into(), "float32".into());
        assert_eq!(config_json(out.path()), want, "{name}: config.json");

        check_against_transformers(out.path(), &src);
    }
}

fn peft_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/peft")
        .join(name)
}

/// The PEFT fixtures and the base each adapts.
const ADAPTERS: [(&str, &str); 3] = [
    ("qwen2-all", "qwen2"),
    ("qwen3-qv", "qwen3"),
    ("llama3-mlp", "llama3"),
];

/// The fixture `base` (weights only, no tokenizer) with the adapter in `dir` attached.
fn try_with_adapter(base: &str, dir: &Path) -> Result<Model, stepppo::model::ModelError> {
    let mut model = Model::load(&fixture(base), &Device::Cpu)?;
    let adapters = Adapters::load(dir, model.config(), &Device::Cpu)?;
    model.attach_adapters(adapters)?;
    Ok(model)
}

fn with_adapter(base: &str, adapter: &Path) -> Model {
    try_with_adapter(base, adapter).unwrap_or_else(|e| panic!("{}: {e}", adapter.display()))
}

#[test]
fn peft_adapters_match_peft_attached_merged_and_saved_again() {
    for (name, base) in ADAPTERS {
        let dir = peft_fixture(name);
        let model = with_adapter(base, &dir);
        check_model_against(&model, &dir);
        check_model_against(&model.merged().unwrap(), &dir);
        // The base's own greedy tokens differ: the adapter is really applied.
        let plain = expected(&fixture(base));
        assert_ne!(plain.tokens, expected(&dir).tokens, "{name}");
        let again = tempfile::tempdir().unwrap();
        model.save(again.path(), None).unwrap();
        check_model_against(&with_adapter(base, again.path()), &dir);
        assert_eq!(
            tensor_specs_of(&dir.join(ADAPTER_WEIGHTS_FILE)),
            tensor_specs_of(&again.path().join(ADAPTER_WEIGHTS_FILE)),
            "{name}: the tensors PEFT wrote, by name, shape and dtype"
        );
    }
}

#[test]
fn merge_adapter_writes_a_model_that_loads_without_peft() {
    let (name, base) = ADAPTERS[0];
    let out = tempfile::tempdir().unwrap();
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_stepppo"))
        .args(["merge-adapter", "--model"])
        .arg(fixture(base))
        .arg("--adapter")
        .arg(peft_fixture(name))
        .arg("--out")
        .arg(out.path())
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    assert_eq!(tensor_specs(out.path()), tensor_specs(&fixture(base)));
    check_against_transformers(out.path(), &peft_fixture(name));
    assert_eq!(
        std::fs::read(out.path().join("generation_config.json")).unwrap(),
        std::fs::read(fixture(base).join("generation_config.json")).unwrap(),
        "the base's generation_config.json goes along"
    );
    assert!(
        !String::from_utf8_lossy(&status.stderr).contains("warning"),
        "the adapter names this base: {}",
        String::from_utf8_lossy(&status.stderr)
    );

    // An --out that holds something is refused without --overwrite, replaced with it.
    let merge = |adapter: &Path, extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_stepppo"))
            .args(["merge-adapter", "--model"])
            .arg(fixture(base))
            .arg("--adapter")
            .arg(adapter)
            .arg("--out")
            .arg(out.path())
            .args(extra)
            .output()
            .unwrap()
    };
    let refused = merge(&peft_fixture(name), &[]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("--overwrite"),
        "{err}"
    );
    // An adapter made for another base of the same shapes merges, with a warning naming it.
    let other = adapter_with(name, "base_model_name_or_path", "Qwen/Qwen2-0.5B".into());
    let replaced = merge(other.path(), &["--overwrite"]);
    let err = String::from_utf8_lossy(&replaced.stderr);
    assert!(replaced.status.success(), "{err}");
    assert!(err.contains("names the base `Qwen/Qwen2-0.5B`"), "{err}");
    assert_eq!(tensor_specs(out.path()), tensor_specs(&fixture(base)));
}

/// A copy of fixture `name` whose `adapter_config.json` has `key` set to `value`.
fn adapter_with(name: &str, key: &str, value: serde_json::Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = peft_fixture(name);
    std::fs::copy(
        src.join(ADAPTER_WEIGHTS_FILE),
        dir.path().join(ADAPTER_WEIGHTS_FILE),
    )
    .unwrap();
    let path = src.join(ADAPTER_CONFIG_FILE);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    config[key] = value;
    std::fs::write(
        dir.path().join(ADAPTER_CONFIG_FILE),
        serde_json::to_string(&config).unwrap(),
    )
    .unwrap();
    dir
}

#[test]
fn adapters_stepppo_cannot_compute_exactly_are_errors_naming_the_key() {
    let (name, base) = ADAPTERS[0];
    let refused = |dir: &Path, needle: &str| {
        let err = try_with_adapter(base, dir)
            .err()
            .unwrap_or_else(|| panic!("{needle}: loaded"))
            .to_string();
        assert!(err.contains(needle), "{needle}: {err}");
    };
    use serde_json::json;
    for (key, value) in [
        ("use_dora", json!(true)),
        ("use_rslora", json!(true)),
        ("rank_pattern", json!({"q_proj": 8})),
        ("alpha_pattern", json!({"q_proj": 8})),
        ("bias", json!("lora_only")),
        ("modules_to_save", json!(["lm_head"])),
        ("layers_to_transform", json!([0])),
        ("fan_in_fan_out", json!(true)),
        ("init_lora_weights", json!("pissa")),
    ] {
        refused(adapter_with(name, key, value).path(), key);
    }
    refused(
        adapter_with(name, "target_modules", json!(".*proj")).path(),
        "target_modules",
    );
    refused(
        adapter_with(name, "target_modules", json!(["q_proj", "lm_head"])).path(),
        "lm_head",
    );
    refused(adapter_with(name, "r", json!(8)).path(), "lora_A");
    refused(
        adapter_with(name, "peft_type", json!("IA3")).path(),
        "peft_type",
    );
    // An adapter on fewer modules than its weights hold: the extra tensors are unexpected.
    refused(
        adapter_with(name, "target_modules", json!(["q_proj"])).path(),
        "layers.0.mlp.down_proj.lora_A.weight` is not a LoRA A or B",
    );
    // Its weights on another model shape.
    let err = try_with_adapter("qwen3", &peft_fixture(name))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("shape") || err.contains("missing"), "{err}");
}

fn tensor_specs_of(file: &Path) -> Vec<(String, Vec<usize>, candle_core::DType)> {
    let mut specs: Vec<_> = candle_core::safetensors::load(file, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.dims().to_vec(), t.dtype()))
        .collect();
    specs.sort_by(|a, b| a.0.cmp(&b.0));
    specs
}
