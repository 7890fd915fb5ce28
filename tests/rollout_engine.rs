//! Rollout engine: the radix cache changes what is computed, never what is generated.

use candle_core::Device;
use stepppo::model::{Model, ModelConfig};
use stepppo::rollout::engine::{
    CacheMode, Engine, EngineConfig, GenRequest, Generation, GenerationFeed,
};
use stepppo::rollout::sampling::SamplingParams;
use stepppo::rollout::workload::{run_workload, Workload, WorkloadRun};
use stepppo::tokenizer::Tokenizer;

fn run(mode: CacheMode, w: &Workload, num_slots: usize) -> WorkloadRun {
    let tok = Tokenizer::builtin();
    let cfg = ModelConfig::tiny(tok.vocab_size());
    let model = Model::new(&cfg, 11, &Device::Cpu).unwrap();
    let engine_cfg = EngineConfig {
        cache_mode: mode,
        num_slots,
        prefill_chunk: 24,
        max_batch_tokens: 64,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(&cfg, engine_cfg, &Device::Cpu).unwrap();
    run_workload(&mut engine, &model, &tok, w, 5).unwrap()
}

#[test]
fn every_cache_mode_generates_the_same_tokens_and_logprobs() {
    let w = Workload::new("exactness", 2, 3, 3, 40, 6, 5);
    let reference = run(CacheMode::None, &w, 4096);
    for mode in [CacheMode::PerTraj, CacheMode::GroupPrompt, CacheMode::Radix] {
        let got = run(mode, &w, 4096);
        for (turn, (a, b)) in reference.turns.iter().zip(&got.turns).enumerate() {
            for (i, (ga, gb)) in a.iter().zip(b).enumerate() {
                assert_eq!(ga.tokens, gb.tokens, "{mode:?} turn {turn} trajectory {i}");
                let worst = ga
                    .logprobs
                    .iter()
                    .zip(&gb.logprobs)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    worst < 1e-4,
                    "{mode:?} turn {turn} trajectory {i}: |Δlogprob| {worst}"
                );
            }
        }
    }
}

#[test]
fn prefill_counts_match_the_theory_of_each_arm() {
    let w = Workload::new("counts", 2, 3, 3, 40, 6, 5);
    let (groups, g, t, p, o, r) = (2u64, 3u64, 3u64, 40u64, 6u64, 5u64);
    let expected = [
        (CacheMode::None, w.stateless_total()),
        (CacheMode::PerTraj, groups * g * (p + (t - 1) * (o + 1))),
        (
            CacheMode::GroupPrompt,
            groups * (p + g * (r + o) * t * (t - 1) / 2),
        ),
        (CacheMode::Radix, w.radix_expected()),
    ];
    for (mode, prefilled) in expected {
        let c = run(mode, &w, 4096).counters;
        assert_eq!(c.tokens_prefilled, prefilled, "{mode:?}");
        assert_eq!(c.prompt_tokens, w.stateless_total(), "{mode:?}");
        assert_eq!(
            c.tokens_prefilled + c.tokens_from_cache,
            c.prompt_tokens,
            "{mode:?}"
        );
        assert_eq!(c.decode_tokens, groups * g * t * r, "{mode:?}");
    }
}

#[test]
fn a_small_pool_evicts_and_still_generates_the_same() {
    let w = Workload::new("evict", 2, 2, 3, 30, 4, 4);
    let roomy = run(CacheMode::Radix, &w, 4096);
    let tight = run(CacheMode::Radix, &w, 90);
    assert!(tight.counters.evictions > 0 && tight.counters.evicted_tokens > 0);
    assert!(tight.counters.peak_slots_used <= 90);
    for (a, b) in roomy.turns.iter().zip(&tight.turns) {
        for (ga, gb) in a.iter().zip(b) {
            assert_eq!(ga.tokens, gb.tokens);
        }
    }
}

#[test]
fn requests_arriving_together_share_an_uncached_head() {
    use stepppo::rollout::engine::GenRequest;
    use stepppo::rollout::sampling::SamplingParams;
    let tok = Tokenizer::builtin();
    let cfg = ModelConfig::tiny(tok.vocab_size());
    let model = Model::new(&cfg, 11, &Device::Cpu).unwrap();
    let mut engine = Engine::new(&cfg, EngineConfig::default(), &Device::Cpu).unwrap();
    let head: Vec<u32> = (0..60).map(|i| 100 + i).collect();
    let requests: Vec<GenRequest> = (0..3u32)
        .map(|i| GenRequest {
            tokens: head.iter().copied().chain([500 + i, 600 + i]).collect(),
            traj: i as u64,
            group: i as u64,
            turn: 0,
            params: SamplingParams::default(),
            seed: i as u64,
            max_new_tokens: 3,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            grammar: None,
        })
        .collect();
    let gens = engine.generate(&model, &tok, &requests).unwrap();
    assert_eq!(gens[0].prefilled, 62);
    for g in &gens[1..] {
        assert_eq!((g.from_cache, g.prefilled), (60, 2));
    }
    assert_eq!(engine.counters().tokens_prefilled, 66);
}

/// A feed that adds one request before each of the first forward calls.
struct Staggered {
    pending: Vec<GenRequest>,
    tokens: Vec<Vec<u32>>,
    done: Vec<Option<Generation>>,
}

impl GenerationFeed for Staggered {
    fn more(&mut self) -> Vec<GenRequest> {
        if self.pending.is_empty() {
            return Vec::new();
        }
        vec![self.pending.remove(0)]
    }

    fn token(&mut self, request: usize, token: u32, _logprob: f32) {
        self.tokens[request].push(token);
    }

    fn done(&mut self, request: usize, generation: Generation) {
        assert!(
            self.done[request].is_none(),
            "request {request} finished twice"
        );
        self.done[request] = Some(generation);
    }
}

#[test]
fn requests_joining_a_running_call_generate_what_they_generate_alone() {
    let tok = Tokenizer::builtin();
    let cfg = ModelConfig::tiny(tok.vocab_size());
    let model = Model::new(&cfg, 5, &Device::Cpu).unwrap();
    let request = |i: u64| GenRequest {
        tokens: tok.encode(&format!(
            "Turn {i}: the shared prompt of every request, then {i}"
        )),
        traj: i,
        group: 0,
        turn: 0,
        params: SamplingParams::default(),
        seed: 100 + i,
        max_new_tokens: 6 + i as usize,
        stop_token_ids: vec![tok.eos_id()],
        stop_strings: Vec::new(),
        grammar: None,
    };
    let requests: Vec<GenRequest> = (0..4).map(request).collect();
    let alone: Vec<Generation> = requests
        .iter()
        .map(|r| {
            let mut engine = Engine::new(&cfg, EngineConfig::default(), &Device::Cpu).unwrap();
            engine
                .generate(&model, &tok, std::slice::from_ref(r))
                .unwrap()
                .remove(0)
        })
        .collect();
    let mut engine = Engine::new(&cfg, EngineConfig::default(), &Device::Cpu).unwrap();
    let mut feed = Staggered {
        pending: requests.clone(),
        tokens: vec![Vec::new(); 4],
        done: vec![None; 4],
    };
    engine.generate_continuous(&model, &tok, &mut feed).unwrap();
    for (i, want) in alone.iter().enumerate() {
        let got = feed.done[i].as_ref().expect("every request finished");
        assert_eq!(got.tokens, want.tokens, "request {i}");
        assert_eq!(feed.tokens[i], want.tokens, "request {i}'s streamed tokens");
        for (a, b) in got.logprobs.iter().zip(&want.logprobs) {
            assert!((a - b).abs() < 1e-4, "request {i}: {a} vs {b}");
        }
    }
    assert!(
        engine.counters().tokens_from_cache > 0,
        "later requests reuse the shared head"
    );
}

/// A rollout thread takes new weights between batches: after `set_policy_version` nothing cached
/// under the old version is served, and what the new weights generate is what a fresh engine
/// generates with them. A snapshot of the weights does not move when the model it was taken
/// from trains.
#[test]
fn a_new_policy_version_is_never_served_the_old_versions_kv() {
    use stepppo::rollout::engine::GenRequest;
    use stepppo::rollout::sampling::SamplingParams;
    let tok = Tokenizer::builtin();
    let cfg = ModelConfig::tiny(tok.vocab_size());
    let old = Model::new(&cfg, 11, &Device::Cpu).unwrap();
    let new = Model::new(&cfg, 12, &Device::Cpu).unwrap();
    let request = GenRequest {
        tokens: (0..40).map(|i| 100 + i).collect(),
        traj: 0,
        group: 0,
        turn: 0,
        params: SamplingParams::default(),
        seed: 3,
        max_new_tokens: 4,
        stop_token_ids: Vec::new(),
        stop_strings: Vec::new(),
        grammar: None,
    };
    let engine_of = || Engine::new(&cfg, EngineConfig::default(), &Device::Cpu).unwrap();
    let mut engine = engine_of();
    engine
        .generate(&old, &tok, std::slice::from_ref(&request))
        .unwrap();
    let again = engine
        .generate(&old, &tok, std::slice::from_ref(&request))
        .unwrap();
    assert!(
        again[0].from_cache > 0,
        "the same version reuses its prefix"
    );
    engine.set_policy_version(1).unwrap();
    let switched = engine
        .generate(&new, &tok, std::slice::from_ref(&request))
        .unwrap();
    assert_eq!(switched[0].from_cache, 0);
    let fresh = engine_of().generate(&new, &tok, &[request]).unwrap();
    assert_eq!(switched[0].tokens, fresh[0].tokens);
    assert_eq!(switched[0].logprobs, fresh[0].logprobs);

    let snapshot = new.snapshot().unwrap();
    let before: Vec<f32> = snapshot.named_vars()[0]
        .1
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let (name, var) = &new.named_vars()[0];
    var.set(&var.as_tensor().affine(2.0, 1.0).unwrap()).unwrap();
    let after: Vec<f32> = snapshot.named_vars()[0]
        .1
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(before, after, "{name} moved in the snapshot");
}
