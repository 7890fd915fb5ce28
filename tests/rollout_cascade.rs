//! Cascade attention (a group's shared context read once per forward, merged per token by
//! log-sum-exp) generates what the per-token kernel generates: the same sampled and greedy
//! tokens, log-probs within 1e-5 in f32, on the CPU in f32 and bf16, with nested sharing (a
//! group's prompt shared by all members, every earlier turn by the members that forked there).

use candle_core::Device;
use stepppo::model::{Model, ModelConfig, Precision};
use stepppo::rollout::engine::{Engine, EngineConfig, GenRequest};
use stepppo::rollout::sampling::SamplingParams;
use stepppo::rollout::workload::{run_workload, Workload, WorkloadRun};
use stepppo::tokenizer::Tokenizer;

fn model(precision: Precision) -> (Model, Tokenizer) {
    let tok = Tokenizer::builtin();
    let cfg = ModelConfig::tiny(tok.vocab_size());
    let mut model = Model::new(&cfg, 23, &Device::Cpu).unwrap();
    model.set_rollout_precision(precision).unwrap();
    (model, tok)
}

fn engine(model: &Model, cascade_attention: bool) -> Engine {
    let cfg = EngineConfig {
        cascade_attention,
        prefill_chunk: 128,
        ..EngineConfig::default()
    };
    Engine::for_model(model, cfg).unwrap()
}

/// Two groups of four, a 300-token prompt (more than one key block) and 4 turns of 8 sampled
/// tokens: 256 sampled tokens.
fn sampled(precision: Precision, cascade: bool) -> WorkloadRun {
    let (model, tok) = model(precision);
    let w = Workload::new("cascade", 2, 4, 4, 300, 6, 8);
    run_workload(&mut engine(&model, cascade), &model, &tok, &w, 7).unwrap()
}

fn worst_logprob_gap(a: &WorkloadRun, b: &WorkloadRun) -> (usize, f32) {
    let pairs = (a.turns.iter().flatten()).zip(b.turns.iter().flatten());
    let mut sampled = 0;
    let mut worst = 0f32;
    for (x, y) in pairs {
        assert_eq!(x.tokens, y.tokens, "sampled tokens differ");
        sampled += x.tokens.len();
        for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
            worst = worst.max((p - q).abs());
        }
    }
    (sampled, worst)
}

#[test]
fn sampled_tokens_and_logprobs_agree_with_the_per_token_kernel_in_f32() {
    let (on, off) = (
        sampled(Precision::F32, true),
        sampled(Precision::F32, false),
    );
    let (n, worst) = worst_logprob_gap(&on, &off);
    assert_eq!(n, 256);
    eprintln!("f32: {n} sampled tokens, max |Δ log-prob| {worst:.2e}");
    assert!(worst <= 1e-5, "max |Δ log-prob| {worst}");
}

#[test]
fn sampled_tokens_agree_with_the_per_token_kernel_in_bf16() {
    let (on, off) = (
        sampled(Precision::Bf16, true),
        sampled(Precision::Bf16, false),
    );
    let (n, worst) = worst_logprob_gap(&on, &off);
    assert_eq!(n, 256);
    eprintln!("bf16: {n} sampled tokens, max |Δ log-prob| {worst:.2e}");
    // The CPU attention runs in f32 over bf16 K/V either way; the outputs round to bf16 after
    // it, so a one-ulp f32 difference rarely moves a bf16 value (4.3e-6 measured).
    assert!(worst <= 1e-4, "max |Δ log-prob| {worst}");
}

#[test]
fn greedy_tokens_are_identical() {
    let (model, tok) = model(Precision::F32);
    // Four requests share a 400-token prompt and differ in their last three tokens.
    let prompt: Vec<u32> = (0..400u32).map(|i| 5 + (i * 37) % 200).collect();
    let requests: Vec<GenRequest> = (0..4u32)
        .map(|i| {
            let tokens = [&prompt[..], &[7 + i, 9 + i, 11 + i]].concat();
            GenRequest {
                traj: i.into(),
                ..GenRequest::plain(tokens, SamplingParams::greedy(), i.into(), 32)
            }
        })
        .collect();
    let mut runs = [true, false].map(|cascade| {
        let mut engine = engine(&model, cascade);
        let out = engine.generate(&model, &tok, &requests).unwrap();
        // Every decode call reads the prompt once for the four sequences: 3 × 400 positions.
        let saved = engine.counters().shared_positions_saved;
        assert_eq!(saved >= 31 * 3 * 400, cascade, "{saved} positions saved");
        out
    });
    let [on, off] = &mut runs;
    for (a, b) in on.iter().zip(off.iter()) {
        assert_eq!(a.tokens, b.tokens);
        let worst =
            (a.logprobs.iter().zip(&b.logprobs)).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst <= 1e-5, "max |Δ log-prob| {worst}");
    }
}
