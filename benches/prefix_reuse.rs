//! Prefix reuse over multi-turn group workloads: four arms (none / per_traj / group_prompt /
//! radix) and radix without cascade attention (radix_no_cascade), tokens prefilled and hit ratio next to the theoretical minimum X = P + G·(T−1)·O and
//! the stateless total S, rollout wall time, speedup vs no cache and the FLOP-ratio limit.
//! `cargo bench --bench prefix_reuse`. The table covers every standard workload; criterion then
//! times each arm of `frozen_lake` and `long_prompt`.

use candle_core::Device;
use criterion::{criterion_group, criterion_main, Criterion};
use stepppo::model::{Model, ModelConfig};
use stepppo::rollout::engine::{CacheMode, Engine, EngineConfig};
use stepppo::rollout::workload::{compare_arms, run_workload, ArmReport, Workload};
use stepppo::tokenizer::Tokenizer;

const SEED: u64 = 0;

fn table(model: &Model, tok: &Tokenizer) {
    println!("{}", ArmReport::table_header());
    for w in Workload::standard() {
        let rows = compare_arms(model, tok, &w, &EngineConfig::default(), SEED, &mut |r| {
            println!("{}", r.table_row())
        })
        .expect("workload runs");
        let radix = rows.iter().find(|r| r.arm == "radix").expect("radix arm");
        let slack = (w.groups * w.group_size * (w.turns - 1)) as f64;
        let within = radix.tokens_prefilled as f64 <= 1.02 * radix.theoretical_min as f64 + slack;
        println!(
            "  radix prefilled within 2% (+1/traj/turn) of X: {within}; speedup {:.2}× vs FLOP limit {:.2}×",
            radix.speedup_vs_none, radix.flop_ratio_vs_none
        );
    }
}

fn bench(c: &mut Criterion) {
    // The `stepppo` binary's process settings (the thread count fixed once, the allocator).
    stepppo::device::prepare_cpu_process();
    let tok = Tokenizer::builtin();
    let cfg = ModelConfig::small(tok.vocab_size());
    let model = Model::new(&cfg, SEED, &Device::Cpu).expect("built-in model");
    table(&model, &tok);
    for w in Workload::standard()
        .into_iter()
        .filter(|w| w.name == "frozen_lake" || w.name == "long_prompt")
    {
        let mut group = c.benchmark_group(format!("prefix_reuse/{}", w.name));
        group.sample_size(10);
        for mode in CacheMode::ALL {
            let engine_cfg = EngineConfig {
                cache_mode: mode,
                ..EngineConfig::default()
            };
            let mut engine = Engine::new(&cfg, engine_cfg, &Device::Cpu).expect("engine");
            group.bench_function(mode.name(), |b| {
                b.iter(|| run_workload(&mut engine, &model, &tok, &w, SEED).expect("workload runs"))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
