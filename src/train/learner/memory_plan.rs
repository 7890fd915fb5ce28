//! The memory a training run needs, planned from the model's shape before anything is allocated
//! ([`MemoryPlan`]): the weights, the rollout's copy of them, the gradients, AdamW's moments, the
//! activations the backward keeps, the logits of the trained positions and the rollout's KV pool,
//! and the peak of one update. `stepppo plan` prints it; `stepppo train` checks it against the
//! machine's memory before the first step and before each update ([`MemoryPlan::check`]), so a
//! run that cannot fit stops with the table instead of dying of an out-of-memory later.
//!
//! Per rank of a data-parallel world: sharding the optimizer (ZeRO-1/2) keeps each rank's block
//! of AdamW's moments only, and the optimizer step holds flat buffers the collectives move (the
//! rank's gradients laid end to end, the summed gradient or its block, the updated block and the
//! gathered weights) while the backward's gradients are still alive and its activations gone.
//!
//! The activation count follows the CPU training forward (f32, fused ops): per layer and token
//! the backward keeps `11·hidden + 4·kv + 3·intermediate` floats (the block's input, normed
//! input, q before and after RoPE, k likewise, v and its head-major copy, the attention output
//! and its token-major copy, the output projection and the residual sum, the MLP's normed input,
//! gate, up, their SwiGLU product, down and the residual sum). A LoRA projection keeps its
//! adapter's output and the sum with the base's besides (two outputs' worth; three off the fused
//! CPU op, where the frozen base's product is passed through once more). The matmul
//! attention of other devices also keeps `3·heads·T` scores, probabilities and their bias per
//! token. With activation checkpointing a block keeps its input and a copy of its output, and
//! one block's activations and their gradients live at a time, while the backward recomputes
//! it. A tied embedding trained in full holds its two gradients' sum besides.
//!
//! Under bf16 mixed precision ([`crate::model::precision`]) a forward also holds a bf16 working
//! copy of every weight its products read, and each cast keeps its source alive in the graph: a
//! layer keeps `46·hidden + 10·q + 20·kv + 8·intermediate` bytes a token (the f32 tensors above
//! where they feed a cast or an f32 op, their bf16 casts beside them, the MLP's four
//! intermediate-width tensors in bf16), and the logits are kept as the head's bf16 product, its
//! f32 widening and the gradients of both. Measured against the process's peak on the CPU by
//! `cargo bench --bench lora`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::{Config, CriticMode};
use crate::dist::shard::{layer_units, Sharding};
use crate::model::lora::adapter_param_shapes;
use crate::model::{LoraSpec, Model, ModelConfig, Precision};

/// Bytes of an f32.
const F32: u64 = 4;
/// Bytes of a bf16.
const BF16: u64 = 2;
pub(crate) const GIB: f64 = (1u64 << 30) as f64;

/// Where the run computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanDevice {
    /// An f32 KV pool (whatever the rollout's dtype).
    Cpu,
    /// A KV pool in the rollout's dtype.
    Cuda,
}

/// One model the run trains: the policy, or a separate critic of its shape.
#[derive(Clone, Debug)]
pub struct TrainedModel {
    /// The model's architecture.
    pub config: ModelConfig,
    /// LoRA adapters trained instead of the weights.
    pub lora: Option<LoraSpec>,
    /// A critic reads no vocabulary: no LM head, no logits (a value head instead).
    pub is_critic: bool,
    /// A LoRA critic copied from a LoRA policy reads the policy's frozen base: only its value
    /// head is weights of its own.
    pub shares_policy_weights: bool,
}

/// What a plan is made for.
#[derive(Clone, Debug)]
pub struct PlanShape {
    /// The policy.
    pub policy: TrainedModel,
    /// A separate critic (`critic.mode: separate`): its weights and optimizer stay alive beside
    /// the policy's; its update runs after the actor's, so the larger of the two passes counts.
    pub critic: Option<TrainedModel>,
    /// Where the run computes (sets the KV pool's dtype).
    pub device: PlanDevice,
    /// Positions of one update's forward (a mini-batch's tokens, padding included).
    pub batch_tokens: usize,
    /// Positions whose logits the loss reads (the response tokens); at most `batch_tokens`.
    pub logit_rows: usize,
    /// Longest sequence of a mini-batch (the matmul attention's scores grow with it).
    pub sequence_tokens: usize,
    /// Blocks recompute their activations in the backward (`activation_checkpointing`).
    pub activation_checkpointing: bool,
    /// The dtype of the training products (`precision`).
    pub precision: Precision,
    /// The dtype generation stores the policy's weights in (`rollout_dtype`): a copy unless
    /// f32.
    pub rollout_precision: Precision,
    /// Slots of the rollout's KV pool (`cache.kv_slots`).
    pub kv_slots: usize,
    /// Whole copies of the policy's weights beside it: the frozen reference of a KL term (a LoRA
    /// run's reference is its base: no copy) and the snapshots an asynchronous rollout
    /// generates with (one per version in flight).
    pub extra_policy_copies: usize,
    /// Data-parallel ranks the plan is for (1: a process on its own).
    pub ranks: usize,
    /// What the ranks partition (`sharding`).
    pub sharding: Sharding,
}

/// Bytes of each part of a run's memory, and the peak of one update.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The f32 weights of the policy and any critic, plus the extra policy copies.
    pub weights: u64,
    /// The bf16 copies of the weights a forward's products read under bf16 precision.
    pub working_weights: u64,
    /// The rollout's own copy: in bf16 (`rollout_dtype`, the CUDA default), or in f32 the adapted
    /// projections with LoRA merged in.
    pub rollout_weights: u64,
    /// Gradients of the trained parameters, for the larger of the actor's and critic's passes.
    pub gradients: u64,
    /// AdamW's two f32 moments per trained parameter (this rank's block of them when sharded).
    pub optimizer: u64,
    /// The flat buffers of an optimizer step across ranks, beside the gradients after the
    /// backward's activations are gone (none in a process on its own).
    pub step_buffers: u64,
    /// Activations the backward keeps, for the larger of the two passes.
    pub activations: u64,
    /// The trained positions' logits and their gradient.
    pub logits: u64,
    /// The rollout's KV pool.
    pub kv_cache: u64,
    /// Number of parameters trained (the adapters under LoRA), policy and critic.
    pub trained_params: u64,
    /// Number of parameters of the policy and critic (a count, not bytes).
    pub total_params: u64,
}

impl MemoryPlan {
    /// The plan of a run of `shape`.
    pub fn of(shape: &PlanShape) -> Self {
        let policy = ModelPlan::of(&shape.policy, shape);
        let critic = shape.critic.as_ref().map(|c| ModelPlan::of(c, shape));
        let both = |f: fn(&ModelPlan) -> u64| f(&policy) + critic.as_ref().map_or(0, f);
        // The critic's pass follows the actor's: gradients and activations of one at a time.
        let pass = |m: &ModelPlan| m.gradients + m.activations + m.logits;
        let (gradients, activations, logits) = match &critic {
            Some(c) if pass(c) > pass(&policy) => (c.gradients, c.activations, c.logits),
            _ => (policy.gradients, policy.activations, policy.logits),
        };
        let kv = &shape.policy.config;
        let kv_row = (kv.num_key_value_heads * kv.head_dim()) as u64;
        let kv_bytes = match (shape.device, shape.rollout_precision) {
            (PlanDevice::Cuda, Precision::Bf16) => BF16,
            _ => F32,
        };
        let copies = shape.extra_policy_copies as u64 * policy.total_params * F32;
        let buffers = |m: &ModelPlan| step_buffers(&m.units, shape);
        let step_buffers = buffers(&policy).max(critic.as_ref().map_or(0, buffers));
        Self {
            weights: both(|m| m.weights) + copies,
            working_weights: both(|m| m.working_weights),
            rollout_weights: policy.rollout_weights,
            gradients,
            optimizer: both(|m| m.optimizer),
            step_buffers,
            activations,
            logits,
            kv_cache: shape.kv_slots as u64 * kv.num_hidden_layers as u64 * 2 * kv_row * kv_bytes,
            trained_params: both(|m| m.trained_params),
            total_params: both(|m| m.total_params),
        }
    }

    /// The peak of one update: everything alive at the end of its backward, or during its
    /// optimizer step when the step's buffers outgrow the activations and logits.
    pub fn peak(&self) -> u64 {
        self.weights
            + self.working_weights
            + self.rollout_weights
            + self.gradients
            + self.optimizer
            + (self.activations + self.logits).max(self.step_buffers)
            + self.kv_cache
    }

    /// The plan as a table, with the memory it is held against when given.
    pub fn table(&self, shape: &PlanShape, available: Option<u64>) -> String {
        let gib = |b: u64| {
            if b as f64 >= GIB {
                format!("{:.2} GiB", b as f64 / GIB)
            } else {
                format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
            }
        };
        let mut out = format!(
            "| part | bytes |\n|---|--:|\n\
             | weights ({} parameters, f32) | {} |\n\
             | working copy of the weights ({} products) | {} |\n\
             | rollout copy of the weights | {} |\n\
             | gradients ({} trained parameters) | {} |\n\
             | optimizer (AdamW moments{}) | {} |\n\
             | optimizer step's buffers across ranks | {} |\n\
             | activations ({} tokens a forward) | {} |\n\
             | logits ({} trained positions) | {} |\n\
             | KV cache ({} slots) | {} |\n\
             | **peak of an update** | **{}** |\n",
            self.total_params,
            gib(self.weights),
            shape.precision,
            gib(self.working_weights),
            gib(self.rollout_weights),
            self.trained_params,
            gib(self.gradients),
            match (shape.ranks, shape.sharding.shards_optimizer()) {
                (1, _) => String::new(),
                (n, true) => format!(", this rank's 1/{n}, sharding {}", shape.sharding.name()),
                (n, false) => format!(", whole on each of {n} ranks"),
            },
            gib(self.optimizer),
            gib(self.step_buffers),
            shape.batch_tokens,
            gib(self.activations),
            shape.logit_rows,
            gib(self.logits),
            shape.kv_slots,
            gib(self.kv_cache),
            gib(self.peak()),
        );
        if let Some(available) = available {
            let largest = match largest_batch(shape, available) {
                Some(tokens) => format!("{tokens} tokens"),
                None => "none: the rest of the plan alone does not fit".into(),
            };
            let _ = writeln!(out, "| memory available | {} |", gib(available));
            let _ = writeln!(out, "| largest forward that fits | {largest} |");
        }
        out
    }

    /// An error with the table when the peak of an update exceeds `available` bytes.
    pub fn check(&self, shape: &PlanShape, available: u64) -> Result<(), String> {
        if self.peak() <= available {
            return Ok(());
        }
        Err(format!(
            "an update needs {:.2} GiB and {:.2} GiB are available (`stepppo plan` gives the same \
             table; fewer tokens a mini-batch — ppo_mini_batch_size —, LoRA or fewer kv_slots \
             shrink it):\n{}",
            self.peak() as f64 / GIB,
            available as f64 / GIB,
            self.table(shape, Some(available))
        ))
    }
}

/// The most bytes of flat f32 buffers one optimizer step holds at a time across the ranks of
/// `shape`, for trained parameters in `units` (values per unit, in the order the step moves
/// them). On CUDA (NCCL) a collective reads and writes device buffers; on the CPU it goes
/// through the host, where MPI sums from a copy of what it is given.
fn step_buffers(units: &[u64], shape: &PlanShape) -> u64 {
    let ranks = shape.ranks as u64;
    if ranks == 1 {
        return 0;
    }
    let host = shape.device == PlanDevice::Cpu;
    // A unit being summed: its gradients laid flat, their host copy and the sum.
    let summing = |unit: u64| if host { 3 * unit } else { 2 * unit };
    let block = |unit: u64| unit.div_ceil(ranks);
    // The most alive while the units are summed one after another, beside what the units before
    // left behind (`kept` of each).
    let while_summing = |now: &dyn Fn(u64) -> u64, kept: &dyn Fn(u64) -> u64| -> u64 {
        let (mut before, mut most) = (0, 0);
        for &u in units {
            most = most.max(before + now(u));
            before += kept(u);
        }
        most
    };
    let largest = units.iter().copied().max().unwrap_or(0);
    let padded = |u: u64| block(u) * ranks;
    // Then the rank's block: its gradient, values and updated values, beside a unit gathered
    // (and its host copy).
    let blocks: u64 = units.iter().map(|&u| block(u)).sum();
    let gathering = 3 * blocks + if host { 2 } else { 1 } * padded(largest);
    let values = match shape.sharding {
        // The whole sum, kept unit by unit beside this rank's own gradients.
        Sharding::None => while_summing(&|u| summing(u), &|u| u),
        // Each unit's sum, of which this rank keeps its block.
        Sharding::Optimizer => while_summing(&|u| summing(padded(u)), &block).max(gathering),
        // Reduce-scattering a unit: its gradients, their host copy and Open MPI's scratch buffer
        // of the unit's whole sum (its reduce-scatter-block reduces the whole vector before it
        // scatters), and the rank's block of it.
        Sharding::Gradients | Sharding::Parameters => {
            let scatter = |u: u64| if host { 3 * padded(u) } else { padded(u) } + block(u);
            while_summing(&scatter, &block).max(gathering)
        }
    };
    values * F32
}

/// A run's plan held against the memory it may use: checked before the first step with the
/// least a mini-batch can hold ([`MemoryBudget::check_start`]) and before each forward of an
/// update with the forward's own size ([`MemoryBudget::check_forward`]), whose largest planned
/// peak since the last [`MemoryBudget::take_largest_planned`] it keeps (the run logs it beside
/// the measured peak).
pub struct MemoryBudget {
    shape: PlanShape,
    available: u64,
    largest_planned: AtomicU64,
}

impl MemoryBudget {
    /// The budget of a run of `cfg` training a policy of shape `model` (with LoRA adapters of
    /// `lora`) on `device`, as one of `ranks` ranks; `None` where the device's memory is not
    /// known.
    pub fn for_run(
        cfg: &Config,
        model: &ModelConfig,
        lora: Option<LoraSpec>,
        (device, ranks): (&candle_core::Device, usize),
    ) -> Option<Self> {
        let available = crate::device::memory_available(device)?;
        let separate = cfg.critic.mode == CriticMode::Separate;
        let critic = separate.then(|| TrainedModel {
            config: model.clone(),
            lora: cfg.critic.lora.clone(),
            is_critic: true,
            shares_policy_weights: cfg.critic.pretrain.is_none()
                && cfg.critic.lora.is_some()
                && lora.is_some(),
        });
        // The least a mini-batch holds: its sequences' responses alone.
        let floor = cfg.ppo_mini_batch_size * cfg.generating_args.max_new_tokens;
        let shape = PlanShape {
            policy: TrainedModel {
                config: model.clone(),
                lora: lora.clone(),
                is_critic: false,
                shares_policy_weights: false,
            },
            critic,
            device: if device.is_cpu() {
                PlanDevice::Cpu
            } else {
                PlanDevice::Cuda
            },
            batch_tokens: floor,
            logit_rows: floor,
            sequence_tokens: cfg.generating_args.max_new_tokens,
            activation_checkpointing: cfg.activation_checkpointing,
            precision: cfg.precision,
            rollout_precision: cfg
                .rollout_dtype
                .unwrap_or_else(|| crate::model::default_rollout_precision(device)),
            kv_slots: if cfg.cache.prefix_cache {
                cfg.cache.kv_slots
            } else {
                0
            },
            extra_policy_copies: usize::from(cfg.keeps_reference() && lora.is_none())
                + match cfg.async_rollout.staleness {
                    0 => 0,
                    staleness => staleness + 1,
                },
            ranks,
            sharding: cfg.sharding,
        };
        Some(Self::new(shape, available))
    }

    /// `shape` (its tokens the least a mini-batch holds) held against `available` bytes.
    pub fn new(shape: PlanShape, available: u64) -> Self {
        Self {
            shape,
            available,
            largest_planned: AtomicU64::new(0),
        }
    }

    /// The largest peak the checked forwards planned since the last call; `None` when none was
    /// checked.
    pub fn take_largest_planned(&self) -> Option<u64> {
        Some(self.largest_planned.swap(0, Ordering::Relaxed)).filter(|&peak| peak > 0)
    }

    /// Before the first step: the weights, optimizer, KV pool and the smallest mini-batch.
    pub fn check_start(&self) -> Result<(), String> {
        MemoryPlan::of(&self.shape).check(&self.shape, self.available)
    }

    /// Before a forward of `positions` tokens (padding included) whose loss reads `logit_rows`
    /// positions, sequences up to `sequence_tokens` long.
    pub fn check_forward(
        &self,
        positions: usize,
        logit_rows: usize,
        sequence_tokens: usize,
    ) -> Result<(), String> {
        let shape = PlanShape {
            batch_tokens: positions,
            logit_rows: logit_rows.min(positions),
            sequence_tokens,
            ..self.shape.clone()
        };
        let plan = MemoryPlan::of(&shape);
        self.largest_planned
            .fetch_max(plan.peak(), Ordering::Relaxed);
        plan.check(&shape, self.available)
    }
}

/// The most tokens a forward may have (the trained positions at the shape's ratio) for the
/// peak to stay within `available`; `None` when not even one fits.
pub fn largest_batch(shape: &PlanShape, available: u64) -> Option<usize> {
    let fits = |tokens: usize| {
        let mut s = shape.clone();
        let ratio = shape.logit_rows as f64 / shape.batch_tokens.max(1) as f64;
        s.batch_tokens = tokens;
        s.logit_rows = ((tokens as f64 * ratio).ceil() as usize).min(tokens);
        s.sequence_tokens = shape.sequence_tokens.min(tokens);
        MemoryPlan::of(&s).peak() <= available
    };
    if !fits(1) {
        return None;
    }
    let (mut lo, mut hi) = (1usize, 2usize);
    while fits(hi) && hi < 1 << 40 {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

/// One model's part of the plan.
struct ModelPlan {
    weights: u64,
    working_weights: u64,
    rollout_weights: u64,
    gradients: u64,
    optimizer: u64,
    activations: u64,
    logits: u64,
    trained_params: u64,
    /// The trained parameters of each unit a step moves at a time (a decoder layer's, or one
    /// parameter outside the layers: `layer_units`), in the optimizer's order.
    units: Vec<u64>,
    total_params: u64,
}

impl ModelPlan {
    fn of(m: &TrainedModel, shape: &PlanShape) -> Self {
        let cfg = &m.config;
        let count = |shapes: &[(String, Vec<usize>)]| -> u64 {
            shapes
                .iter()
                .map(|(_, s)| s.iter().product::<usize>() as u64)
                .sum()
        };
        let mut params = Model::param_shapes(cfg);
        let head = vec![
            ("score.weight".to_string(), vec![1, cfg.hidden_size]),
            ("score.bias".to_string(), vec![1]),
        ];
        if m.is_critic {
            params.retain(|(name, _)| name != "lm_head.weight");
            params.extend(head.iter().cloned());
        }
        let total_params = count(&params);
        let whole_copy = match shape.rollout_precision {
            Precision::F32 => 0,
            Precision::Bf16 => total_params * BF16,
        };
        let (trained_params, rollout_weights, units) = match &m.lora {
            None => (total_params, whole_copy, unit_sizes(&params)),
            Some(spec) => {
                let mut trained = adapter_param_shapes(cfg, spec).unwrap_or_default();
                let rollout = match shape.rollout_precision {
                    // The adapted projections, merged into a copy of their weights.
                    Precision::F32 => adapted_params(&params, &trained) * F32,
                    Precision::Bf16 => whole_copy,
                };
                if m.is_critic {
                    trained.extend(head.iter().cloned());
                }
                (count(&trained), rollout, unit_sizes(&trained))
            }
        };
        let tokens = shape.batch_tokens as u64;
        let activations = tokens * activation_bytes(cfg, m, shape);
        // f32: the logits and their gradient; bf16: the head's product and its widening, and
        // the gradients of both.
        let logit_bytes = match shape.precision {
            Precision::F32 => 2 * F32,
            Precision::Bf16 => 2 * (F32 + BF16),
        };
        let logits = if m.is_critic {
            0
        } else {
            shape.logit_rows as u64 * cfg.vocab_size as u64 * logit_bytes
        };
        // The critic's value head reads f32; every other weight is cast for the products.
        let working_weights = match shape.precision {
            Precision::F32 => 0,
            Precision::Bf16 => (total_params - if m.is_critic { count(&head) } else { 0 }) * BF16,
        };
        let own_weights = if m.shares_policy_weights {
            count(&head)
        } else {
            total_params
        };
        // A tied embedding trained in full gets two gradients (lookup and LM head), summed.
        let tied_sum = if m.lora.is_none() && cfg.tie_word_embeddings && !m.is_critic {
            (cfg.vocab_size * cfg.hidden_size) as u64 * F32
        } else {
            0
        };
        Self {
            weights: own_weights * F32,
            working_weights,
            rollout_weights: if m.is_critic { 0 } else { rollout_weights },
            gradients: trained_params * F32 + tied_sum,
            optimizer: 2 * optimizer_params(trained_params, shape) * F32,
            activations,
            logits,
            trained_params,
            units,
            total_params,
        }
    }
}

/// The values of each unit of `params` as an optimizer step moves them (its parameters in name
/// order, [`layer_units`]).
fn unit_sizes(params: &[(String, Vec<usize>)]) -> Vec<u64> {
    let mut sorted: Vec<(&str, u64)> = params
        .iter()
        .map(|(n, s)| (n.as_str(), s.iter().product::<usize>() as u64))
        .collect();
    sorted.sort();
    let mut at = 0;
    let mut units = Vec::new();
    for n in layer_units(sorted.iter().map(|(name, _)| *name)) {
        units.push(sorted[at..at + n].iter().map(|(_, v)| v).sum());
        at += n;
    }
    units
}

/// The trained parameters whose moments this rank keeps: its block of them when the optimizer
/// is sharded.
fn optimizer_params(trained: u64, shape: &PlanShape) -> u64 {
    match shape.sharding.shards_optimizer() {
        true => trained.div_ceil(shape.ranks as u64),
        false => trained,
    }
}

/// Parameters of the projections that adapters `adapters` adapt (each `…proj.weight` under an
/// adapter `…proj.lora_A.weight`).
fn adapted_params(params: &[(String, Vec<usize>)], adapters: &[(String, Vec<usize>)]) -> u64 {
    params
        .iter()
        .filter(|(name, _)| {
            name.strip_suffix(".weight").is_some_and(|path| {
                adapters
                    .iter()
                    .any(|(a, _)| a == &format!("{path}.lora_A.weight"))
            })
        })
        .map(|(_, s)| s.iter().product::<usize>() as u64)
        .sum()
}

/// Bytes the backward keeps per token of a forward, all layers.
fn activation_bytes(cfg: &ModelConfig, m: &TrainedModel, shape: &PlanShape) -> u64 {
    let (h, i) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
    let heads = cfg.num_attention_heads as u64;
    let kv = (cfg.num_key_value_heads * cfg.head_dim()) as u64;
    let q = heads * cfg.head_dim() as u64;
    let product = shape.precision.product_bytes();
    let mut per_layer = match shape.precision {
        Precision::F32 => (11 * h + 4 * kv + 3 * i) * F32,
        Precision::Bf16 => 46 * h + 10 * q + 20 * kv + 8 * i,
    };
    if let Some(spec) = &m.lora {
        let targets = spec.targets().unwrap_or_default();
        let out_width = |module: &str| match module {
            "q_proj" => q,
            "k_proj" | "v_proj" => kv,
            "o_proj" | "down_proj" => h,
            _ => i,
        };
        // The base's output, the adapter's and their sum; off the fused CPU op, the frozen
        // product's output is passed through once more (its gradient reaches the input alone).
        let outputs = if shape.precision == Precision::F32 && shape.device == PlanDevice::Cpu {
            2
        } else {
            3
        };
        per_layer += targets
            .iter()
            .map(|t| outputs * out_width(t) + spec.rank as u64)
            .sum::<u64>()
            * product;
    }
    if shape.device == PlanDevice::Cuda {
        per_layer += 3 * heads * shape.sequence_tokens as u64 * F32;
    }
    let layers = cfg.num_hidden_layers as u64;
    if shape.activation_checkpointing {
        // Each block keeps its input and its output's copy; one block's activations and their
        // gradients live at a time, while the backward recomputes it.
        return (2 * h * layers + 2 * h) * F32 + 2 * per_layer;
    }
    per_layer * layers + 2 * h * F32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(cfg: ModelConfig, lora: Option<LoraSpec>, tokens: usize) -> PlanShape {
        PlanShape {
            policy: TrainedModel {
                config: cfg,
                lora,
                is_critic: false,
                shares_policy_weights: false,
            },
            critic: None,
            device: PlanDevice::Cpu,
            batch_tokens: tokens,
            logit_rows: tokens / 2,
            sequence_tokens: tokens,
            activation_checkpointing: false,
            precision: Precision::F32,
            rollout_precision: Precision::F32,
            kv_slots: 0,
            extra_policy_copies: 0,
            ranks: 1,
            sharding: Default::default(),
        }
    }

    #[test]
    fn sharding_divides_the_moments_and_sizes_the_step_buffers_per_rank() {
        let cfg = ModelConfig::small(1000);
        let whole = MemoryPlan::of(&shape(cfg.clone(), None, 64));
        let p = whole.trained_params;
        assert_eq!((whole.optimizer, whole.step_buffers), (8 * p, 0));
        let shape_at = |ranks: usize, sharding: Sharding| PlanShape {
            ranks,
            sharding,
            ..shape(cfg.clone(), None, 64)
        };
        let at = |ranks: usize, sharding: Sharding| MemoryPlan::of(&shape_at(ranks, sharding));
        let block = p.div_ceil(3) * F32;
        // On the CPU every sum goes through the host: a copy, and MPI's send buffer.
        let replicated = at(3, Sharding::None);
        let buffers = |plan: &MemoryPlan| (plan.optimizer, plan.step_buffers);
        // Gradients are summed one unit at a time (the embedding, four layers, the final norm,
        // in name order): on the host each unit's flat copy, host copy and sum (3 units) beside
        // the sums of the units before it.
        let params = Model::param_shapes(&cfg);
        let size = |prefix: &str| -> u64 {
            let of = |s: &Vec<usize>| s.iter().product::<usize>() as u64;
            params
                .iter()
                .filter(|(n, _)| n.starts_with(prefix))
                .map(|(_, s)| of(s))
                .sum()
        };
        let (embedding, layer) = (size("model.embed_tokens."), size("model.layers.0."));
        assert_eq!(p, embedding + 4 * layer + size("model.norm."));
        let last_layer = (embedding + 3 * layer + 3 * layer) * F32;
        assert!(
            3 * embedding < embedding + 6 * layer,
            "a layer is the largest unit here"
        );
        assert_eq!(buffers(&replicated), (8 * p, last_layer));
        // A sharded step keeps only this rank's block of each unit's sum, then gathers the
        // updated blocks a unit at a time.
        let zero1 = at(3, Sharding::Optimizer);
        let zero2 = at(3, Sharding::Gradients);
        assert_eq!((zero1.optimizer, zero2.optimizer), (2 * block, 2 * block));
        let blocks = [embedding, layer, layer, layer, layer, size("model.norm.")]
            .map(|u| u.div_ceil(3))
            .iter()
            .sum::<u64>();
        let gathering = (3 * blocks + 2 * layer.div_ceil(3) * 3) * F32;
        assert_eq!(
            (zero1.step_buffers, zero2.step_buffers),
            (gathering, gathering)
        );
        assert!(zero2.peak() <= zero1.peak() && zero1.peak() < replicated.peak());
        let table = zero2.table(&shape_at(3, Sharding::Gradients), None);
        assert!(table.contains("this rank's 1/3"), "{table}");
    }

    #[test]
    fn full_fine_tuning_holds_four_copies_of_the_weights_and_lora_far_fewer() {
        let cfg = ModelConfig::small(1000);
        let full = MemoryPlan::of(&shape(cfg.clone(), None, 0));
        let params = full.total_params;
        assert_eq!(full.weights, 4 * params);
        let tied = 4 * 1000 * cfg.hidden_size as u64;
        assert_eq!(full.gradients + full.optimizer, 12 * params + tied);
        assert_eq!(full.peak(), 16 * params + tied + full.logits);
        let spec = LoraSpec {
            rank: 4,
            alpha: 8.0,
            dropout: 0.0,
            target_modules: vec!["all-linear".into()],
        };
        let lora = MemoryPlan::of(&shape(cfg, Some(spec), 0));
        assert!(
            lora.trained_params * 10 < params,
            "{} of {params}",
            lora.trained_params
        );
        assert!(lora.rollout_weights > 0 && lora.rollout_weights < lora.weights);
        assert!(lora.peak() < full.peak());
    }

    #[test]
    fn a_budget_refuses_a_forward_past_it_with_the_table() {
        let s = shape(ModelConfig::small(1000), None, 64);
        let start = MemoryPlan::of(&s).peak();
        let budget = MemoryBudget::new(s.clone(), start + (1 << 20));
        assert!(budget.check_start().is_ok());
        assert_eq!(
            budget.take_largest_planned(),
            None,
            "check_start is no forward"
        );
        assert!(budget.check_forward(64, 32, 64).is_ok());
        let err = budget
            .check_forward(64 * 1024, 32 * 1024, 1024)
            .unwrap_err();
        assert!(err.contains("peak of an update"), "{err}");
        assert!(err.contains("largest forward that fits"), "{err}");
        // The refused forward's plan is the largest, and taking it starts over.
        let refused = PlanShape {
            batch_tokens: 64 * 1024,
            logit_rows: 32 * 1024,
            sequence_tokens: 1024,
            ..s
        };
        let largest = MemoryPlan::of(&refused).peak();
        assert_eq!(budget.take_largest_planned(), Some(largest));
        assert_eq!(budget.take_largest_planned(), None);
    }

    #[test]
    fn checkpointing_keeps_two_vectors_a_layer_and_one_block() {
        let mut s = shape(ModelConfig::small(1000), None, 1024);
        let kept = MemoryPlan::of(&s).activations;
        s.activation_checkpointing = true;
        let recomputed = MemoryPlan::of(&s).activations;
        let cfg = ModelConfig::small(1000);
        let h = cfg.hidden_size as u64;
        let per_layer = (kept / (4 * 1024) - 2 * h) / cfg.num_hidden_layers as u64;
        let layers = cfg.num_hidden_layers as u64;
        assert_eq!(
            recomputed,
            4 * 1024 * (2 * h * layers + 2 * per_layer + 2 * h)
        );
        assert!(recomputed < kept, "{recomputed} vs {kept}");
    }

    #[test]
    fn bf16_rollouts_on_the_cpu_add_a_bf16_copy_of_the_weights() {
        let mut s = shape(ModelConfig::small(1000), None, 256);
        let f32_plan = MemoryPlan::of(&s);
        assert_eq!(
            f32_plan.rollout_weights, 0,
            "f32 rollouts read the trained weights"
        );
        s.rollout_precision = Precision::Bf16;
        assert_eq!(
            MemoryPlan::of(&s).rollout_weights,
            2 * f32_plan.total_params
        );
    }

    #[test]
    fn bf16_adds_a_working_copy_and_keeps_products_in_two_bytes() {
        let cfg = ModelConfig::small(1000);
        let mut s = shape(cfg.clone(), None, 1024);
        let f32_plan = MemoryPlan::of(&s);
        s.precision = Precision::Bf16;
        let bf16 = MemoryPlan::of(&s);
        assert_eq!(f32_plan.working_weights, 0);
        assert_eq!(bf16.working_weights, 2 * bf16.total_params);
        assert_eq!(bf16.weights, f32_plan.weights);
        assert_eq!(bf16.optimizer, f32_plan.optimizer);
        assert_eq!(bf16.gradients, f32_plan.gradients);
        let (h, i) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
        let kv = (cfg.num_key_value_heads * cfg.head_dim()) as u64;
        let q = (cfg.num_attention_heads * cfg.head_dim()) as u64;
        let per_layer = 46 * h + 10 * q + 20 * kv + 8 * i;
        let layers = cfg.num_hidden_layers as u64;
        assert_eq!(bf16.activations, 1024 * (per_layer * layers + 8 * h));
        assert_eq!(bf16.logits, 3 * f32_plan.logits / 2);
    }

    #[test]
    fn the_largest_batch_is_the_edge_of_what_fits() {
        let s = shape(ModelConfig::small(1000), None, 1024);
        let budget = MemoryPlan::of(&s).peak();
        let tokens = largest_batch(&s, budget).unwrap();
        assert!((1000..=1030).contains(&tokens), "{tokens}");
        let weights_only = MemoryPlan::of(&shape(ModelConfig::small(1000), None, 0)).peak();
        assert_eq!(largest_batch(&s, weights_only / 2), None);
    }
}
