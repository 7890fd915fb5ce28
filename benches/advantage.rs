//! Estimator throughput on 100k step rows (all estimators in one run):
//! 2,500 groups × 8 trajectories × 5 steps, 16 response tokens per step.
//! Run: `cargo bench --bench advantage`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use stepppo::algo::config::{AdvantageConfig, Estimator};
use stepppo::algo::{compute_advantages, AdvantageInputs};
use stepppo::seed::derive;
use stepppo::store::StepRecord;

const GROUPS: u64 = 2_500;
const GROUP_SIZE: u64 = 8;
const STEPS: u32 = 5;
const TOKENS: usize = 16;

/// A uniform number in [0, 1) from a seed.
fn unit(seed: u64) -> f32 {
    (seed >> 40) as f32 / (1u64 << 24) as f32
}

fn batch() -> Vec<StepRecord> {
    let mut records = Vec::with_capacity((GROUPS * GROUP_SIZE) as usize * STEPS as usize);
    for g in 0..GROUPS {
        for m in 0..GROUP_SIZE {
            let traj = g * GROUP_SIZE + m;
            for s in 0..STEPS {
                let h = derive(7, &[traj, s as u64]);
                let last = s + 1 == STEPS;
                let reward = if last {
                    f32::from(unit(h) > 0.5)
                } else {
                    -0.1 * f32::from(unit(h) > 0.8)
                };
                records.push(StepRecord {
                    traj_id: traj,
                    group_id: g,
                    step_index: s,
                    env_tag: "frozen_lake".into(),
                    response_ids: vec![1; TOKENS],
                    response_logprobs: vec![-1.0; TOKENS],
                    reward,
                    terminated: last,
                    state_hash: derive(g, &[s as u64, (unit(h) * 3.0) as u64]),
                    ..Default::default()
                });
            }
        }
    }
    records
}

fn bench_estimators(c: &mut Criterion) {
    let records = batch();
    let values: Vec<f32> = (0..records.len())
        .map(|i| unit(derive(1, &[i as u64])))
        .collect();
    let token_values: Vec<Vec<f32>> = values.iter().map(|&v| vec![v; TOKENS]).collect();
    let inputs = AdvantageInputs {
        values: Some(&values),
        token_values: Some(&token_values),
        token_reward_penalty: None,
    };
    let mut group = c.benchmark_group("advantage_100k_rows");
    group
        .throughput(Throughput::Elements(records.len() as u64))
        .sample_size(10);
    for estimator in [
        Estimator::StepGae,
        Estimator::TokenGae,
        Estimator::Reinforce,
        Estimator::DrGrpo,
        Estimator::Rloo,
        Estimator::ReinforcePlusPlus,
        Estimator::ReinforcePlusPlusBaseline,
        Estimator::Gigpo,
        Estimator::StepReinforce,
    ] {
        let cfg = AdvantageConfig {
            adv_estimator: estimator,
            gamma: 0.99,
            ..Default::default()
        };
        let name = serde_json::to_string(&estimator).unwrap().replace('"', "");
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| compute_advantages(&records, &inputs, &cfg).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, bench_estimators);
criterion_main!(benches);
