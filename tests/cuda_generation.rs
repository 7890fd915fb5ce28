//! GPU test (feature `cuda`): the whole incremental path on CUDA (weights, KV pool and our
//! kernels) against the CPU path on the same weights in the same dtype — in f32, identical
//! greedy tokens and log-probs within 1e-4; in bf16 (both devices rounding where transformers
//! rounds), identical greedy tokens and log-probs within bf16 tolerance. Skips (and passes)
//! without a CUDA device.
#![cfg(feature = "cuda")]

use candle_core::Device;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use stepppo::kv::KvPool;
use stepppo::model::{Model, ModelConfig, Precision};
use stepppo::rollout::generate;
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
    let run = |device: &Device, precision: Precision| {
        let mut model = Model::load(dir.path(), device).unwrap();
        model.set_rollout_precision(precision).unwrap();
        let mut pool = KvPool::with_dtype(model.config(), 512, device, precision.dtype()).unwrap();
        let mut rngs: Vec<ChaCha8Rng> = (0..prompts.len())
            .map(|i| ChaCha8Rng::seed_from_u64(i as u64))
            .collect();
        generate(
            &model,
            &mut pool,
            &prompts,
            8,
            &SamplingParams::greedy(),
            &mut rngs,
            None,
        )
        .unwrap()
    };
    for (precision, bound) in [(Precision::F32, 1e-4), (Precision::Bf16, 2e-2)] {
        let cpu = run(&Device::Cpu, precision);
        let gpu = run(&dev, precision);
        let mut worst = 0f32;
        for (c, g) in cpu.iter().zip(&gpu) {
            assert_eq!(
                c.output_ids, g.output_ids,
                "{precision}: greedy tokens differ"
            );
            for (a, b) in c.logprobs.iter().zip(&g.logprobs) {
                worst = worst.max((a - b).abs());
            }
        }
        eprintln!("{precision}: CUDA vs CPU max |Δ log-prob| {worst:.2e}");
        assert!(worst <= bound, "{precision}: {worst} > {bound}");
    }
}
