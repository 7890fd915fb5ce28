//! Synthetic multi-turn group workloads for measuring prefix reuse (reference.md §6.7–6.8): each
//! group shares a P-token prompt, every trajectory generates exactly R tokens per turn (no stop
//! conditions) and then receives O fresh observation tokens, for T turns. Because the shapes are
//! exact, the theoretical columns (stateless total S, radix minimum X) are exact too. Used by
//! `benches/prefix_reuse.rs`, `stepppo bench prefix` and the rollout tests.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::model::{Model, ModelConfig};
use crate::rollout::engine::{
    CacheCounters, CacheMode, Engine, EngineConfig, GenRequest, Generation, Result,
};
use crate::rollout::sampling::SamplingParams;
use crate::seed;
use crate::tokenizer::Tokenizer;

/// Shape of a workload.
#[derive(Clone, Debug, Serialize)]
pub struct Workload {
    /// Name in reports (e.g. `frozen_lake_g8_t8`).
    pub name: String,
    /// Groups, each with its own random prompt.
    pub groups: usize,
    /// Trajectories per group (G).
    pub group_size: usize,
    /// Turns per trajectory (T).
    pub turns: usize,
    /// Prompt tokens shared by a group (the first observation included).
    pub prompt_len: usize,
    /// Observation tokens appended after each response.
    pub obs_len: usize,
    /// Tokens generated per turn.
    pub response_len: usize,
}

impl Workload {
    /// FrozenLake-like short turns and a long-prompt QA-like case, at a few G and T.
    pub fn standard() -> Vec<Workload> {
        vec![
            Workload::new("frozen_lake", 2, 4, 5, 192, 48, 24),
            Workload::new("frozen_lake_g8_t8", 2, 8, 8, 192, 48, 24),
            Workload::new("long_prompt", 1, 8, 4, 1024, 32, 16),
            Workload::new("long_prompt_g4_t6", 1, 4, 6, 1024, 32, 16),
        ]
    }

    /// A workload `name` of `groups` groups of `g` trajectories, `t` turns, `p` prompt,
    /// `o` observation and `r` response tokens.
    pub fn new(
        name: &str,
        groups: usize,
        g: usize,
        t: usize,
        p: usize,
        o: usize,
        r: usize,
    ) -> Self {
        Self {
            name: name.to_string(),
            groups,
            group_size: g,
            turns: t,
            prompt_len: p,
            obs_len: o,
            response_len: r,
        }
    }

    /// Fewest tokens any engine must prefill: per group P + G·(T−1)·O.
    pub fn theoretical_min(&self) -> u64 {
        let (p, g, t, o) = self.pgto();
        self.groups as u64 * (p + g * (t - 1) * o)
    }

    /// What a stateless engine prefills: per group G·[T·P + (R+O)·T(T−1)/2].
    pub fn stateless_total(&self) -> u64 {
        let (p, g, t, o) = self.pgto();
        let r = self.response_len as u64;
        self.groups as u64 * g * (t * p + (r + o) * t * (t - 1) / 2)
    }

    /// The radix engine's exact count: the minimum plus one token per trajectory per later turn
    /// (the last sampled token of a turn has no K/V until the next turn feeds it).
    pub fn radix_expected(&self) -> u64 {
        let (_, g, t, _) = self.pgto();
        self.theoretical_min() + self.groups as u64 * g * (t - 1)
    }

    fn pgto(&self) -> (u64, u64, u64, u64) {
        (
            self.prompt_len as u64,
            self.group_size as u64,
            self.turns as u64,
            self.obs_len as u64,
        )
    }
}

/// Result of running a workload once.
pub struct WorkloadRun {
    /// The engine's cache counters over the run.
    pub counters: CacheCounters,
    /// Wall-clock seconds of generation (cache flush excluded).
    pub wall_s: f64,
    /// Generations per turn, in (group, member) order.
    pub turns: Vec<Vec<Generation>>,
}

/// Runs `w` on `engine` (its cache mode is the arm) from an empty cache, sampling at
/// temperature 1 with per-trajectory seeds derived from `base_seed`.
pub fn run_workload(
    engine: &mut Engine,
    model: &Model,
    tok: &Tokenizer,
    w: &Workload,
    base_seed: u64,
) -> Result<WorkloadRun> {
    engine.flush()?;
    engine.take_counters();
    let vocab = model.config().vocab_size as u32;
    let mut contexts: Vec<Vec<u32>> = (0..w.groups)
        .flat_map(|g| {
            let prompt = random_tokens(seed::derive(base_seed, &[g as u64]), w.prompt_len, vocab);
            std::iter::repeat_n(prompt, w.group_size)
        })
        .collect();
    let start = Instant::now();
    let mut turns = Vec::with_capacity(w.turns);
    for turn in 0..w.turns {
        let requests: Vec<GenRequest> = contexts
            .iter()
            .enumerate()
            .map(|(i, ctx)| request(w, ctx, i, turn, base_seed))
            .collect();
        let gens = engine.generate(model, tok, &requests)?;
        for (i, (ctx, gen)) in contexts.iter_mut().zip(&gens).enumerate() {
            ctx.extend_from_slice(&gen.tokens);
            let obs_seed = seed::derive(base_seed, &[i as u64, turn as u64, 0x0B5]);
            ctx.extend(random_tokens(obs_seed, w.obs_len, vocab));
        }
        turns.push(gens);
    }
    Ok(WorkloadRun {
        counters: engine.take_counters(),
        wall_s: start.elapsed().as_secs_f64(),
        turns,
    })
}

fn request(w: &Workload, ctx: &[u32], i: usize, turn: usize, base_seed: u64) -> GenRequest {
    GenRequest {
        tokens: ctx.to_vec(),
        traj: i as u64,
        group: (i / w.group_size) as u64,
        turn: turn as u32,
        params: SamplingParams::default(),
        seed: seed::derive(base_seed, &[i as u64, turn as u64]),
        max_new_tokens: w.response_len,
        stop_token_ids: Vec::new(),
        stop_strings: Vec::new(),
        grammar: None,
    }
}

fn random_tokens(seed: u64, n: usize, vocab: u32) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab)).collect()
}

/// Forward FLOPs of a run from its counters: linear layers per computed token, attention per
/// attended (query, key) pair, and the LM head per logits row.
pub fn forward_flops(cfg: &ModelConfig, c: &CacheCounters) -> f64 {
    let d = cfg.hidden_size as f64;
    let hd = cfg.head_dim() as f64;
    let q = cfg.num_attention_heads as f64 * hd;
    let kv = cfg.num_key_value_heads as f64 * hd;
    let per_layer = d * q + 2.0 * d * kv + q * d + 3.0 * d * cfg.intermediate_size as f64;
    let layers = cfg.num_hidden_layers as f64;
    let linear = 2.0 * per_layer * layers * c.tokens_computed as f64;
    let attention = 4.0 * q * layers * c.attended_pairs as f64;
    let head = 2.0 * d * cfg.vocab_size as f64 * c.logit_rows as f64;
    linear + attention + head
}

/// One arm of one workload: the columns of the prefix-reuse table.
#[derive(Clone, Debug, Serialize)]
pub struct ArmReport {
    /// Name of the workload.
    pub workload: String,
    /// Cache mode of the arm (`none`, `per_traj`, `group_prompt`, `radix`).
    pub arm: &'static str,
    /// Groups in the workload.
    pub groups: usize,
    /// Trajectories per group (G).
    pub group_size: usize,
    /// Turns per trajectory (T).
    pub turns: usize,
    /// Shared prompt tokens per group (P).
    pub prompt_len: usize,
    /// Observation tokens appended after each response (O).
    pub obs_len: usize,
    /// Tokens generated per turn (R).
    pub response_len: usize,
    /// Context tokens requested (the stateless equivalent).
    pub prompt_tokens: u64,
    /// Context tokens the engine had to prefill.
    pub tokens_prefilled: u64,
    /// Context tokens served from the prefix cache.
    pub tokens_from_cache: u64,
    /// `tokens_from_cache / prompt_tokens` (0 when nothing was requested).
    pub hit_ratio: f64,
    /// Tokens sampled.
    pub decode_tokens: u64,
    /// Fewest tokens any engine must prefill ([`Workload::theoretical_min`]).
    pub theoretical_min: u64,
    /// What a stateless engine prefills ([`Workload::stateless_total`]).
    pub stateless_total: u64,
    /// Most KV-pool slots (one per cached token) in use at once.
    pub peak_slots_used: u64,
    /// Times cached prefixes were evicted to free slots.
    pub evictions: u64,
    /// Wall-clock seconds of the run.
    pub wall_s: f64,
    /// Of the wall time, seconds in model forward calls (the rest: sampling, the tree, the
    /// engine's bookkeeping).
    pub forward_s: f64,
    /// Of the forward time, seconds in decode calls (every sequence brings one token).
    pub decode_s: f64,
    /// Forward calls.
    pub forward_calls: u64,
    /// Decode calls.
    pub decode_calls: u64,
    /// Wall time of the `none` arm over this arm's.
    pub speedup_vs_none: f64,
    /// Forward FLOPs of the `none` arm over this arm's: the speedup limit of compute-bound runs.
    pub flop_ratio_vs_none: f64,
    /// The kernel that ran prefill attention (CUDA; a CPU pool has one kernel).
    pub prefill_attention: crate::kv::PrefillAttention,
    /// Whether cascade attention read shared context once per forward (CPU pools).
    pub cascade_attention: bool,
}

impl ArmReport {
    /// Header of the human-readable table (`stepppo bench prefix`, `cargo bench --bench prefix_reuse`).
    pub fn table_header() -> String {
        format!(
            "{:<18} {:<16} {:>3} {:>2} {:>9} {:>9} {:>9} {:>6} {:>9} {:>9} {:>8} {:>7} {:>7}",
            "workload",
            "arm",
            "G",
            "T",
            "requested",
            "prefilled",
            "cached",
            "hit",
            "min X",
            "stateless",
            "wall_s",
            "speedup",
            "flop×"
        )
    }

    /// This arm as a row under [`ArmReport::table_header`].
    pub fn table_row(&self) -> String {
        format!(
        "{:<18} {:<16} {:>3} {:>2} {:>9} {:>9} {:>9} {:>5.1}% {:>9} {:>9} {:>8.3} {:>6.2}× {:>6.2}×",
        self.workload,
        self.arm,
        self.group_size,
        self.turns,
        self.prompt_tokens,
        self.tokens_prefilled,
        self.tokens_from_cache,
        100.0 * self.hit_ratio,
        self.theoretical_min,
        self.stateless_total,
        self.wall_s,
        self.speedup_vs_none,
        self.flop_ratio_vs_none
    )
    }
}

/// Runs `w` under every cache mode (same weights, seeds and inputs) on a fresh engine per arm,
/// the cache-free arm first; `on_arm` sees each arm's report as soon as it finishes (a long
/// workload shows its first figures before the last arm ends).
pub fn compare_arms(
    model: &Model,
    tok: &Tokenizer,
    w: &Workload,
    engine_cfg: &EngineConfig,
    base_seed: u64,
    on_arm: &mut dyn FnMut(&ArmReport),
) -> Result<Vec<ArmReport>> {
    let mut reports = Vec::new();
    let mut none: Option<(f64, f64)> = None;
    // Every cache mode under the given settings; with cascade attention on, radix once more
    // without it, so the two kernels sit side by side on the same inputs.
    let flat =
        engine_cfg
            .cascade_attention
            .then_some(("radix_no_cascade", CacheMode::Radix, false));
    let arms = (CacheMode::ALL.into_iter())
        .map(|mode| (mode.name(), mode, engine_cfg.cascade_attention))
        .chain(flat);
    for (arm, mode, cascade_attention) in arms {
        let cfg = EngineConfig {
            cache_mode: mode,
            cascade_attention,
            ..engine_cfg.clone()
        };
        let mut engine = Engine::for_model(model, cfg)?;
        let run = run_workload(&mut engine, model, tok, w, base_seed)?;
        let flops = forward_flops(model.config(), &run.counters);
        let (none_wall, none_flops) = *none.get_or_insert((run.wall_s, flops));
        let c = &run.counters;
        let report = ArmReport {
            workload: w.name.clone(),
            arm,
            groups: w.groups,
            group_size: w.group_size,
            turns: w.turns,
            prompt_len: w.prompt_len,
            obs_len: w.obs_len,
            response_len: w.response_len,
            prompt_tokens: c.prompt_tokens,
            tokens_prefilled: c.tokens_prefilled,
            prefill_attention: engine_cfg.prefill_attention,
            cascade_attention,
            tokens_from_cache: c.tokens_from_cache,
            hit_ratio: c.hit_ratio(),
            decode_tokens: c.decode_tokens,
            theoretical_min: w.theoretical_min(),
            stateless_total: w.stateless_total(),
            peak_slots_used: c.peak_slots_used,
            evictions: c.evictions,
            wall_s: run.wall_s,
            forward_s: c.forward_s,
            decode_s: c.decode_s,
            forward_calls: c.forward_calls,
            decode_calls: c.decode_calls,
            speedup_vs_none: none_wall / run.wall_s,
            flop_ratio_vs_none: none_flops / flops,
        };
        on_arm(&report);
        reports.push(report);
    }
    Ok(reports)
}

/// The decode phase of one workload run against its memory-traffic limit: every decode call
/// reads the rollout weights once and the K/V of every position its tokens attend to (shared
/// positions once under cascade attention); at `bandwidth` bytes/s that traffic bounds the
/// decode rate.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeReport {
    /// Name of the workload.
    pub workload: String,
    /// Whether cascade attention ran.
    pub cascade_attention: bool,
    /// Tokens the decode calls computed (one per sequence per call).
    pub decode_tokens: u64,
    /// Seconds in decode calls.
    pub decode_s: f64,
    /// `decode_tokens / decode_s`.
    pub tokens_per_s: f64,
    /// Bytes of weights the decode calls read (the rollout copy, once per call).
    pub weight_bytes: f64,
    /// Bytes of K/V the decode calls read.
    pub kv_bytes: f64,
    /// The memory bandwidth the limit assumes, bytes/s.
    pub bandwidth: f64,
    /// Decode tokens/s if the calls moved their bytes at `bandwidth` and did nothing else.
    pub traffic_limit_tokens_per_s: f64,
}

impl DecodeReport {
    /// The decode figures of `run` on `model` under `bandwidth` bytes/s.
    pub fn new(
        w: &Workload,
        model: &Model,
        run: &WorkloadRun,
        cascade_attention: bool,
        bandwidth: f64,
    ) -> Self {
        let cfg = model.config();
        let c = &run.counters;
        let value_bytes = match model.device() {
            candle_core::Device::Cpu => 4.0, // the CPU pool keeps f32 rows
            _ => model.rollout_precision().dtype().size_in_bytes() as f64,
        };
        let weight_count: usize = (Model::param_shapes(cfg).iter())
            .map(|(_, shape)| shape.iter().product::<usize>())
            .sum();
        let weight_bytes = c.decode_calls as f64
            * weight_count as f64
            * model.rollout_precision().dtype().size_in_bytes() as f64;
        let row = (cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim()) as f64;
        let positions = (c.decode_positions - c.decode_positions_saved) as f64;
        let kv_bytes = positions * row * 2.0 * value_bytes;
        let decode_tokens = c.decode_call_tokens;
        Self {
            workload: w.name.clone(),
            cascade_attention,
            decode_tokens,
            decode_s: c.decode_s,
            tokens_per_s: decode_tokens as f64 / c.decode_s,
            weight_bytes,
            kv_bytes,
            bandwidth,
            traffic_limit_tokens_per_s: decode_tokens as f64 * bandwidth
                / (weight_bytes + kv_bytes),
        }
    }
}

/// This machine's memory read bandwidth in bytes/s: the best of five parallel sums over a
/// 256 MiB buffer (larger than any cache), on the rayon pool the CPU kernels use.
pub fn read_bandwidth() -> f64 {
    use rayon::prelude::*;
    let buffer = vec![1.0f32; 64 << 20];
    (0..5)
        .map(|_| {
            let t = Instant::now();
            let sum: f32 = buffer
                .par_chunks(1 << 16)
                .map(|c| c.iter().sum::<f32>())
                .sum();
            std::hint::black_box(sum);
            (buffer.len() * 4) as f64 / t.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max)
}
