//! The policy and critic models (dense Qwen2, Qwen3 and Llama families) and their checkpoint files.
//!
//! [`Model`] is the policy: the decoder trunk ([`decoder`]) plus a tied or untied LM head, its
//! parameters as named `Var`s in a `VarMap` (HF names, so checkpoints load by name and the
//! trainer's optimiser steps them). It has the two forward paths of the design: the incremental
//! one over a [`KvPool`] (no autograd graph) and the padded training one (differentiable ops only),
//! plus token log-probs/entropy; the training path also takes a packed [`TreeBatch`] whose
//! sequences share prefixes ([`tree`]). [`Critic`] is a model of the same family with a value head;
//! a shared-trunk value head on the policy is the option. Checkpoint files are [`checkpoint`]'s.
//! Activation checkpointing ([`Model::set_activation_checkpointing`]) is [`recompute`]'s; every
//! training loss is differentiated by [`backward`]. bf16 mixed precision of the training path
//! ([`Model::set_precision`]) is [`precision`]'s.

pub mod attention;
pub mod checkpoint;
pub mod config;
pub mod critic;
pub mod decoder;
mod fused;
pub mod lora;
pub mod params;
pub mod precision;
mod recompute;
pub mod rope;
pub mod tree;

use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::VarMap;

use crate::kv::{KvError, KvPool, SeqSlots};
pub use config::ModelConfig;
pub use critic::{Critic, ValueHead, ValueMlp};
use decoder::{Linear, Trunk};
pub use fused::TrainingOps;
pub use lora::{Adapters, LoraSpec};
pub use precision::Precision;
pub use recompute::backward;
pub use tree::{Segment, TreeBatch};

/// Errors of the model module; file errors name the file and tensor.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The KV pool refused an operation.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The tokenizer failed.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// Reading or writing a file or directory failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A model or adapter config is unreadable or invalid.
    #[error("{path}: {message}")]
    Config {
        /// The config file (`<config>` for one given in memory).
        path: String,
        /// What is wrong with it.
        message: String,
    },
    /// A safetensors file could not be read or written.
    #[error("{path}: {message}")]
    Safetensors {
        /// The safetensors file.
        path: String,
        /// The safetensors library's message.
        message: String,
    },
    /// A tensor the model needs is in none of the weight files.
    #[error("tensor `{name}` is missing (looked in {files})")]
    MissingTensor {
        /// Name of the missing tensor.
        name: String,
        /// The files searched, comma-separated.
        files: String,
    },
    /// A weight file holds a tensor the configured model does not have.
    #[error("tensor `{name}` in {file} is not part of a `{model_type}` model as its config.json describes it")]
    UnexpectedTensor {
        /// Name of the unexpected tensor.
        name: String,
        /// The file that holds it.
        file: String,
        /// `model_type` of the config.
        model_type: String,
    },
    /// A tensor's shape differs from what the config implies.
    #[error("tensor `{name}` in {file} has shape {found:?}, expected {expected:?}")]
    WrongShape {
        /// Name of the tensor.
        name: String,
        /// The file that holds it.
        file: String,
        /// Shape the config implies.
        expected: Vec<usize>,
        /// Shape found in the file.
        found: Vec<usize>,
    },
    /// Arguments a model call cannot take (token ids, batch layout, missing head, ...).
    #[error("invalid input: {0}")]
    Input(String),
}

/// Result of the model module's operations.
pub type Result<T> = std::result::Result<T, ModelError>;

/// New tokens of one sequence for [`Model::forward_incremental`]: `slots` has the slot of every
/// position so far (`context_len + new_tokens.len()` entries); the last `new_tokens.len()` slots
/// receive the new K/V, and new token i sits at position `context_len + i`.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// Ids of the new tokens; the K/V of the earlier positions are already in the pool.
    pub new_tokens: &'a [u32],
    /// KV slot of every position, old and new.
    pub slots: &'a [u32],
}

/// Which logits [`Model::forward_incremental`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// `[batch, vocab]`: the last new token of each sequence.
    Last,
    /// `[sum of new tokens, vocab]`: every new token, in batch order.
    All,
}

/// Token ids and attention mask of right-padded sequences.
pub struct PaddedBatch {
    /// `[B, T]` u32.
    pub input_ids: Tensor,
    /// `[B, T]` u32, 1 for real tokens.
    pub attention_mask: Tensor,
}

impl PaddedBatch {
    /// Right-pads `seqs` with `pad_id` to the longest length.
    pub fn right_padded(seqs: &[Vec<u32>], pad_id: u32, device: &Device) -> Result<Self> {
        let t_len = seqs.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(seqs.len() * t_len);
        let mut mask = Vec::with_capacity(seqs.len() * t_len);
        for s in seqs {
            ids.extend(
                s.iter()
                    .copied()
                    .chain(std::iter::repeat_n(pad_id, t_len - s.len())),
            );
            mask.extend((0..t_len).map(|t| u32::from(t < s.len())));
        }
        Ok(Self {
            input_ids: Tensor::from_vec(ids, (seqs.len(), t_len), device)?,
            attention_mask: Tensor::from_vec(mask, (seqs.len(), t_len), device)?,
        })
    }
}

/// The tokens of a training forward: right-padded sequences, or a packed [`TreeBatch`] whose
/// sequences share their prefixes (each shared prefix forwarded once).
pub enum TrainInput {
    /// Right-padded sequences, one row each.
    Padded(PaddedBatch),
    /// Sequences packed with their shared prefixes forwarded once.
    Tree(TreeBatch),
}

impl TrainInput {
    /// Positions a forward computes: `B × T` padded (padding included), the packed tokens of a
    /// tree.
    pub fn positions(&self) -> usize {
        match self {
            TrainInput::Padded(b) => b.input_ids.elem_count(),
            TrainInput::Tree(t) => t.len(),
        }
    }
}

/// The incremental (rollout) path's dtype unless chosen: f32 on the CPU, bf16 on an accelerator.
pub fn default_rollout_precision(device: &Device) -> Precision {
    if device.is_cpu() {
        Precision::F32
    } else {
        Precision::Bf16
    }
}

/// How the incremental (rollout) path applies LoRA adapters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AdapterRollout {
    /// Folded into the projections' weights after each update (`W + scale · B A`, a copy): the
    /// decode costs what the base model's does.
    #[default]
    Merged,
    /// Kept beside the weights: two thin products more per projection and token, no copy.
    Unmerged,
}

/// The policy: decoder trunk + LM head over `Var`s in a `VarMap`.
pub struct Model {
    cfg: ModelConfig,
    varmap: VarMap,
    device: Device,
    /// Weights as tracked `Var` tensors (training path).
    trunk: Trunk,
    lm_head: Tensor,
    /// The same storage, detached (incremental path).
    frozen_trunk: Trunk,
    frozen_lm_head: Tensor,
    value_head: Option<ValueHead>,
    /// LoRA adapters on the projections; while attached, the base weights are frozen.
    adapters: Option<Adapters>,
    adapter_rollout: AdapterRollout,
    /// The dtype generation stores weights, activations and K/V in.
    rollout_precision: Precision,
}

impl Model {
    /// A freshly initialised model (HF init: normal(0, initializer_range), zero biases, unit norms).
    pub fn new(cfg: &ModelConfig, seed: u64, device: &Device) -> Result<Self> {
        let specs = Self::param_shapes(cfg);
        let varmap = params::init_varmap(cfg, &specs, seed, device)?;
        Self::from_varmap(cfg, varmap, device)
    }

    /// Builds the model over `varmap`, which must hold every name of [`Model::param_shapes`]
    /// (and may hold a shared value head `score.*`).
    pub fn from_varmap(cfg: &ModelConfig, varmap: VarMap, device: &Device) -> Result<Self> {
        cfg.validate().map_err(|message| ModelError::Config {
            path: "<config>".into(),
            message,
        })?;
        let get = |name: &str| params::var_tensor(&varmap, name);
        let trunk = Trunk::from_named(cfg, &get)?;
        let lm_head = if cfg.tie_word_embeddings {
            trunk.embed.clone()
        } else {
            get("lm_head.weight")?
        };
        let value_head = ValueHead::from_varmap(&varmap)?;
        let rollout_precision = default_rollout_precision(device);
        let dtype = rollout_precision.dtype();
        Ok(Self {
            cfg: cfg.clone(),
            frozen_trunk: trunk.rollout_copy(dtype, true)?,
            frozen_lm_head: decoder::rollout_tensor(&lm_head, dtype)?,
            trunk,
            lm_head,
            varmap,
            device: device.clone(),
            value_head,
            adapters: None,
            adapter_rollout: AdapterRollout::default(),
            rollout_precision,
        })
    }

    /// Re-reads the incremental path's weights from the trained ones. Needed after an optimizer
    /// step where the rollout weights are a copy (bf16 on CUDA, merged LoRA adapters); on the
    /// CPU without adapters they share storage and this is cheap.
    pub fn refresh_rollout_weights(&mut self) -> Result<()> {
        let dtype = self.rollout_precision.dtype();
        let merge = self.adapter_rollout == AdapterRollout::Merged;
        self.frozen_trunk = self.trunk.rollout_copy(dtype, merge)?;
        self.frozen_lm_head = decoder::rollout_tensor(&self.lm_head, dtype)?;
        Ok(())
    }

    /// A copy of the model as it is now, in storage of its own: training this model never moves
    /// the copy (a rollout thread generates with it while the trainer updates).
    pub fn snapshot(&self) -> Result<Self> {
        let varmap = VarMap::new();
        for (name, var) in self.named_vars() {
            params::insert(&varmap, &name, &var.as_tensor().copy()?)?;
        }
        let mut copy = Self::from_varmap(&self.cfg, varmap, &self.device)?;
        copy.adapter_rollout = self.adapter_rollout;
        copy.set_rollout_precision(self.rollout_precision)?;
        if let Some(adapters) = &self.adapters {
            copy.attach_adapters(adapters.deep_copy()?)?;
        }
        Ok(copy)
    }

    /// Attaches LoRA `adapters` to the projections they name and freezes every base weight
    /// (the trunk, the LM head): from now on only the adapters and a shared value head are
    /// trainable ([`Model::trainable_vars`]). Replaces adapters attached before.
    pub fn attach_adapters(&mut self, adapters: Adapters) -> Result<()> {
        let mut trunk = self.trunk.frozen_base();
        for (path, linear) in trunk.projections_mut() {
            linear.lora = adapters.pair(&path)?;
        }
        self.trunk = trunk;
        self.lm_head = self.lm_head.detach();
        self.adapters = Some(adapters);
        self.refresh_rollout_weights()
    }

    /// Chooses how generation applies the adapters (merged by default: `benches/lora.rs`
    /// measures both) and refreshes the rollout weights.
    pub fn set_adapter_rollout(&mut self, mode: AdapterRollout) -> Result<()> {
        self.adapter_rollout = mode;
        self.refresh_rollout_weights()
    }

    /// The attached LoRA adapters, if any.
    pub fn adapters(&self) -> Option<&Adapters> {
        self.adapters.as_ref()
    }

    /// The base model under the adapters: the same weights (no copy), no adapters. With none
    /// attached, the model itself.
    pub fn without_adapters(&self) -> Result<Self> {
        let mut trunk = self.trunk.clone();
        for (_, linear) in trunk.projections_mut() {
            linear.lora = None;
        }
        let dtype = self.rollout_precision.dtype();
        Ok(Self {
            cfg: self.cfg.clone(),
            varmap: self.varmap.clone(),
            device: self.device.clone(),
            frozen_trunk: trunk.rollout_copy(dtype, true)?,
            frozen_lm_head: decoder::rollout_tensor(&self.lm_head, dtype)?,
            trunk,
            lm_head: self.lm_head.clone(),
            value_head: self.value_head.clone(),
            adapters: None,
            adapter_rollout: AdapterRollout::default(),
            rollout_precision: self.rollout_precision,
        })
    }

    /// A plain model (storage of its own) with the adapters folded into the projections'
    /// weights, `W + (alpha / r) · B A`: what `merge_and_unload` gives in PEFT.
    pub fn merged(&self) -> Result<Self> {
        let varmap = VarMap::new();
        for (name, var) in self.named_vars() {
            params::insert(&varmap, &name, &var.as_tensor().copy()?)?;
        }
        let mut trunk = self.trunk.clone();
        for (path, linear) in trunk.projections_mut() {
            if linear.lora.is_some() {
                params::insert(&varmap, &format!("{path}.weight"), &linear.merged_weight()?)?;
            }
        }
        Self::from_varmap(&self.cfg, varmap, &self.device)
    }

    /// HF names and shapes of every parameter (the trunk and, when untied, `lm_head.weight`).
    pub fn param_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
        let mut specs = decoder::trunk_param_shapes(cfg);
        if !cfg.tie_word_embeddings {
            specs.push((
                "lm_head.weight".into(),
                vec![cfg.vocab_size, cfg.hidden_size],
            ));
        }
        specs
    }

    /// The model's architecture config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Recomputes each decoder block's activations in the backward instead of keeping them from
    /// the forward (gradients through [`backward`]): memory for time, the same gradients to float
    /// rounding.
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        self.trunk.activation_checkpointing = on;
    }

    /// Chooses the dtype of the training path's matrix products (f32 master weights either way;
    /// see [`precision`]). The rollout path is unaffected.
    pub fn set_precision(&mut self, precision: Precision) {
        self.trunk.precision = precision;
    }

    /// Chooses the dtype generation stores its weights, activations and K/V in (the default is
    /// [`default_rollout_precision`]; see [`precision`]) and refreshes the rollout weights. The
    /// training path is unaffected. A KV pool for this model is made in the same dtype
    /// ([`crate::kv::KvPool::with_dtype`]; CUDA pools refuse another).
    pub fn set_rollout_precision(&mut self, precision: Precision) -> Result<()> {
        self.rollout_precision = precision;
        self.refresh_rollout_weights()
    }

    /// The dtype generation runs in.
    pub fn rollout_precision(&self) -> Precision {
        self.rollout_precision
    }

    /// Chooses the training forward's ops (fused on the CPU by default); both compute the same
    /// function, to f32 rounding.
    pub fn set_training_ops(&mut self, ops: TrainingOps) {
        self.trunk.ops = ops;
        self.frozen_trunk.ops = ops;
    }

    /// The device the parameters live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The parameters, for the optimiser and checkpoints.
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// Every parameter of the model by HF name, sorted by name (the base weights, and a shared
    /// value head `score.*`; not the adapters).
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        params::named_vars(&self.varmap)
    }

    /// The parameters an optimizer steps, sorted by name: every one of [`Model::named_vars`]
    /// without adapters; with adapters, the adapters and a shared value head only.
    pub fn trainable_vars(&self) -> Vec<(String, Var)> {
        match &self.adapters {
            None => self.named_vars(),
            Some(adapters) => {
                let mut vars = adapters.named_vars();
                vars.extend(
                    self.named_vars()
                        .into_iter()
                        .filter(|(name, _)| name.starts_with(critic::VALUE_HEAD_PREFIX)),
                );
                vars.sort_by(|a, b| a.0.cmp(&b.0));
                vars
            }
        }
    }

    /// Logits of new tokens of a batch of sequences, writing their K/V into `pool`. Prefill and
    /// decode are the same call. Uses detached weights: nothing is recorded for autograd.
    pub fn forward_incremental(
        &self,
        batch: &[SeqChunk],
        pool: &mut KvPool,
        logits: LogitsWanted,
    ) -> Result<Tensor> {
        let seqs = check_chunks(batch)?;
        let ids: Vec<u32> = batch
            .iter()
            .flat_map(|c| c.new_tokens.iter().copied())
            .collect();
        decoder::check_ids(&ids, self.cfg.vocab_size)?;
        let hidden = self.frozen_trunk.forward_incremental(&ids, &seqs, pool)?;
        let hidden = match logits {
            LogitsWanted::All => hidden,
            LogitsWanted::Last => {
                let last: Vec<u32> = seqs
                    .iter()
                    .scan(0u32, |end, s| {
                        *end += s.num_new as u32;
                        Some(*end - 1)
                    })
                    .collect();
                hidden.index_select(&Tensor::new(last.as_slice(), &self.device)?, 0)?
            }
        };
        Ok(hidden
            .matmul(&self.frozen_lm_head.t()?)?
            .to_dtype(DType::F32)?)
    }

    /// Final hidden states `[B, T, hidden]` of a padded batch (differentiable).
    pub fn hidden_train(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        self.trunk.forward_train(input_ids, attention_mask)
    }

    /// Final hidden states of `input` (differentiable): `[B, T, hidden]` padded, `[1, N, hidden]`
    /// a tree; the heads read either alike.
    pub fn hidden(&self, input: &TrainInput) -> Result<Tensor> {
        self.trunk.forward_input(input)
    }

    /// The features a [`ValueMlp`] reads, `[B, T, F]` padded or `[1, N, F]` a tree,
    /// detached, each part scaled to unit RMS per position (no weights) and set side by side: the
    /// residual stream after each of the last [`critic::FEATURE_BLOCKS`] blocks at the position,
    /// and the mean over the positions of its sequence up to it of the embeddings and of the last
    /// block's stream (what the sequence so far holds, which the position's own stream, dominated
    /// by its token, carries only faintly). `F` is [`Model::value_feature_width`].
    pub fn value_features(&self, input: &TrainInput) -> Result<Tensor> {
        let (_, streams) = self.trunk.forward_input_streams(input, true)?;
        let blocks = &streams[streams.len() - self.feature_blocks()..];
        let pooled = [&streams[0], &streams[streams.len() - 1]]
            .into_iter()
            .map(|x| match input {
                TrainInput::Padded(_) => prefix_mean(x),
                TrainInput::Tree(tree) => tree_prefix_mean(x, tree),
            })
            .collect::<Result<Vec<_>>>()?;
        let unit: Vec<Tensor> = blocks
            .iter()
            .chain(&pooled)
            .map(|x| {
                let x = x.detach();
                let rms = (x.sqr()?.mean_keepdim(D::Minus1)? + 1e-6)?.sqrt()?;
                Ok(x.broadcast_div(&rms)?)
            })
            .collect::<Result<_>>()?;
        Ok(Tensor::cat(&unit, D::Minus1)?)
    }

    /// How many blocks' streams [`Model::value_features`] reads at the position.
    fn feature_blocks(&self) -> usize {
        self.cfg.num_hidden_layers.min(critic::FEATURE_BLOCKS)
    }

    /// Width of [`Model::value_features`].
    pub fn value_feature_width(&self) -> usize {
        (self.feature_blocks() + 2) * self.cfg.hidden_size
    }

    /// Logits `[B, T, vocab]` of a padded batch with a causal + padding mask (differentiable).
    pub fn forward_train(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let hidden = self.hidden_train(input_ids, attention_mask)?;
        self.lm_head_logits(&hidden)
    }

    /// The LM head's f32 logits of trunk outputs `hidden` (a product in the training precision).
    fn lm_head_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let head = Linear::plain(self.lm_head.clone(), None);
        let logits = head.forward_in(hidden, self.trunk.ops, self.trunk.precision)?;
        self.trunk.precision.widen(logits)
    }

    /// Per position: log-prob of `targets[b, t]` and entropy, both `[B, T]`, under the logits
    /// divided by `temperature` (the sampler's scaling), differentiable.
    pub fn token_logprobs_entropy(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        targets: &Tensor,
        temperature: f32,
    ) -> Result<(Tensor, Tensor)> {
        let (b_sz, t_len) = input_ids.dims2()?;
        let positions = Tensor::arange(0, (b_sz * t_len) as u32, &self.device)?;
        let hidden = self.hidden_train(input_ids, attention_mask)?;
        let (logp, entropy) = self.head_logprobs_entropy(
            &hidden,
            &positions,
            &targets.flatten_all()?,
            temperature,
            None,
        )?;
        Ok((
            logp.reshape((b_sz, t_len))?,
            entropy.reshape((b_sz, t_len))?,
        ))
    }

    /// Log-prob of `targets[n]` and entropy at each of `positions` (flat indices into the padded
    /// `[B, T]` batch), both `[N]`, under the logits divided by `temperature`, differentiable. The
    /// LM head and its softmax run on those N positions only, not on all B×T. `logit_bias`
    /// (`[N, vocab]`, added after the temperature) masks tokens a response grammar forbids.
    pub fn logprobs_entropy_at(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        positions: &Tensor,
        targets: &Tensor,
        temperature: f32,
        logit_bias: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let hidden = self.hidden_train(input_ids, attention_mask)?;
        self.head_logprobs_entropy(&hidden, positions, targets, temperature, logit_bias)
    }

    /// The LM head's log-probs of `targets` and entropies for trunk outputs `hidden` `[B, T, H]`
    /// at `positions` (flat indices into `[B, T]`), both `[N]`, with the optional `[N, vocab]`
    /// `logit_bias` added to the scaled logits.
    pub fn head_logprobs_entropy(
        &self,
        hidden: &Tensor,
        positions: &Tensor,
        targets: &Tensor,
        temperature: f32,
        logit_bias: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        check_temperature(temperature)?;
        let width = hidden.dim(D::Minus1)?;
        let picked = hidden.reshape(((), width))?.index_select(positions, 0)?;
        let logits = self.lm_head_logits(&picked)?;
        if self.trunk.ops == TrainingOps::Fused && fused::applies(&logits) {
            let bias = logit_bias.map(|b| b.to_dtype(logits.dtype())).transpose()?;
            return fused::logprobs_entropy(&logits, targets, temperature, bias.as_ref());
        }
        let mut logits = (logits / f64::from(temperature))?;
        if let Some(bias) = logit_bias {
            logits = logits.broadcast_add(&bias.to_dtype(logits.dtype())?)?;
        }
        logprobs_entropy(&logits, targets)
    }

    /// Adds a shared-trunk value head `score.*` (the option to a separate [`Critic`]) to this
    /// model's `VarMap`, initialised from `seed`; a no-op when it already has one.
    pub fn attach_value_head(&mut self, seed: u64) -> Result<()> {
        if self.value_head.is_none() {
            self.value_head = Some(ValueHead::init_in(
                &self.varmap,
                &self.cfg,
                seed,
                &self.device,
            )?);
        }
        Ok(())
    }

    /// Values of the shared-trunk head on the final hidden states of `input`: `[B, T]` padded,
    /// `[1, N]` a tree.
    pub fn values(&self, input: &TrainInput) -> Result<Tensor> {
        self.head_values(&self.hidden(input)?)
    }

    /// Values `[B, T]` of the shared-trunk head on `hidden` (from [`Model::hidden_train`]), so
    /// one trunk pass serves both heads.
    pub fn head_values(&self, hidden: &Tensor) -> Result<Tensor> {
        let head = self
            .value_head
            .as_ref()
            .ok_or_else(|| ModelError::Input("this policy has no shared value head".into()))?;
        head.forward(hidden)
    }
}

/// The mean of `x` `[B, T, H]` over positions `0..=t`, at every `t` (right padding never enters a
/// real position's mean).
fn prefix_mean(x: &Tensor) -> Result<Tensor> {
    let t_len = x.dim(1)?;
    let counts: Vec<f32> = (1..=t_len).map(|n| 1.0 / n as f32).collect();
    let inv = Tensor::from_vec(counts, (1, t_len, 1), x.device())?;
    Ok(x.detach().cumsum(1)?.broadcast_mul(&inv)?)
}

/// [`prefix_mean`] of the packed tokens `x` `[1, N, H]` of `tree`: a branch token's mean runs
/// over its root's tokens too.
fn tree_prefix_mean(x: &Tensor, tree: &TreeBatch) -> Result<Tensor> {
    let x = x.detach().squeeze(0)?;
    let segments = tree.segments();
    let sums = segments
        .iter()
        .map(|s| Ok(x.narrow(0, s.start, s.len)?.cumsum(0)?))
        .collect::<Result<Vec<_>>>()?;
    let parts = segments
        .iter()
        .zip(&sums)
        .map(|(s, sum)| match s.root {
            Some(r) => {
                let root_total = sums[r].narrow(0, segments[r].len - 1, 1)?;
                Ok(sum.broadcast_add(&root_total)?)
            }
            None => Ok(sum.clone()),
        })
        .collect::<Result<Vec<_>>>()?;
    let inv: Vec<f32> = tree
        .positions()
        .iter()
        .map(|&p| 1.0 / (p + 1) as f32)
        .collect();
    let inv = Tensor::from_vec(inv, (tree.len(), 1), x.device())?;
    Ok(Tensor::cat(&parts, 0)?.broadcast_mul(&inv)?.unsqueeze(0)?)
}

/// Sampling temperatures divide logits: they must be finite and positive.
fn check_temperature(temperature: f32) -> Result<()> {
    if temperature.is_finite() && temperature > 0.0 {
        Ok(())
    } else {
        Err(ModelError::Input(format!(
            "temperature must be positive, got {temperature}"
        )))
    }
}

/// Log-prob of `targets` and entropy per position from logits `[..., V]` (targets `[...]`).
pub fn logprobs_entropy(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let picked = logp.gather(
        &targets
            .to_dtype(DType::U32)?
            .unsqueeze(D::Minus1)?
            .contiguous()?,
        D::Minus1,
    )?;
    let entropy = (logp.exp()? * &logp)?.sum(D::Minus1)?.neg()?;
    Ok((picked.squeeze(D::Minus1)?, entropy))
}

fn check_chunks<'a>(batch: &[SeqChunk<'a>]) -> Result<Vec<SeqSlots<'a>>> {
    batch
        .iter()
        .enumerate()
        .map(|(i, c)| {
            if c.new_tokens.is_empty() || c.new_tokens.len() > c.slots.len() {
                return Err(ModelError::Input(format!(
                    "sequence {i}: {} new tokens with {} slots (need 1 ≤ new ≤ slots)",
                    c.new_tokens.len(),
                    c.slots.len()
                )));
            }
            Ok(SeqSlots {
                slots: c.slots,
                num_new: c.new_tokens.len(),
            })
        })
        .collect()
}
