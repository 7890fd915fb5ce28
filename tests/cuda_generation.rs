//! GPU test (feature `cuda`): the whole incremental path on CUDA (bf16 weights and KV pool, our
//! kernels) against the CPU f32 path on the same weights — identical greedy tokens for short
//! outputs and log-probs within bf16 tolerance. Skips (and passes) without a CUDA device.
#![cfg(feature = "cuda")]

use candle_core::Device;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use stepppo::kv::KvPool;
use stepppo::model::{Model, ModelConfig};
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
    let run = |device: &Device| {
        let model = Model::load(dir.path(), device).unwrap();
        let mut pool = KvPool::new(model.config(), 512, device).unwrap();
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
    let cpu = run(&Device::Cpu);
    let gpu = run(&dev);
    for (c, g) in cpu.iter().zip(&gpu) {
        assert_eq!(c.output_ids, g.output_ids, "greedy tokens differ");
        for (a, b) in c.logprobs.iter().zip(&g.logprobs) {
            assert!((a - b).abs() < 2e-2, "log-prob {a} (cpu) vs {b} (cuda)");
        }
    }
}
