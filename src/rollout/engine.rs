//! The generation engine: continuous batching over a KV slot pool with a radix prefix cache
//! (reference.md §6). It owns the pool, the tree, the cache mode and the prefix-reuse counters;
//! it does not know about environments or chat templates (the agent loop builds the token
//! contexts). One [`Engine::generate`] call takes a batch of requests (full token contexts) and
//! runs them to completion: each waiting request is matched against the tree and locked, only its
//! unmatched suffix is computed (in chunks), requests with the same context are forked (computed
//! once, their first tokens sampled from the shared logits), and every forward call mixes prefill
//! chunks and one-token decode steps of all running sequences. Finished sequences commit their
//! tokens that have K/V to the tree, free duplicate slots and release their locks. Cached prefixes
//! live in a namespace salted with the policy version; [`Engine::set_policy_version`] also flushes.
//! [`Engine::generate_continuous`] is the same loop fed by a [`GenerationFeed`]: requests join the
//! running batch between forward calls and each is handed back the moment it finishes (the
//! gateway serves with it); `generate` is a fixed batch fed in at once.

use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::kv::radix::{NodeRef, RadixError, RadixTree};
use crate::kv::{KvError, KvPool, PrefillAttention};
use crate::model::{LogitsWanted, Model, ModelConfig, ModelError, SeqChunk};
use crate::rollout::grammar::ResponseGrammar;
use crate::rollout::sampling::{sample_allowed, SamplingParams};
use crate::seed;
use crate::tokenizer::Tokenizer;

/// Errors of the engine; request errors name the request index.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A model forward call failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The KV pool refused an operation.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The radix prefix cache refused an operation.
    #[error(transparent)]
    Radix(#[from] RadixError),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A request is malformed (empty context, or `max_new_tokens` 0).
    #[error("request {index}: {message}")]
    BadRequest {
        /// The request's number in the order requests were added.
        index: usize,
        /// What is wrong with it.
        message: String,
    },
    /// A request needs more slots than the whole pool has.
    #[error("request {index} needs {needed} KV slots (context + max_new_tokens) but the pool has {capacity}; raise num_slots")]
    PoolTooSmall {
        /// The request's number in the order requests were added.
        index: usize,
        /// Slots it needs: context plus `max_new_tokens`.
        needed: usize,
        /// Slots in the pool.
        capacity: usize,
    },
    /// The pool ran out of slots even after evicting every unlocked cached prefix.
    #[error("the KV pool ran out: {needed} slots wanted, {free} free after eviction")]
    PoolExhausted {
        /// Slots wanted.
        needed: usize,
        /// Slots free after eviction.
        free: usize,
    },
    /// A cache mode name not in [`CacheMode::ALL`].
    #[error("unknown cache mode `{0}` (expected none, per_traj, group_prompt or radix)")]
    UnknownCacheMode(String),
}

/// Result of the engine's operations.
pub type Result<T> = std::result::Result<T, EngineError>;

/// How much KV the engine reuses; the four arms of the prefix-reuse benchmark.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheMode {
    /// Stateless: every request prefills its whole context; slots are freed after each turn.
    None,
    /// A trajectory reuses its own earlier turns; nothing is shared across trajectories.
    PerTraj,
    /// Only a group's initial prompt is shared (computed once, forked); later turns recompute
    /// everything after it.
    GroupPrompt,
    /// Full radix cache: every prefix with K/V is shared, within and across groups.
    #[default]
    Radix,
}

impl CacheMode {
    /// Every cache mode, in benchmark-arm order.
    pub const ALL: [CacheMode; 4] = [
        CacheMode::None,
        CacheMode::PerTraj,
        CacheMode::GroupPrompt,
        CacheMode::Radix,
    ];

    /// The mode's name in configs and flags (`none`, `per_traj`, `group_prompt`, `radix`).
    pub fn name(self) -> &'static str {
        match self {
            CacheMode::None => "none",
            CacheMode::PerTraj => "per_traj",
            CacheMode::GroupPrompt => "group_prompt",
            CacheMode::Radix => "radix",
        }
    }

    /// Whether a request's context is inserted into the tree once computed.
    fn shares_prompt(self, turn: u32) -> bool {
        match self {
            CacheMode::None => false,
            CacheMode::PerTraj | CacheMode::Radix => true,
            CacheMode::GroupPrompt => turn == 0,
        }
    }

    /// Whether generated tokens are committed to the tree at the end of a turn.
    fn commits_response(self) -> bool {
        matches!(self, CacheMode::PerTraj | CacheMode::Radix)
    }

    /// Whether identical contexts arriving together are computed once and forked.
    fn forks(self, turn: u32) -> bool {
        match self {
            CacheMode::None | CacheMode::PerTraj => false,
            CacheMode::GroupPrompt => turn == 0,
            CacheMode::Radix => true,
        }
    }
}

impl std::str::FromStr for CacheMode {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self> {
        CacheMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| EngineError::UnknownCacheMode(s.to_string()))
    }
}

/// Engine settings.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// How much KV is reused across requests.
    pub cache_mode: CacheMode,
    /// KV slots in the pool (shared by the cache and running sequences).
    pub num_slots: usize,
    /// Longest prefill piece of one sequence per forward call.
    pub prefill_chunk: usize,
    /// Most new tokens (prefill + decode) in one forward call.
    pub max_batch_tokens: usize,
    /// A waiting request that shares more than this many uncached tokens with a request being
    /// prefilled waits for it to land in the tree (in-batch prefix sharing).
    pub defer_min_shared: usize,
    /// The kernel of the pool's prefill attention on CUDA.
    pub prefill_attention: PrefillAttention,
    /// Cascade attention on the CPU: the context slots that running sequences share (a group's
    /// prompt, an earlier turn) are read once per forward for all of them.
    pub cascade_attention: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            cache_mode: CacheMode::Radix,
            num_slots: 65_536,
            prefill_chunk: 512,
            max_batch_tokens: 2048,
            defer_min_shared: 16,
            prefill_attention: PrefillAttention::Paged,
            cascade_attention: true,
        }
    }
}

/// One generation request: a full token context and how to continue it.
#[derive(Clone, Debug)]
pub struct GenRequest {
    /// The whole context (prompt + earlier turns); never empty.
    pub tokens: Vec<u32>,
    /// Trajectory key (the per-trajectory cache namespace).
    pub traj: u64,
    /// Group key (the group-prompt cache namespace).
    pub group: u64,
    /// Turn index within the trajectory; 0 is the initial prompt.
    pub turn: u32,
    /// Temperature, top-p, top-k or greedy sampling.
    pub params: SamplingParams,
    /// Seed of this request's sampling RNG.
    pub seed: u64,
    /// Most tokens to generate; reaching it ends the response with [`FinishReason::Length`].
    pub max_new_tokens: usize,
    /// Tokens that end the response (included in it), e.g. `<|im_end|>`.
    pub stop_token_ids: Vec<u32>,
    /// Texts that end the response once generated (e.g. `</answer>`).
    pub stop_strings: Vec<String>,
    /// Constrained decoding: the grammar every generated token must follow (`None`: free).
    pub grammar: Option<Arc<ResponseGrammar>>,
}

impl GenRequest {
    /// A request standing alone: `tokens` continued by up to `max_new_tokens` tokens sampled
    /// with `params` from `seed`, as turn 0 of trajectory and group 0, with no stop token, stop
    /// text or grammar (set those fields for more).
    pub fn plain(
        tokens: Vec<u32>,
        params: SamplingParams,
        seed: u64,
        max_new_tokens: usize,
    ) -> Self {
        Self {
            tokens,
            traj: 0,
            group: 0,
            turn: 0,
            params,
            seed,
            max_new_tokens,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            grammar: None,
        }
    }
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token was sampled (it ends the response).
    StopToken,
    /// A stop string was generated.
    StopString,
    /// `max_new_tokens` tokens were generated.
    Length,
}

/// The response to one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// The sampled tokens, a final stop token included.
    pub tokens: Vec<u32>,
    /// Log-probability of each sampled token under the sampling distribution.
    pub logprobs: Vec<f32>,
    /// Why the response ended.
    pub finish: FinishReason,
    /// Context tokens computed for this request.
    pub prefilled: usize,
    /// Context tokens served from the cache (or the group fork).
    pub from_cache: usize,
}

/// Where [`Engine::generate_continuous`] gets its requests and hands its results.
pub trait GenerationFeed {
    /// Requests to add before the next forward call (none: an empty list).
    fn more(&mut self) -> Vec<GenRequest>;
    /// A sampled token of request `request` (its number in the order requests were added).
    fn token(&mut self, request: usize, token: u32, logprob: f32);
    /// Request `request` is finished.
    fn done(&mut self, request: usize, generation: Generation);
}

/// A fixed batch as a feed: its requests at the first call, the generations kept by request.
struct Batch<'a> {
    requests: Option<Vec<GenRequest>>,
    on_token: &'a mut dyn FnMut(usize, u32, f32),
    done: Vec<Option<Generation>>,
}

impl GenerationFeed for Batch<'_> {
    fn more(&mut self) -> Vec<GenRequest> {
        self.requests.take().unwrap_or_default()
    }

    fn token(&mut self, request: usize, token: u32, logprob: f32) {
        (self.on_token)(request, token, logprob);
    }

    fn done(&mut self, request: usize, generation: Generation) {
        self.done[request] = Some(generation);
    }
}

/// Prefix-reuse counters, accumulated over calls until [`Engine::take_counters`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheCounters {
    /// Requests started.
    pub requests: u64,
    /// Context tokens requested: what a stateless engine would prefill.
    pub prompt_tokens: u64,
    /// Context tokens computed (the uncached part of each request).
    pub tokens_prefilled: u64,
    /// Context tokens served from the cache or a group fork.
    pub tokens_from_cache: u64,
    /// Tokens sampled.
    pub decode_tokens: u64,
    /// Model forward calls.
    pub forward_calls: u64,
    /// Tokens fed through the model (prefill and decode).
    pub tokens_computed: u64,
    /// Σ over computed tokens of the positions they attend to (attention work).
    pub attended_pairs: u64,
    /// Logits rows produced (one per sequence per forward call).
    pub logit_rows: u64,
    /// Most pool slots in use at once (a gauge: [`CacheCounters::add`] leaves it).
    pub peak_slots_used: u64,
    /// Times cached prefixes were evicted to free slots.
    pub evictions: u64,
    /// Slots freed by those evictions.
    pub evicted_tokens: u64,
    /// Seconds spent in model forward calls.
    pub forward_s: f64,
    /// Forward calls whose attention read shared context once for all its sequences (cascade
    /// attention on the CPU).
    pub cascade_forwards: u64,
    /// Context positions those calls read once instead of once per sequence (per call, summed
    /// over shared runs; each saves that many K/V rows per KV head and layer).
    pub shared_positions_saved: u64,
    /// Decode calls: forward calls in which every sequence brings one sampled token.
    pub decode_calls: u64,
    /// Tokens those calls computed (one per sequence per call).
    pub decode_call_tokens: u64,
    /// Seconds spent in decode calls.
    pub decode_s: f64,
    /// Context positions the tokens of decode calls attend to (their own included).
    pub decode_positions: u64,
    /// Of those, the positions cascade attention did not read again: read once for several
    /// sequences, they count once.
    pub decode_positions_saved: u64,
}

impl CacheCounters {
    /// Adds the request and token counters of `other` (the pool's gauges and timings stay).
    pub fn add(&mut self, other: &CacheCounters) {
        self.requests += other.requests;
        self.prompt_tokens += other.prompt_tokens;
        self.tokens_prefilled += other.tokens_prefilled;
        self.tokens_from_cache += other.tokens_from_cache;
        self.decode_tokens += other.decode_tokens;
        self.forward_calls += other.forward_calls;
        self.tokens_computed += other.tokens_computed;
        self.cascade_forwards += other.cascade_forwards;
        self.shared_positions_saved += other.shared_positions_saved;
        self.decode_calls += other.decode_calls;
        self.decode_call_tokens += other.decode_call_tokens;
        self.decode_positions += other.decode_positions;
        self.decode_positions_saved += other.decode_positions_saved;
    }

    /// Share of requested context tokens served from the cache.
    pub fn hit_ratio(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.tokens_from_cache as f64 / self.prompt_tokens as f64
        }
    }
}

/// Pool occupancy: used slots split into cached-evictable, cached-locked and private.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolUsage {
    /// Slots in the pool.
    pub capacity: usize,
    /// Slots free now.
    pub free: usize,
    /// Slots of cached prefixes no running request holds (evicted first when short).
    pub evictable: usize,
    /// Slots of cached prefixes locked by running requests.
    pub locked: usize,
}

enum Phase {
    Waiting,
    /// Same context as the running sequence `leader`: takes its logits when its prompt is done.
    Follower {
        leader: usize,
    },
    Running,
    Done(FinishReason),
}

struct Seq {
    req: usize,
    namespace: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Slot of every position with K/V: the first `locked_len` belong to the tree.
    slots: Vec<u32>,
    locked_len: usize,
    node: Option<NodeRef>,
    rng: ChaCha8Rng,
    logprobs: Vec<f32>,
    prefilled: usize,
    from_cache: usize,
    phase: Phase,
}

impl Seq {
    fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    fn generation(&self, finish: FinishReason) -> Generation {
        Generation {
            tokens: self.generated().to_vec(),
            logprobs: self.logprobs.clone(),
            finish,
            prefilled: self.prefilled,
            from_cache: self.from_cache,
        }
    }

    fn in_prefill(&self) -> bool {
        matches!(self.phase, Phase::Running) && self.slots.len() < self.prompt_len
    }

    /// Slots this sequence may still take: rest of its context plus its remaining decode budget.
    fn slots_to_come(&self, max_new: usize) -> usize {
        let ctx = self.prompt_len.saturating_sub(self.slots.len());
        ctx + max_new - self.generated().len()
    }
}

/// The rollout engine. See the module documentation.
pub struct Engine {
    cfg: EngineConfig,
    pool: KvPool,
    tree: RadixTree,
    policy_version: u64,
    counters: CacheCounters,
}

impl Engine {
    /// An engine with a fresh pool of `cfg.num_slots` slots shaped for `model_cfg`, in the
    /// device's default rollout dtype (f32 on the CPU, bf16 on CUDA).
    pub fn new(model_cfg: &ModelConfig, cfg: EngineConfig, device: &Device) -> Result<Self> {
        Self::with_pool(KvPool::new(model_cfg, cfg.num_slots, device)?, cfg)
    }

    /// An engine whose pool fits `model`: its shape, device and rollout dtype.
    pub fn for_model(model: &Model, cfg: EngineConfig) -> Result<Self> {
        let pool = KvPool::with_dtype(
            model.config(),
            cfg.num_slots,
            model.device(),
            model.rollout_precision().dtype(),
        )?;
        Self::with_pool(pool, cfg)
    }

    fn with_pool(mut pool: KvPool, cfg: EngineConfig) -> Result<Self> {
        pool.set_prefill_attention(cfg.prefill_attention)?;
        pool.set_cascade(cfg.cascade_attention);
        Ok(Self {
            cfg,
            pool,
            tree: RadixTree::new(),
            policy_version: 0,
            counters: CacheCounters::default(),
        })
    }

    /// The engine's settings.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The cache mode in force.
    pub fn cache_mode(&self) -> CacheMode {
        self.cfg.cache_mode
    }

    /// Switches the cache mode; the cache is flushed so no arm sees another's prefixes.
    pub fn set_cache_mode(&mut self, mode: CacheMode) -> Result<()> {
        self.flush()?;
        self.cfg.cache_mode = mode;
        Ok(())
    }

    /// After a weight update: drops every cached prefix (refusing while one is locked) and salts
    /// later prefixes with `version`, so KV of older weights is never served.
    pub fn set_policy_version(&mut self, version: u64) -> Result<()> {
        self.flush()?;
        self.policy_version = version;
        Ok(())
    }

    /// The policy version that salts the cache namespace.
    pub fn policy_version(&self) -> u64 {
        self.policy_version
    }

    /// Drops every cached prefix and returns its slots to the pool.
    pub fn flush(&mut self) -> Result<()> {
        let slots = self.tree.flush()?;
        self.pool.free(&slots);
        Ok(())
    }

    /// The counters accumulated since the last [`Engine::take_counters`].
    pub fn counters(&self) -> &CacheCounters {
        &self.counters
    }

    /// Returns the counters so far and starts new ones.
    pub fn take_counters(&mut self) -> CacheCounters {
        std::mem::take(&mut self.counters)
    }

    /// The pool's occupancy now.
    pub fn pool_usage(&self) -> PoolUsage {
        PoolUsage {
            capacity: self.pool.capacity(),
            free: self.pool.num_free(),
            evictable: self.tree.evictable_size(),
            locked: self.tree.protected_size(),
        }
    }

    /// Runs every request to completion and returns their generations in request order.
    pub fn generate(
        &mut self,
        model: &Model,
        tokenizer: &Tokenizer,
        requests: &[GenRequest],
    ) -> Result<Vec<Generation>> {
        self.generate_streaming(model, tokenizer, requests, &mut |_, _, _| {})
    }

    /// [`Engine::generate`], handing every sampled token to `on_token(request, token, logprob)`
    /// as soon as its forward call is done (in sampling order within each request).
    pub fn generate_streaming(
        &mut self,
        model: &Model,
        tokenizer: &Tokenizer,
        requests: &[GenRequest],
        on_token: &mut dyn FnMut(usize, u32, f32),
    ) -> Result<Vec<Generation>> {
        let mut batch = Batch {
            requests: Some(requests.to_vec()),
            on_token,
            done: vec![None; requests.len()],
        };
        self.generate_continuous(model, tokenizer, &mut batch)?;
        Ok(batch
            .done
            .into_iter()
            .map(|g| g.expect("every request finishes before the call returns"))
            .collect())
    }

    /// Continuous batching: before every forward call the feed may add requests (numbered on
    /// from the earlier ones, in the order given), which join the running batch at once; tokens
    /// and finished generations are handed to the feed as they happen. Returns when every
    /// request is done and the feed has none to add.
    pub fn generate_continuous(
        &mut self,
        model: &Model,
        tokenizer: &Tokenizer,
        feed: &mut dyn GenerationFeed,
    ) -> Result<()> {
        let mut requests: Vec<GenRequest> = Vec::new();
        let mut seqs: Vec<Seq> = Vec::new();
        // Per sequence: tokens handed to the feed, and whether its end was.
        let mut reported: Vec<(usize, bool)> = Vec::new();
        loop {
            let more = feed.more();
            self.validate(requests.len(), &more)?;
            for r in more {
                self.counters.requests += 1;
                self.counters.prompt_tokens += r.tokens.len() as u64;
                seqs.push(self.new_seq(requests.len(), &r));
                reported.push((0, false));
                requests.push(r);
            }
            if seqs.iter().all(|s| matches!(s.phase, Phase::Done(_))) {
                return Ok(());
            }
            self.admit(&mut seqs, &requests)?;
            self.step(model, tokenizer, &mut seqs, &requests)?;
            for (s, (sent, ended)) in seqs.iter().zip(reported.iter_mut()) {
                let generated = s.generated();
                for (&token, &logprob) in generated[*sent..].iter().zip(&s.logprobs[*sent..]) {
                    feed.token(s.req, token, logprob);
                }
                *sent = generated.len();
                if let (Phase::Done(finish), false) = (&s.phase, *ended) {
                    let finish = *finish;
                    *ended = true;
                    feed.done(s.req, s.generation(finish));
                }
            }
        }
    }

    /// Checks `requests`, numbered from `first`.
    fn validate(&self, first: usize, requests: &[GenRequest]) -> Result<()> {
        for (index, r) in (first..).zip(requests) {
            let bad = |message: &str| EngineError::BadRequest {
                index,
                message: message.to_string(),
            };
            if r.tokens.is_empty() {
                return Err(bad("empty context"));
            }
            if r.max_new_tokens == 0 {
                return Err(bad("max_new_tokens must be at least 1"));
            }
            let needed = r.tokens.len() + r.max_new_tokens;
            if needed > self.pool.capacity() {
                return Err(EngineError::PoolTooSmall {
                    index,
                    needed,
                    capacity: self.pool.capacity(),
                });
            }
        }
        Ok(())
    }

    fn new_seq(&self, req: usize, r: &GenRequest) -> Seq {
        Seq {
            req,
            namespace: self.namespace(r),
            tokens: r.tokens.clone(),
            prompt_len: r.tokens.len(),
            slots: Vec::new(),
            locked_len: 0,
            node: None,
            rng: ChaCha8Rng::seed_from_u64(r.seed),
            logprobs: Vec::new(),
            prefilled: 0,
            from_cache: 0,
            phase: Phase::Waiting,
        }
    }

    fn namespace(&self, r: &GenRequest) -> u64 {
        let v = self.policy_version;
        match self.cfg.cache_mode {
            CacheMode::None | CacheMode::Radix => seed::derive(v, &[0]),
            CacheMode::PerTraj => seed::derive(v, &[1, r.traj]),
            CacheMode::GroupPrompt => seed::derive(v, &[2, r.group]),
        }
    }

    /// Moves waiting sequences to running (or to follower of an identical running one) while the
    /// pool can hold them; defers those that will share a prefix still being prefilled.
    fn admit(&mut self, seqs: &mut [Seq], reqs: &[GenRequest]) -> Result<()> {
        for i in 0..seqs.len() {
            if !matches!(seqs[i].phase, Phase::Waiting) {
                continue;
            }
            let turn = reqs[seqs[i].req].turn;
            let mode = self.cfg.cache_mode;
            if mode.forks(turn) {
                if let Some(leader) = find_identical_leader(seqs, i) {
                    if self.available(seqs, reqs) < reqs[seqs[i].req].max_new_tokens {
                        break;
                    }
                    seqs[i].phase = Phase::Follower { leader };
                    continue;
                }
            }
            let cached = self.match_and_lock(&mut seqs[i]);
            if mode.shares_prompt(turn) && self.should_defer(seqs, i, cached) {
                self.release(&mut seqs[i]);
                continue;
            }
            let need = seqs[i].slots_to_come(reqs[seqs[i].req].max_new_tokens);
            if self.available(seqs, reqs) < need {
                self.release(&mut seqs[i]);
                if !seqs.iter().any(|s| matches!(s.phase, Phase::Running)) {
                    return Err(EngineError::PoolTooSmall {
                        index: seqs[i].req,
                        needed: need,
                        capacity: self.pool.capacity(),
                    });
                }
                break;
            }
            seqs[i].phase = Phase::Running;
        }
        Ok(())
    }

    /// Locks the longest cached prefix of the sequence's context, leaving at least one token to
    /// compute (its logits start the response). Returns the cached length.
    fn match_and_lock(&mut self, s: &mut Seq) -> usize {
        if self.cfg.cache_mode == CacheMode::None {
            return 0;
        }
        let cap = s.prompt_len - 1;
        let m = self.tree.match_prefix(s.namespace, &s.tokens[..cap]);
        self.tree.lock(m.node);
        s.locked_len = m.slots.len();
        s.slots = m.slots;
        s.node = Some(m.node);
        s.locked_len
    }

    /// Undoes `match_and_lock` for a sequence that goes back to waiting.
    fn release(&mut self, s: &mut Seq) {
        if let Some(node) = s.node.take() {
            self.tree.unlock(node);
        }
        s.slots.clear();
        s.locked_len = 0;
    }

    /// Whether sequence `i` shares more uncached tokens with a sequence being prefilled (in its
    /// namespace) than `defer_min_shared`: it then waits for that prefix to land in the tree.
    fn should_defer(&self, seqs: &[Seq], i: usize, cached: usize) -> bool {
        let me = &seqs[i];
        seqs.iter().any(|other| {
            other.in_prefill()
                && other.namespace == me.namespace
                && common_prefix(&other.tokens[..other.prompt_len], &me.tokens)
                    > cached + self.cfg.defer_min_shared
        })
    }

    /// Slots that can still be promised: free + evictable minus what running sequences may take.
    fn available(&self, seqs: &[Seq], reqs: &[GenRequest]) -> usize {
        let reserved: usize = seqs
            .iter()
            .map(|s| match s.phase {
                Phase::Running => s.slots_to_come(reqs[s.req].max_new_tokens),
                Phase::Follower { .. } => reqs[s.req].max_new_tokens,
                Phase::Waiting | Phase::Done(_) => 0,
            })
            .sum();
        (self.pool.num_free() + self.tree.evictable_size()).saturating_sub(reserved)
    }

    /// One forward call over all running sequences: a prefill chunk or one decode token each,
    /// within the token budget; then sampling, stop checks, forks and commits.
    fn step(
        &mut self,
        model: &Model,
        tok: &Tokenizer,
        seqs: &mut [Seq],
        reqs: &[GenRequest],
    ) -> Result<()> {
        let plan = self.plan_batch(seqs)?;
        if plan.is_empty() {
            return Ok(());
        }
        let chunks: Vec<SeqChunk> = plan
            .iter()
            .map(|&(i, start)| SeqChunk {
                new_tokens: &seqs[i].tokens[start..seqs[i].slots.len()],
                slots: &seqs[i].slots,
            })
            .collect();
        let decode = plan
            .iter()
            .all(|&(i, start)| seqs[i].slots.len() == start + 1 && !seqs[i].generated().is_empty());
        let t0 = Instant::now();
        let logits = model.forward_incremental(&chunks, &mut self.pool, LogitsWanted::Last)?;
        let rows = logits.to_vec2::<f32>()?;
        let seconds = t0.elapsed().as_secs_f64();
        self.counters.forward_s += seconds;
        self.counters.forward_calls += 1;
        let (cascade_forwards, saved) = self.pool.take_cascade_counts();
        self.counters.cascade_forwards += cascade_forwards;
        self.counters.shared_positions_saved += saved;
        if decode {
            let c = &mut self.counters;
            c.decode_calls += 1;
            c.decode_call_tokens += chunks.len() as u64;
            c.decode_s += seconds;
            c.decode_positions += chunks.iter().map(|s| s.slots.len() as u64).sum::<u64>();
            c.decode_positions_saved += saved;
        }
        self.counters.logit_rows += plan.len() as u64;
        for (&(i, _), row) in plan.iter().zip(&rows) {
            if seqs[i].slots.len() < seqs[i].tokens.len() {
                continue; // mid-prefill chunk: no token to sample yet
            }
            let prompt_done = seqs[i].generated().is_empty();
            let req = &reqs[seqs[i].req];
            self.sample_into(tok, &mut seqs[i], req, row);
            if prompt_done {
                self.on_prompt_done(tok, seqs, reqs, i, row)?;
            }
        }
        for s in seqs.iter_mut() {
            if matches!(s.phase, Phase::Done(_)) && (s.node.is_some() || !s.slots.is_empty()) {
                self.retire(s)?;
            }
        }
        Ok(())
    }

    /// Chooses each running sequence's new tokens for this call and allocates their slots.
    /// Returns (sequence, first new position); the new positions end at `slots.len()`.
    fn plan_batch(&mut self, seqs: &mut [Seq]) -> Result<Vec<(usize, usize)>> {
        let mut plan = Vec::new();
        let mut budget = self.cfg.max_batch_tokens;
        for (i, s) in seqs.iter_mut().enumerate() {
            if !matches!(s.phase, Phase::Running) {
                continue;
            }
            let start = s.slots.len();
            if budget == 0 {
                break;
            }
            let n = (s.tokens.len() - start)
                .min(self.cfg.prefill_chunk)
                .min(budget);
            let new_slots = alloc_slots(&mut self.pool, &mut self.tree, &mut self.counters, n)?;
            self.counters.tokens_computed += n as u64;
            self.counters.attended_pairs +=
                ((start + 1)..=(start + n)).map(|p| p as u64).sum::<u64>();
            s.slots.extend(new_slots);
            if s.generated().is_empty() {
                s.prefilled += n;
            }
            budget = budget.saturating_sub(n);
            plan.push((i, start));
        }
        let used = (self.pool.capacity() - self.pool.num_free()) as u64;
        self.counters.peak_slots_used = self.counters.peak_slots_used.max(used);
        Ok(plan)
    }

    /// Samples the next token of `s` from `row`, records it and checks the stop conditions.
    fn sample_into(&mut self, tok: &Tokenizer, s: &mut Seq, r: &GenRequest, row: &[f32]) {
        let allowed = r.grammar.as_ref().and_then(|g| g.allowed(s.generated()));
        let (token, logprob) = sample_allowed(row, allowed.as_ref(), &r.params, &mut s.rng);
        s.tokens.push(token);
        s.logprobs.push(logprob);
        self.counters.decode_tokens += 1;
        if let Some(reason) = stop_reason(tok, s.generated(), r) {
            s.phase = Phase::Done(reason);
        }
    }

    /// A sequence's context is computed: count it, share it through the tree (when the mode
    /// does), and start its followers from the same logits.
    fn on_prompt_done(
        &mut self,
        tok: &Tokenizer,
        seqs: &mut [Seq],
        reqs: &[GenRequest],
        leader: usize,
        row: &[f32],
    ) -> Result<()> {
        let s = &mut seqs[leader];
        s.from_cache = s.locked_len;
        self.counters.tokens_prefilled += s.prefilled as u64;
        self.counters.tokens_from_cache += s.from_cache as u64;
        if !self.cfg.cache_mode.shares_prompt(reqs[s.req].turn) {
            return Ok(());
        }
        let prompt_len = s.prompt_len;
        self.commit(s, prompt_len)?;
        let followers = seqs
            .iter_mut()
            .filter(|s| matches!(s.phase, Phase::Follower { leader: l } if l == leader));
        for follower in followers {
            let prompt_len = follower.prompt_len;
            let m = self.tree.match_prefix(follower.namespace, &follower.tokens);
            debug_assert_eq!(m.slots.len(), prompt_len, "the leader's prompt is cached");
            self.tree.lock(m.node);
            follower.locked_len = m.slots.len();
            follower.slots = m.slots;
            follower.node = Some(m.node);
            follower.from_cache = prompt_len;
            follower.phase = Phase::Running;
            self.counters.tokens_from_cache += prompt_len as u64;
            self.sample_into(tok, follower, &reqs[follower.req], row);
        }
        Ok(())
    }

    /// Inserts the first `len` tokens of `s` (all with K/V) into the tree, frees the slots the
    /// tree already had, and moves the sequence's lock to the new end node.
    fn commit(&mut self, s: &mut Seq, len: usize) -> Result<()> {
        let ins = self
            .tree
            .insert(s.namespace, &s.tokens[..len], &s.slots[..len])?;
        self.pool.free(&ins.duplicate_slots);
        s.slots.splice(..len, ins.slots);
        self.tree.lock(ins.node);
        if let Some(old) = s.node.replace(ins.node) {
            self.tree.unlock(old);
        }
        s.locked_len = len;
        Ok(())
    }

    /// End of a sequence's turn: commit what the mode keeps, free private slots, unlock.
    fn retire(&mut self, s: &mut Seq) -> Result<()> {
        if self.cfg.cache_mode.commits_response() {
            let len = s.slots.len();
            self.commit(s, len)?;
        }
        self.pool.free(&s.slots[s.locked_len..]);
        if let Some(node) = s.node.take() {
            self.tree.unlock(node);
        }
        s.slots.clear();
        s.locked_len = 0;
        Ok(())
    }
}

/// A running, still-prefilling sequence with exactly the same context and namespace.
fn find_identical_leader(seqs: &[Seq], i: usize) -> Option<usize> {
    let me = &seqs[i];
    seqs.iter().position(|o| {
        o.in_prefill() && o.namespace == me.namespace && o.tokens[..o.prompt_len] == me.tokens[..]
    })
}

/// Takes `n` slots from the pool, evicting least recently used cached prefixes when short.
fn alloc_slots(
    pool: &mut KvPool,
    tree: &mut RadixTree,
    counters: &mut CacheCounters,
    n: usize,
) -> Result<Vec<u32>> {
    if pool.num_free() < n {
        let freed = tree.evict(n - pool.num_free());
        counters.evictions += 1;
        counters.evicted_tokens += freed.len() as u64;
        pool.free(&freed);
    }
    let free = pool.num_free();
    pool.alloc(n)
        .ok_or(EngineError::PoolExhausted { needed: n, free })
}

/// The stop condition met by the response so far, if any.
fn stop_reason(tok: &Tokenizer, generated: &[u32], r: &GenRequest) -> Option<FinishReason> {
    let last = *generated.last()?;
    if r.stop_token_ids.contains(&last) {
        return Some(FinishReason::StopToken);
    }
    if !r.stop_strings.is_empty() {
        let longest = r.stop_strings.iter().map(String::len).max().unwrap_or(0);
        let tail = &generated[generated.len().saturating_sub(longest + 2)..];
        let text = tok.decode(tail);
        if r.stop_strings.iter().any(|s| text.contains(s.as_str())) {
            return Some(FinishReason::StopString);
        }
    }
    (generated.len() >= r.max_new_tokens).then_some(FinishReason::Length)
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(tokens: Vec<u32>, max_new_tokens: usize) -> GenRequest {
        GenRequest {
            tokens,
            traj: 0,
            group: 0,
            turn: 0,
            params: SamplingParams::default(),
            seed: 1,
            max_new_tokens,
            stop_token_ids: vec![7],
            stop_strings: vec!["</answer>".into()],
            grammar: None,
        }
    }

    #[test]
    fn stop_conditions_in_priority_order() {
        let tok = Tokenizer::builtin();
        let r = request(vec![1], 50);
        let answer = tok.encode("<answer>Left</answer>");
        assert_eq!(
            stop_reason(&tok, &answer, &r),
            Some(FinishReason::StopString)
        );
        assert_eq!(stop_reason(&tok, &answer[..answer.len() - 1], &r), None);
        assert_eq!(
            stop_reason(&tok, &[3, 7], &r),
            Some(FinishReason::StopToken)
        );
        let short = request(vec![1], 2);
        assert_eq!(
            stop_reason(&tok, &[3, 4], &short),
            Some(FinishReason::Length)
        );
    }

    #[test]
    fn cache_modes_parse_by_name() {
        for mode in CacheMode::ALL {
            assert_eq!(mode.name().parse::<CacheMode>().unwrap(), mode);
        }
        assert!(matches!(
            "lru".parse::<CacheMode>(),
            Err(EngineError::UnknownCacheMode(_))
        ));
    }

    #[test]
    fn bad_requests_are_rejected_before_running() {
        let tok = Tokenizer::builtin();
        let cfg = ModelConfig::tiny(tok.vocab_size());
        let model = Model::new(&cfg, 0, &Device::Cpu).unwrap();
        let engine_cfg = EngineConfig {
            num_slots: 16,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(&cfg, engine_cfg, &Device::Cpu).unwrap();
        let err = engine.generate(&model, &tok, &[request(vec![1; 10], 10)]);
        assert!(matches!(
            err,
            Err(EngineError::PoolTooSmall {
                index: 0,
                needed: 20,
                ..
            })
        ));
        let err = engine.generate(&model, &tok, &[request(vec![1], 2), request(vec![], 2)]);
        assert!(matches!(err, Err(EngineError::BadRequest { index: 1, .. })));
        let usage = engine.pool_usage();
        assert_eq!((usage.free, usage.evictable, usage.locked), (16, 0, 0));
    }
}
