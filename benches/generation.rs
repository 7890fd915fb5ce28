//! Generation and training-path throughput of the built-in `small` model on CPU: greedy decoding
//! through the rollout engine without its prefix cache at batch 1 and 32 (tokens generated per
//! second, prefill included), and forward+backward of the training path over a padded batch
//! (tokens per second).

use std::hint::black_box;

use candle_core::Device;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use stepppo::model::checkpoint::builtin_policy;
use stepppo::model::PaddedBatch;
use stepppo::rollout::engine::{CacheMode, Engine, EngineConfig, GenRequest};
use stepppo::rollout::sampling::SamplingParams;
use stepppo::tokenizer::ChatTemplate;

const NEW_TOKENS: usize = 32;

fn bench_generation(c: &mut Criterion) {
    // The `stepppo` binary's process settings (the thread count fixed once, the allocator).
    stepppo::device::prepare_cpu_process();
    let (model, tok) = builtin_policy(&Device::Cpu).unwrap();
    let prompt = ChatTemplate
        .user_turn(
            &tok,
            "You are solving the FrozenLake puzzle.\nTurn 1:\nState:\nP_O_\n__G_",
        )
        .unwrap();
    let mut group = c.benchmark_group("generation");
    group.sample_size(10);
    for batch in [1usize, 32] {
        // Every prompt prefilled on its own (no cache), as the plain generation measured before.
        let cfg = EngineConfig {
            cache_mode: CacheMode::None,
            num_slots: batch * (prompt.len() + NEW_TOKENS),
            ..EngineConfig::default()
        };
        let mut engine = Engine::for_model(&model, cfg).unwrap();
        let requests: Vec<GenRequest> = (0..batch as u64)
            .map(|i| GenRequest::plain(prompt.clone(), SamplingParams::greedy(), i, NEW_TOKENS))
            .collect();
        group.throughput(Throughput::Elements((batch * NEW_TOKENS) as u64));
        group.bench_function(format!("greedy_batch{batch}"), |b| {
            b.iter(|| black_box(engine.generate(&model, &tok, &requests).unwrap()))
        });
    }
    group.finish();
}

fn bench_training_path(c: &mut Criterion) {
    let (model, _) = builtin_policy(&Device::Cpu).unwrap();
    let (b_sz, t_len) = (8usize, 128usize);
    let seqs: Vec<Vec<u32>> = (0..b_sz)
        .map(|s| {
            (0..t_len)
                .map(|i| ((i * 37 + s * 11) % 1000) as u32)
                .collect()
        })
        .collect();
    let batch = PaddedBatch::right_padded(&seqs, 0, &Device::Cpu).unwrap();
    let mut group = c.benchmark_group("training_path");
    group.sample_size(10);
    group.throughput(Throughput::Elements((b_sz * t_len) as u64));
    group.bench_function(format!("fwd_bwd_{b_sz}x{t_len}"), |b| {
        b.iter(|| {
            let (logp, _) = model
                .token_logprobs_entropy(
                    &batch.input_ids,
                    &batch.attention_mask,
                    &batch.input_ids,
                    1.0,
                )
                .unwrap();
            black_box(logp.sum_all().unwrap().backward().unwrap())
        })
    });
    group.finish();
}

criterion_group!(benches, bench_generation, bench_training_path);
criterion_main!(benches);
