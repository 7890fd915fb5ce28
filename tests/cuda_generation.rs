//! GPU test (feature `cuda`): the whole incremental path on CUDA (weights, KV pool and our
//! kernels) against the CPU path on the same weights in the same dtype — in f32, identical
//! greedy tokens and log-probs within 1e-4; in bf16 (both devices rounding where transformers
//! rounds), identical greedy tokens and log-probs within bf16 tolerance. Skips (and passes)
//! without a CUDA device.
#![cfg(feature = "cuda")]

use candle_core::Device;
use stepppo::kv::KvPool;
use stepppo::model::{Model, ModelConfig, Precision};
use stepppo::rollout::engine::{CacheMode, Engine, EngineConfig, GenRequest};
use stepppo::rollout::forced_logprobs;
use stepppo::rollout::sampling::SamplingParams;
use stepppo::tokenizer::{ChatTemplate, Tokenizer};

#[test]
fn cuda_generation_matches_cpu() {
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return;
        }
    };
    let tok = Tokenizer::builtin();
    // A wider init than HF's 0.02 spreads the logits, so greedy choices are not near-ties that
    // bf16 rounding could flip.
    let mut cfg = ModelConfig::small(tok.vocab_size());
    cfg.initializer_range = 0.2;
    let dir = tempfile::tempdir().unwrap();
    Model::new(&cfg, 3, &Device::Cpu)
        .unwrap()
        .save(dir.path(), Some(&tok))
        .unwrap();
    let prompts: Vec<Vec<u32>> = [
        "Turn 1:\nState:\nP_O_\n__G_",
        "You are solving the FrozenLake puzzle.",
        "hi",
    ]
    .iter()
    .map(|t| ChatTemplate.user_turn(&tok, t).unwrap())
    .collect();
    // The rollout engine, its prefix cache off: each prompt prefilled, then decoded.
    let run = |device: &Device, precision: Precision| {
        let mut model = Model::load(dir.path(), device).unwrap();
        model.set_rollout_precision(precision).unwrap();
        let cfg = EngineConfig {
            cache_mode: CacheMode::None,
            num_slots: 512,
            ..EngineConfig::default()
        };
        let requests: Vec<GenRequest> = prompts
            .iter()
            .zip(0u64..)
            .map(|(p, i)| GenRequest::plain(p.clone(), SamplingParams::greedy(), i, 8))
            .collect();
        Engine::for_model(&model, cfg)
            .unwrap()
            .generate(&model, &tok, &requests)
            .unwrap()
    };
    for (precision, bound) in [(Precision::F32, 1e-4), (Precision::Bf16, 2e-2)] {
        let cpu = run(&Device::Cpu, precision);
        let gpu = run(&dev, precision);
        let mut worst = 0f32;
        for (c, g) in cpu.iter().zip(&gpu) {
            assert_eq!(c.tokens, g.tokens, "{precision}: greedy tokens differ");
            for (a, b) in c.logprobs.iter().zip(&g.logprobs) {
                worst = worst.max((a - b).abs());
            }
        }
        eprintln!("{precision}: CUDA vs CPU max |Δ log-prob| {worst:.2e}");
        assert!(worst <= bound, "{precision}: {worst} > {bound}");
    }
}

/// stepppo's CUDA bf16 decode against transformers' bf16 on the same GPU, on the tokens
/// transformers sampled there (`scripts/make_bf16_generation_fixtures.py --device cuda --out DIR`,
/// then `STEPPPO_TRANSFORMERS_GPU_FIXTURES=DIR`; `scripts/gpu_check.sh` does both), held to the
/// bound the CPU test holds against transformers on the CPU. A family whose fixture has heads
/// too narrow for the CUDA kernels is checked on the variant the script saved beside its tokens
/// (`DIR/<model>/model`, 32-wide heads).
#[test]
fn cuda_bf16_generation_matches_transformers_bf16_on_the_gpu() {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("skipped: no CUDA device");
        return;
    };
    let Some(gpu_fixtures) = std::env::var_os("STEPPPO_TRANSFORMERS_GPU_FIXTURES") else {
        eprintln!("skipped: STEPPPO_TRANSFORMERS_GPU_FIXTURES is not set");
        return;
    };
    // Where the test was built, or (a test binary carried to a GPU machine) under the working
    // directory.
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf");
    let models = if built.is_dir() {
        built
    } else {
        std::path::PathBuf::from("tests/fixtures/hf")
    };
    for name in ["qwen2", "qwen3", "llama3"] {
        let path = std::path::Path::new(&gpu_fixtures)
            .join(name)
            .join("bf16_generation.json");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let ids = |key: &str| -> Vec<u32> {
            json[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect()
        };
        let want: Vec<f32> = json["logprobs_bf16"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let (prompt, tokens) = (ids("prompt"), ids("tokens"));
        let variant = path.with_file_name("model");
        let dir = if variant.join("config.json").is_file() {
            variant
        } else {
            models.join(name)
        };
        let mut model = Model::load(&dir, &dev).unwrap();
        let width = model.config().head_dim();
        assert!(
            stepppo::kv::cuda::SUPPORTED_HEAD_DIMS.contains(&width),
            "{name}: {} has {width}-wide heads, which the CUDA kernels do not run; \
             make the fixtures again with scripts/make_bf16_generation_fixtures.py --device cuda",
            dir.display()
        );
        model.set_rollout_precision(Precision::Bf16).unwrap();
        let mut pool = KvPool::with_dtype(
            model.config(),
            prompt.len() + tokens.len(),
            &dev,
            Precision::Bf16.dtype(),
        )
        .unwrap();
        let got = forced_logprobs(&model, &mut pool, &prompt, &tokens).unwrap();
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{name}: CUDA bf16 vs transformers bf16 (GPU) max |Δ log-prob| {worst:.2e}");
        assert!(worst <= 0.05, "{name}: {worst}");
    }
}
