//! The decoder trunk of the Qwen2, Qwen3 and Llama families (embedding, blocks, final norm) with
//! HF parameter names, and its forward passes over the same weights:
//! - [`Trunk::forward_train`]: padded `[B, T]` batches, causal + padding mask, differentiable: on
//!   the CPU the linear layers, norms, RoPE and SwiGLU gate are the fused ops of [`super::fused`]
//!   ([`TrainingOps::Fused`]), elsewhere candle's composed ops (manual RMSNorm, rotate-half RoPE);
//!   attention is the fused causal op of [`super::attention`] on CPU and matmuls with
//!   `ops::softmax` elsewhere;
//! - [`Trunk::forward_input`] of a packed [`TreeBatch`]: the same blocks, whose branches read
//!   their shared prefix's K/V (the attention of [`super::tree`]), also differentiable;
//! - [`Trunk::forward_incremental`]: new tokens of many sequences at once, K/V written to and read
//!   from a [`KvPool`] by slot; projections and MLP are batched matmuls, attention is the pool's
//!   CPU kernel. Callers pass detached weights so nothing is recorded for autograd.
//!
//! The passes share [`rms_norm`], [`apply_rope`] and the RoPE tables of [`super::rope`], so they
//! agree to float rounding. The families differ only in biases and Qwen3's per-head q/k RMSNorm
//! (see [`ModelConfig`]). Heads (LM head, value head) live in the parent module. With activation
//! checkpointing a block runs through `RecomputedBlock`, which recomputes it in the backward
//! (gradients collected by [`super::recompute`]).

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor, Var, D};

use super::attention::TrainingAttention;
use super::fused::{self, TrainingOps};
use super::precision::Precision;
use super::rope::Rope;
use super::tree::TreeBatch;
use super::{ModelConfig, ModelError, Result, TrainInput};
use crate::kv::{KvPool, SeqSlots};

/// Weights of one decoder block.
#[derive(Clone)]
struct Block {
    input_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// Qwen3's per-head RMSNorm weights `[head_dim]` of q and k.
    qk_norm: Option<(Tensor, Tensor)>,
    post_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// `y = x Wᵀ + b` over the last dimension, plus a LoRA adapter's `scale · (x Aᵀ) Bᵀ` when one is
/// attached.
#[derive(Clone)]
pub(crate) struct Linear {
    pub(crate) weight: Tensor,
    pub(crate) bias: Option<Tensor>,
    pub(crate) lora: Option<LoraPair>,
}

/// A low-rank adapter on a [`Linear`]: `a` `[r, in]`, `b` `[out, r]`, `scale` = alpha / r.
#[derive(Clone)]
pub(crate) struct LoraPair {
    pub(crate) a: Tensor,
    pub(crate) b: Tensor,
    pub(crate) scale: f64,
}

impl Linear {
    /// A layer without an adapter.
    pub(crate) fn plain(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            weight,
            bias,
            lora: None,
        }
    }

    /// The layer with the ops of the tensor's device (fused on the CPU).
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, TrainingOps::for_device(x.device()))
    }

    /// The layer with `ops`: one fused op where it applies, candle's matmul and add otherwise;
    /// an adapter adds its two thin products.
    pub(crate) fn forward_with(&self, x: &Tensor, ops: TrainingOps) -> Result<Tensor> {
        let y = affine(x, &self.weight, self.bias.as_ref(), ops)?;
        match &self.lora {
            None => Ok(y),
            Some(l) => {
                // The scale on the thin `[rows, r]` product, not on the full-width output.
                let low = (affine(x, &l.a, None, ops)? * l.scale)?;
                Ok((y + affine(&low, &l.b, None, ops)?)?)
            }
        }
    }

    /// The layer in `precision`: under bf16, its weights and input cast to bf16 (differentiable
    /// casts) and its output bf16; otherwise [`Linear::forward_with`].
    pub(crate) fn forward_in(
        &self,
        x: &Tensor,
        ops: TrainingOps,
        precision: Precision,
    ) -> Result<Tensor> {
        match precision.product_dtype() {
            None => self.forward_with(x, ops),
            Some(dtype) => self.cast(dtype)?.forward_with(&x.to_dtype(dtype)?, ops),
        }
    }

    /// The layer with every tensor cast to `dtype`, still tracked: gradients flow back to the
    /// originals.
    fn cast(&self, dtype: DType) -> Result<Self> {
        let lora = match &self.lora {
            Some(l) => Some(LoraPair {
                a: l.a.to_dtype(dtype)?,
                b: l.b.to_dtype(dtype)?,
                scale: l.scale,
            }),
            None => None,
        };
        Ok(Self {
            weight: self.weight.to_dtype(dtype)?,
            bias: self.bias.as_ref().map(|b| b.to_dtype(dtype)).transpose()?,
            lora,
        })
    }

    /// The weight with the adapter folded in: `W + scale · B A` (detached).
    pub(crate) fn merged_weight(&self) -> Result<Tensor> {
        let w = self.weight.detach();
        match &self.lora {
            None => Ok(w),
            Some(l) => {
                let delta = l.b.detach().matmul(&l.a.detach())?;
                Ok((w + (delta * l.scale)?.to_dtype(self.weight.dtype())?)?)
            }
        }
    }

    /// The layer for the incremental path, detached, in `dtype`: an adapter merged into the
    /// weight, or (`merge` false) kept beside it.
    fn rollout_copy(&self, dtype: DType, merge: bool) -> Result<Self> {
        let bias = self
            .bias
            .as_ref()
            .map(|b| rollout_tensor(b, dtype))
            .transpose()?;
        if merge {
            return Ok(Self::plain(self.merged_weight()?.to_dtype(dtype)?, bias));
        }
        let lora = match &self.lora {
            Some(l) => Some(LoraPair {
                a: rollout_tensor(&l.a, dtype)?,
                b: rollout_tensor(&l.b, dtype)?,
                scale: l.scale,
            }),
            None => None,
        };
        Ok(Self {
            weight: rollout_tensor(&self.weight, dtype)?,
            bias,
            lora,
        })
    }

    /// The same layer with its base weight and bias detached (frozen under an adapter).
    fn frozen_base(&self) -> Self {
        Self {
            weight: self.weight.detach(),
            bias: self.bias.as_ref().map(Tensor::detach),
            lora: self.lora.clone(),
        }
    }
}

/// `x Wᵀ + b` over the last dimension of `x`: the fused op where it applies.
fn affine(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, ops: TrainingOps) -> Result<Tensor> {
    if ops == TrainingOps::Fused && fused::applies(x) {
        return fused::linear(x, weight, bias);
    }
    let dims = x.dims().to_vec();
    let rows: usize = dims[..dims.len() - 1].iter().product();
    let x2 = x.reshape((rows, dims[dims.len() - 1]))?;
    let frozen = !weight.track_op() && !bias.is_some_and(Tensor::track_op);
    let y = if frozen && x.track_op() {
        frozen_product(&x2, weight, bias)?
    } else {
        let y = x2.matmul(&weight.t()?)?;
        match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        }
    };
    let mut out_dims = dims;
    *out_dims.last_mut().expect("rank ≥ 1") = weight.dim(0)?;
    Ok(y.reshape(out_dims)?)
}

/// `x Wᵀ + b` (`x` `[rows, in]`) for a weight and bias nothing trains (a frozen base under
/// adapters). candle's matmul and add compute and keep a gradient for every input, a frozen
/// weight's too (a weight's worth of memory kept to the end of the backward, and a third of the
/// product's backward time); here the product runs on the detached input and [`InputGradient`]
/// routes the gradient to `x` alone.
fn frozen_product(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = x.detach().matmul(&weight.t()?)?;
    let y = match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    Ok(y.contiguous()?.apply_op2(
        x,
        InputGradient {
            weight: weight.clone(),
        },
    )?)
}

/// Passes a frozen product's output through; its backward is `∂x = ∂y W`, nothing for `W`.
struct InputGradient {
    weight: Tensor,
}

impl candle_core::CustomOp2 for InputGradient {
    fn name(&self) -> &'static str {
        "frozen-product"
    }

    fn cpu_fwd(
        &self,
        y: &CpuStorage,
        y_layout: &Layout,
        _x: &CpuStorage,
        _x_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        check_whole(self.name(), y_layout)?;
        Ok((y.clone(), y_layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        y_layout: &Layout,
        _x: &candle_core::CudaStorage,
        _x_layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        check_whole(self.name(), y_layout)?;
        Ok((y.try_clone(y_layout)?, y_layout.shape().clone()))
    }

    fn bwd(
        &self,
        _y: &Tensor,
        _x: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((None, Some(grad.matmul(&self.weight)?)))
    }
}

/// A storage the op copies whole must be exactly the tensor: contiguous from its start.
/// A pass-through op's output must be its whole storage, which the op copies as it is.
fn check_whole(op: &str, layout: &Layout) -> candle_core::Result<()> {
    if layout.is_contiguous() && layout.start_offset() == 0 {
        Ok(())
    } else {
        candle_core::bail!("{op}: the output is not a whole contiguous storage")
    }
}

/// Embedding, decoder blocks and final norm.
#[derive(Clone)]
pub(crate) struct Trunk {
    cfg: ModelConfig,
    /// Fused CPU ops or candle's composed ops for the norms, MLP gate and RoPE.
    pub(crate) ops: TrainingOps,
    /// The dtype of the training path's products ([`super::precision`]); the rollout copy is
    /// always [`Precision::F32`] (no casts: it computes in its weights' dtype).
    pub(crate) precision: Precision,
    rope: Rope,
    pub(crate) embed: Tensor,
    blocks: Vec<Block>,
    norm: Tensor,
    /// Recompute each block's activations in the backward instead of keeping them
    /// ([`super::recompute`]).
    pub(crate) activation_checkpointing: bool,
}

/// The attention of a training forward over `[B, heads, T, head_dim]` q, k, v: a padded batch
/// under its real-token mask, or a prefix tree whose branches read their root's K/V. Owned, so a
/// checkpointed block can run it again in the backward.
#[derive(Clone)]
pub(crate) enum Attend {
    Padded {
        attention: TrainingAttention,
        real_tokens: Arc<Vec<Vec<u32>>>,
        scale: f64,
    },
    Tree {
        attention: TrainingAttention,
        tree: Arc<TreeBatch>,
        scale: f64,
    },
}

impl Attend {
    fn apply(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        match self {
            Attend::Padded {
                attention,
                real_tokens,
                scale,
            } => attention.forward(q, k, v, real_tokens, *scale),
            Attend::Tree {
                attention,
                tree,
                scale,
            } => {
                let [q, k, v] = [q, k, v].map(|x| x.squeeze(0));
                Ok(attention.tree(&q?, &k?, &v?, tree, *scale)?.unsqueeze(0)?)
            }
        }
    }
}

/// HF names and shapes of every trunk parameter, in a fixed order.
pub(crate) fn trunk_param_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, hd, i) = (cfg.hidden_size, cfg.head_dim(), cfg.intermediate_size);
    let (q_out, kv_out) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    let mut specs = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
    )];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        specs.push((format!("{p}.input_layernorm.weight"), vec![h]));
        for (name, out) in [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)] {
            specs.push((format!("{p}.self_attn.{name}.weight"), vec![out, h]));
            if cfg.qkv_bias() {
                specs.push((format!("{p}.self_attn.{name}.bias"), vec![out]));
            }
        }
        specs.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q_out]));
        if cfg.o_bias() {
            specs.push((format!("{p}.self_attn.o_proj.bias"), vec![h]));
        }
        if cfg.qk_norm() {
            specs.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
            specs.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
        }
        specs.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        specs.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
        specs.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
        specs.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
    }
    specs.push(("model.norm.weight".to_string(), vec![h]));
    specs
}

impl Trunk {
    /// Builds the trunk from named tensors (`get` is called once per HF name).
    pub(crate) fn from_named(
        cfg: &ModelConfig,
        get: &impl Fn(&str) -> Result<Tensor>,
    ) -> Result<Self> {
        let linear = |name: &str, bias: bool| -> Result<Linear> {
            Ok(Linear::plain(
                get(&format!("{name}.weight"))?,
                if bias {
                    Some(get(&format!("{name}.bias"))?)
                } else {
                    None
                },
            ))
        };
        let blocks = (0..cfg.num_hidden_layers)
            .map(|l| {
                let p = format!("model.layers.{l}");
                Ok(Block {
                    input_norm: get(&format!("{p}.input_layernorm.weight"))?,
                    q: linear(&format!("{p}.self_attn.q_proj"), cfg.qkv_bias())?,
                    k: linear(&format!("{p}.self_attn.k_proj"), cfg.qkv_bias())?,
                    v: linear(&format!("{p}.self_attn.v_proj"), cfg.qkv_bias())?,
                    o: linear(&format!("{p}.self_attn.o_proj"), cfg.o_bias())?,
                    qk_norm: if cfg.qk_norm() {
                        Some((
                            get(&format!("{p}.self_attn.q_norm.weight"))?,
                            get(&format!("{p}.self_attn.k_norm.weight"))?,
                        ))
                    } else {
                        None
                    },
                    post_norm: get(&format!("{p}.post_attention_layernorm.weight"))?,
                    gate: linear(&format!("{p}.mlp.gate_proj"), false)?,
                    up: linear(&format!("{p}.mlp.up_proj"), false)?,
                    down: linear(&format!("{p}.mlp.down_proj"), false)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let rope = cfg.rope().map_err(|message| ModelError::Config {
            path: "<config>".into(),
            message,
        })?;
        let embed = get("model.embed_tokens.weight")?;
        Ok(Self {
            cfg: cfg.clone(),
            ops: TrainingOps::for_device(embed.device()),
            precision: Precision::F32,
            rope,
            embed,
            blocks,
            norm: get("model.norm.weight")?,
            activation_checkpointing: false,
        })
    }

    /// The weights for the incremental path: detached from autograd, in `dtype`. In the
    /// weights' own dtype (f32 on CPU) they share storage with the trained `Var`s, so updates
    /// show through; in another dtype (bf16 on CUDA) they are a copy, refreshed after updates
    /// by [`crate::model::Model::refresh_rollout_weights`]. LoRA adapters are folded into their
    /// projection's weight (a copy) with `merge`, else kept as they are.
    pub(crate) fn rollout_copy(&self, dtype: DType, merge: bool) -> Result<Self> {
        let t = |x: &Tensor| rollout_tensor(x, dtype);
        let blocks = self
            .blocks
            .iter()
            .map(|b| {
                Ok(Block {
                    input_norm: t(&b.input_norm)?,
                    q: b.q.rollout_copy(dtype, merge)?,
                    k: b.k.rollout_copy(dtype, merge)?,
                    v: b.v.rollout_copy(dtype, merge)?,
                    o: b.o.rollout_copy(dtype, merge)?,
                    qk_norm: b
                        .qk_norm
                        .as_ref()
                        .map(|(q, k)| Ok::<_, ModelError>((t(q)?, t(k)?)))
                        .transpose()?,
                    post_norm: t(&b.post_norm)?,
                    gate: b.gate.rollout_copy(dtype, merge)?,
                    up: b.up.rollout_copy(dtype, merge)?,
                    down: b.down.rollout_copy(dtype, merge)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            cfg: self.cfg.clone(),
            ops: self.ops,
            precision: Precision::F32,
            rope: self.rope.clone(),
            embed: t(&self.embed)?,
            blocks,
            norm: t(&self.norm)?,
            activation_checkpointing: false,
        })
    }

    /// The projections of every block by HF module path (`model.layers.{l}.self_attn.q_proj`,
    /// `…mlp.down_proj`), for attaching or removing adapters.
    pub(crate) fn projections_mut(&mut self) -> impl Iterator<Item = (String, &mut Linear)> {
        self.blocks.iter_mut().enumerate().flat_map(|(l, b)| {
            let attn = format!("model.layers.{l}.self_attn");
            let mlp = format!("model.layers.{l}.mlp");
            [
                (format!("{attn}.q_proj"), &mut b.q),
                (format!("{attn}.k_proj"), &mut b.k),
                (format!("{attn}.v_proj"), &mut b.v),
                (format!("{attn}.o_proj"), &mut b.o),
                (format!("{mlp}.gate_proj"), &mut b.gate),
                (format!("{mlp}.up_proj"), &mut b.up),
                (format!("{mlp}.down_proj"), &mut b.down),
            ]
        })
    }

    /// The trunk with every base tensor detached (nothing of it is trained or gets a gradient);
    /// attached adapters stay as they are.
    pub(crate) fn frozen_base(&self) -> Self {
        let blocks = self
            .blocks
            .iter()
            .map(|b| Block {
                input_norm: b.input_norm.detach(),
                q: b.q.frozen_base(),
                k: b.k.frozen_base(),
                v: b.v.frozen_base(),
                o: b.o.frozen_base(),
                qk_norm: b.qk_norm.as_ref().map(|(q, k)| (q.detach(), k.detach())),
                post_norm: b.post_norm.detach(),
                gate: b.gate.frozen_base(),
                up: b.up.frozen_base(),
                down: b.down.frozen_base(),
            })
            .collect();
        Self {
            cfg: self.cfg.clone(),
            ops: self.ops,
            precision: self.precision,
            rope: self.rope.clone(),
            embed: self.embed.detach(),
            blocks,
            norm: self.norm.detach(),
            activation_checkpointing: self.activation_checkpointing,
        }
    }

    fn eps(&self) -> f64 {
        self.cfg.rms_norm_eps
    }

    /// Qwen3's per-head RMSNorm of q and k (heads in the last dimension); identity elsewhere.
    fn qk_norm(&self, b: &Block, q: Tensor, k: Tensor) -> Result<(Tensor, Tensor)> {
        match &b.qk_norm {
            Some((qw, kw)) => Ok((self.norm(&q, qw)?, self.norm(&k, kw)?)),
            None => Ok((q, k)),
        }
    }

    /// RMSNorm of `x` with `weight` (in f32 under bf16 products): the fused op where it applies.
    /// Its statistics accumulate in f32 whatever the dtypes; the result has the weight's dtype.
    fn norm(&self, x: &Tensor, weight: &Tensor) -> Result<Tensor> {
        let x = self.precision.widen(x.clone())?;
        if self.fused(&x) && weight.dtype() == DType::F32 {
            fused::rms_norm(&x, weight, self.eps())
        } else {
            rms_norm(&x, weight, self.eps())
        }
    }

    /// `x` in the dtype the trunk's products read (a differentiable cast under bf16).
    fn product_input(&self, x: &Tensor) -> Result<Tensor> {
        match self.precision.product_dtype() {
            Some(dtype) => Ok(x.to_dtype(dtype)?),
            None => Ok(x.clone()),
        }
    }

    /// `lin` applied to `x` in the trunk's ops and precision.
    fn linear(&self, lin: &Linear, x: &Tensor) -> Result<Tensor> {
        lin.forward_in(x, self.ops, self.precision)
    }

    /// Whether the fused CPU ops run on `x`.
    fn fused(&self, x: &Tensor) -> bool {
        self.ops == TrainingOps::Fused && fused::applies(x)
    }

    fn mlp(&self, b: &Block, x: &Tensor) -> Result<Tensor> {
        let h = self.product_input(&self.norm(x, &b.post_norm)?)?;
        let (gate, up) = (self.linear(&b.gate, &h)?, self.linear(&b.up, &h)?);
        let act = if self.fused(&gate) {
            fused::swiglu(&gate, &up)?
        } else {
            (candle_nn::ops::silu(&gate)? * up)?
        };
        let down = self.precision.widen(self.linear(&b.down, &act)?)?;
        Ok((x + down)?)
    }

    /// Query or key heads `[B, n, T, D]` of the projection `lin` of `h` `[B, T, hidden]`: per-head
    /// norm (Qwen3) and RoPE with `cos`, `sin` `[B, 1, T, D]`.
    fn rope_heads(
        &self,
        lin: &Linear,
        h: &Tensor,
        norm: Option<&Tensor>,
        n: usize,
        (cos, sin): (&Tensor, &Tensor),
    ) -> Result<Tensor> {
        let (b_sz, t_len, _) = h.dims3()?;
        let x = self.precision.widen(self.linear(lin, h)?)?.reshape((
            b_sz,
            t_len,
            n,
            self.cfg.head_dim(),
        ))?;
        let x = match norm {
            Some(w) => self.norm(&x, w)?,
            None => x,
        };
        if self.fused(&x) {
            fused::rope_heads(&x, cos, sin)
        } else {
            apply_rope(&x.transpose(1, 2)?.contiguous()?, cos, sin)
        }
    }

    /// Heads `[n, heads, D]` of `n` new tokens rotated by their tables `cos`, `sin` `[n, 1, D]`:
    /// one fused op where it applies (the same products and sums as [`apply_rope`], so the same
    /// bits), else the op-by-op rotation.
    fn rope_rows(&self, x: &Tensor, (cos, sin): (&Tensor, &Tensor)) -> Result<Tensor> {
        if !self.fused(x) {
            return apply_rope(x, cos, sin);
        }
        let (n, heads, d) = x.dims3()?;
        let rows = x.reshape((n, 1, heads, d))?;
        Ok(fused::rope_heads(&rows, cos, sin)?.reshape((n, heads, d))?)
    }

    /// Final hidden states `[B, T, hidden]` of a padded batch `input_ids [B, T]` (u32) with
    /// `attention_mask [B, T]` (1 = real token, any dtype); positions count real tokens only, so
    /// left and right padding both work.
    pub(crate) fn forward_train(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Tensor> {
        Ok(self
            .forward_train_streams(input_ids, attention_mask, false)?
            .0)
    }

    /// [`Trunk::forward_train`] that, with `keep_streams`, also returns the residual stream
    /// `[B, T, hidden]` before the first block (the embeddings) and after each block, in order.
    pub(crate) fn forward_train_streams(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        keep_streams: bool,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let (b_sz, t_len) = input_ids.dims2()?;
        if attention_mask.dims() != input_ids.dims() {
            return Err(ModelError::Input(format!(
                "attention_mask {:?} does not match input_ids {:?}",
                attention_mask.dims(),
                input_ids.dims()
            )));
        }
        check_ids(
            &input_ids.flatten_all()?.to_vec1::<u32>()?,
            self.cfg.vocab_size,
        )?;
        let mask = attention_mask.to_dtype(DType::U32)?.to_vec2::<u32>()?;
        let (cfg, hd) = (&self.cfg, self.cfg.head_dim());
        let dev = input_ids.device();
        let positions: Vec<u32> = mask
            .iter()
            .flat_map(|row| positions_from_mask(row))
            .collect();
        let (cos, sin) = rope_tensors(&self.rope, &positions, (b_sz, 1, t_len, hd), dev)?;
        let x = self
            .embed
            .index_select(&input_ids.flatten_all()?, 0)?
            .reshape((b_sz, t_len, cfg.hidden_size))?;
        let attend = Attend::Padded {
            attention: TrainingAttention::for_device(dev),
            real_tokens: Arc::new(mask),
            scale: 1.0 / (hd as f64).sqrt(),
        };
        self.blocks_forward(x, (&cos, &sin), &attend, keep_streams)
    }

    /// Final hidden states of a training input: `[B, T, hidden]` padded, `[1, N, hidden]` a tree.
    pub(crate) fn forward_input(&self, input: &TrainInput) -> Result<Tensor> {
        Ok(self.forward_input_streams(input, false)?.0)
    }

    /// [`Trunk::forward_input`] that, with `keep_streams`, also returns the residual streams (as
    /// [`Trunk::forward_train_streams`] does), in the input's layout.
    pub(crate) fn forward_input_streams(
        &self,
        input: &TrainInput,
        keep_streams: bool,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        match input {
            TrainInput::Padded(b) => {
                self.forward_train_streams(&b.input_ids, &b.attention_mask, keep_streams)
            }
            TrainInput::Tree(tree) => self.forward_tree_streams(tree, keep_streams),
        }
    }

    /// Final hidden states `[1, N, hidden]` of the packed tokens of `tree`: each branch segment
    /// attends to its root's K/V and continues its positions (differentiable, like
    /// [`Trunk::forward_train`], whose hidden states it reproduces at every sequence position);
    /// with `keep_streams`, also the residual streams `[1, N, hidden]`.
    fn forward_tree_streams(
        &self,
        tree: &TreeBatch,
        keep_streams: bool,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        check_ids(&tree.ids().to_vec1::<u32>()?, self.cfg.vocab_size)?;
        let (n, hd) = (tree.len(), self.cfg.head_dim());
        let dev = tree.ids().device();
        let (cos, sin) = rope_tensors(&self.rope, &tree.positions(), (1, 1, n, hd), dev)?;
        let x = self
            .embed
            .index_select(tree.ids(), 0)?
            .reshape((1, n, self.cfg.hidden_size))?;
        let attend = Attend::Tree {
            attention: TrainingAttention::for_device(dev),
            tree: Arc::new(tree.clone()),
            scale: 1.0 / (hd as f64).sqrt(),
        };
        self.blocks_forward(x, (&cos, &sin), &attend, keep_streams)
    }

    /// The blocks and the final norm over embeddings `x [B, T, hidden]`, with RoPE tables `cos`,
    /// `sin` `[B, 1, T, head_dim]` and the attention of `attend`; with `keep_streams`, also the
    /// residual stream before the first block and after each block. With
    /// `activation_checkpointing` each block keeps only its input for the backward.
    fn blocks_forward(
        &self,
        mut x: Tensor,
        rope: (&Tensor, &Tensor),
        attend: &Attend,
        keep_streams: bool,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let mut streams = Vec::new();
        for layer in 0..self.blocks.len() {
            if keep_streams {
                streams.push(x.clone());
            }
            x = if self.activation_checkpointing {
                checkpointed_block(self, layer, &x, rope, attend)?
            } else {
                self.block_forward(layer, &x, rope, attend)?
            };
        }
        if keep_streams {
            streams.push(x.clone());
        }
        Ok((self.norm(&x, &self.norm)?, streams))
    }

    /// Block `layer` over the residual stream `x [B, T, hidden]` (see [`Trunk::blocks_forward`]).
    pub(crate) fn block_forward(
        &self,
        layer: usize,
        x: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        attend: &Attend,
    ) -> Result<Tensor> {
        let b = &self.blocks[layer];
        let (b_sz, t_len, _) = x.dims3()?;
        let (nh, nkv, hd) = (
            self.cfg.num_attention_heads,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim(),
        );
        // Cast once for the three projections that read it.
        let h = self.product_input(&self.norm(x, &b.input_norm)?)?;
        let (q_norm, k_norm) = match &b.qk_norm {
            Some((q, k)) => (Some(q), Some(k)),
            None => (None, None),
        };
        let q = self.rope_heads(&b.q, &h, q_norm, nh, (cos, sin))?;
        let k = self.rope_heads(&b.k, &h, k_norm, nkv, (cos, sin))?;
        let v = self
            .precision
            .widen(self.linear(&b.v, &h)?)?
            .reshape((b_sz, t_len, nkv, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let o = attend
            .apply(&q, &k, &v)?
            .transpose(1, 2)?
            .reshape((b_sz, t_len, nh * hd))?;
        let x = (x + self.precision.widen(self.linear(&b.o, &o)?)?)?;
        self.mlp(b, &x)
    }

    /// The trunk with block `layer` alone detached from autograd (adapters kept beside their
    /// weights): what a checkpointed block runs its forward on.
    pub(crate) fn with_block_detached(&self, layer: usize) -> Result<Self> {
        let mut trunk = self.clone();
        let b = &self.blocks[layer];
        let dtype = b.input_norm.dtype();
        let t = |x: &Tensor| rollout_tensor(x, dtype);
        trunk.blocks[layer] = Block {
            input_norm: t(&b.input_norm)?,
            q: b.q.rollout_copy(dtype, false)?,
            k: b.k.rollout_copy(dtype, false)?,
            v: b.v.rollout_copy(dtype, false)?,
            o: b.o.rollout_copy(dtype, false)?,
            qk_norm: b
                .qk_norm
                .as_ref()
                .map(|(q, k)| Ok::<_, ModelError>((t(q)?, t(k)?)))
                .transpose()?,
            post_norm: t(&b.post_norm)?,
            gate: b.gate.rollout_copy(dtype, false)?,
            up: b.up.rollout_copy(dtype, false)?,
            down: b.down.rollout_copy(dtype, false)?,
        };
        Ok(trunk)
    }

    /// Every tensor of block `layer` that autograd tracks (its trained weights and adapters).
    pub(crate) fn block_tracked_tensors(&self, layer: usize) -> Vec<Tensor> {
        let b = &self.blocks[layer];
        let linears = [&b.q, &b.k, &b.v, &b.o, &b.gate, &b.up, &b.down];
        let mut all = vec![b.input_norm.clone(), b.post_norm.clone()];
        if let Some((q, k)) = &b.qk_norm {
            all.extend([q.clone(), k.clone()]);
        }
        for l in linears {
            all.push(l.weight.clone());
            all.extend(l.bias.clone());
            if let Some(pair) = &l.lora {
                all.extend([pair.a.clone(), pair.b.clone()]);
            }
        }
        all.retain(Tensor::track_op);
        all
    }

    /// Final hidden states `[n, hidden]` of the new tokens of `seqs` (in batch order), whose ids are
    /// `ids`; their K/V rows are written into the pool first. Call on detached weights.
    pub(crate) fn forward_incremental(
        &self,
        ids: &[u32],
        seqs: &[SeqSlots],
        pool: &mut KvPool,
    ) -> Result<Tensor> {
        pool.check(seqs)?;
        pool.check_shape(&self.cfg)?;
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim(),
        );
        let dev = self.embed.device();
        let n = ids.len();
        let positions: Vec<u32> = seqs
            .iter()
            .flat_map(|s| (s.context_len()..s.slots.len()).map(|p| p as u32))
            .collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let plan = pool.plan(seqs, scale)?;
        let (cos, sin) = rope_tensors(&self.rope, &positions, (n, 1, hd), dev)?;
        let (cos, sin) = (
            cos.to_dtype(self.embed.dtype())?,
            sin.to_dtype(self.embed.dtype())?,
        );
        let mut x = self.embed.index_select(&Tensor::new(ids, dev)?, 0)?;
        for (layer, b) in self.blocks.iter().enumerate() {
            let h = self.norm(&x, &b.input_norm)?;
            let (q, k) = self.qk_norm(
                b,
                b.q.forward_with(&h, self.ops)?.reshape((n, nh, hd))?,
                b.k.forward_with(&h, self.ops)?.reshape((n, nkv, hd))?,
            )?;
            let q = self.rope_rows(&q, (&cos, &sin))?;
            let k = self.rope_rows(&k, (&cos, &sin))?;
            let v = b.v.forward_with(&h, self.ops)?.reshape((n, nkv, hd))?;
            pool.write_rows(layer, &plan, &k, &v)?;
            let o = pool
                .attend_rows(layer, &q, &plan, nh, scale)?
                .reshape((n, nh * hd))?;
            x = (x + b.o.forward_with(&o, self.ops)?)?;
            x = self.mlp(b, &x)?;
        }
        self.norm(&x, &self.norm)
    }
}

/// `x` detached from autograd, in `dtype` (sharing storage when the dtype is unchanged).
pub(crate) fn rollout_tensor(x: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(x.detach().to_dtype(dtype)?)
}

/// `x / sqrt(mean(x²) + eps) * w` over the last dimension, from differentiable ops (the
/// reference of [`fused::rms_norm`]). The normalisation runs in f32 whatever `x`'s dtype and is
/// rounded to `w`'s dtype before the product with `w`, as transformers' RMSNorm does (a bf16
/// model then rounds where transformers rounds; in f32 nothing is rounded).
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let rms = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?;
    let normed = x.broadcast_div(&rms)?.to_dtype(weight.dtype())?;
    Ok(normed.broadcast_mul(weight)?)
}

/// Rotate-half RoPE: `x·cos + rotate_half(x)·sin` with `cos`/`sin` broadcast over heads.
pub(crate) fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?)
}

fn rope_tensors(
    rope: &Rope,
    positions: &[u32],
    shape: impl Into<candle_core::Shape> + Clone,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let (cos, sin) = rope.tables(positions);
    Ok((
        Tensor::from_vec(cos, shape.clone(), dev)?,
        Tensor::from_vec(sin, shape, dev)?,
    ))
}

/// Position of each token of a padded row: the number of real tokens before it.
fn positions_from_mask(row: &[u32]) -> Vec<u32> {
    let mut seen = 0u32;
    row.iter()
        .map(|&m| {
            let p = seen;
            seen += u32::from(m != 0);
            p
        })
        .collect()
}

/// Fails on the first id outside the vocabulary.
pub(crate) fn check_ids(ids: &[u32], vocab_size: usize) -> Result<()> {
    match ids.iter().find(|&&id| id as usize >= vocab_size) {
        Some(id) => Err(ModelError::Input(format!(
            "token id {id} ≥ vocab_size {vocab_size}"
        ))),
        None => Ok(()),
    }
}

/// Block `layer` of `trunk` over `x`, keeping only `x` for the backward.
fn checkpointed_block(
    trunk: &Trunk,
    layer: usize,
    x: &Tensor,
    rope: (&Tensor, &Tensor),
    attend: &Attend,
) -> Result<Tensor> {
    let tracked = trunk.block_tracked_tensors(layer);
    let anchor = match (x.track_op(), tracked.first()) {
        (true, _) => x.clone(),
        (false, Some(t)) => t.clone(),
        // Nothing in or before the block trains: no graph to keep.
        (false, None) => return trunk.block_forward(layer, x, rope, attend),
    };
    let y = trunk
        .with_block_detached(layer)?
        .block_forward(layer, &x.detach(), rope, attend)?;
    let op = RecomputedBlock {
        trunk: trunk.clone(),
        layer,
        rope: (rope.0.clone(), rope.1.clone()),
        attend: attend.clone(),
        tracked,
    };
    Ok(x.contiguous()?.apply_op3(&y.contiguous()?, &anchor, op)?)
}

/// The op that ties a checkpointed block's output to its input: forward, the output computed on
/// detached weights (copied through); backward, the block recomputed and differentiated.
struct RecomputedBlock {
    trunk: Trunk,
    layer: usize,
    rope: (Tensor, Tensor),
    attend: Attend,
    /// The block's tracked tensors, whose gradients are set aside.
    tracked: Vec<Tensor>,
}

impl CustomOp3 for RecomputedBlock {
    fn name(&self) -> &'static str {
        "recomputed-block"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _x_layout: &Layout,
        y: &CpuStorage,
        y_layout: &Layout,
        _anchor: &CpuStorage,
        _anchor_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        check_whole(self.name(), y_layout)?;
        Ok((y.clone(), y_layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x: &candle_core::CudaStorage,
        _x_layout: &Layout,
        y: &candle_core::CudaStorage,
        y_layout: &Layout,
        _anchor: &candle_core::CudaStorage,
        _anchor_layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        check_whole(self.name(), y_layout)?;
        Ok((y.try_clone(y_layout)?, y_layout.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        _y: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let input = Var::from_tensor(&x.detach())?;
        let rope = (&self.rope.0, &self.rope.1);
        let y = self
            .trunk
            .block_forward(self.layer, input.as_tensor(), rope, &self.attend)
            .map_err(candle_core::Error::wrap)?;
        let grads = (y * grad.detach())?.sum_all()?.backward()?;
        let found: Vec<(Tensor, Tensor)> = self
            .tracked
            .iter()
            .filter_map(|t| grads.get(t).map(|g| (t.clone(), g.clone())))
            .collect();
        super::recompute::set_aside(found)?;
        let grad_x = x.track_op().then(|| grads.get(input.as_tensor()).cloned());
        Ok((grad_x.flatten(), None, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_skip_padding() {
        assert_eq!(positions_from_mask(&[0, 0, 1, 1, 1]), vec![0, 0, 0, 1, 2]);
        assert_eq!(positions_from_mask(&[1, 1, 0]), vec![0, 1, 2]);
    }

    #[test]
    fn a_frozen_product_sends_its_gradient_to_the_input_alone() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 3, 5), &dev).unwrap()).unwrap();
        let w = Tensor::randn(0f32, 1.0, (4, 5), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, 4, &dev).unwrap();
        let y = affine(x.as_tensor(), &w, Some(&b), TrainingOps::Composed).unwrap();
        let flat = x.as_tensor().detach().reshape((6, 5)).unwrap();
        let expected = flat
            .matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&b)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap();
        let max_abs = |t: Tensor| {
            t.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert_eq!(max_abs((&y - &expected).unwrap()), 0.0);
        let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        // ∂(Σ y²)/∂x = 2 y W.
        let want = (expected.reshape((6, 4)).unwrap().matmul(&w).unwrap() * 2.0).unwrap();
        let got = grads.get(x.as_tensor()).unwrap().reshape((6, 5)).unwrap();
        assert!(max_abs((got - want).unwrap()) < 1e-4);
        // Nothing else holds a gradient: candle's matmul and add would keep one for the
        // weight's and the bias's views.
        assert_eq!(grads.get_ids().count(), 1);
    }

    /// The incremental forward's fused RoPE of `[n, heads, D]` rows gives the composed
    /// rotation's bits.
    #[test]
    fn incremental_rope_is_bit_identical_fused_and_composed() {
        let dev = Device::Cpu;
        let values = |n: usize, f: f32| (0..n).map(|i| (i as f32 * f).sin() * 3.0).collect();
        let x = Tensor::from_vec(values(5 * 4 * 8, 0.37), (5, 4, 8), &dev).unwrap();
        let cos = Tensor::from_vec(values(5 * 8, 0.11), (5, 1, 8), &dev).unwrap();
        let sin = Tensor::from_vec(values(5 * 8, 0.23), (5, 1, 8), &dev).unwrap();
        let model =
            crate::model::Model::new(&crate::model::ModelConfig::tiny(16), 1, &dev).unwrap();
        let trunk = &model.trunk;
        let bits = |t: Tensor| -> Vec<u32> {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.into_iter().map(f32::to_bits).collect()
        };
        assert!(trunk.fused(&x), "the CPU trunk takes the fused path");
        let fused = trunk.rope_rows(&x, (&cos, &sin)).unwrap();
        assert_eq!(fused.dims(), [5, 4, 8]);
        assert_eq!(bits(fused), bits(apply_rope(&x, &cos, &sin).unwrap()));
    }

    #[test]
    fn rms_norm_matches_candle_fast_op() {
        let dev = Device::Cpu;
        let x = Tensor::new(&[[1f32, -2.0, 3.0, 0.5], [0.1, 0.2, -0.3, 4.0]], &dev).unwrap();
        let w = Tensor::new(&[1f32, 0.5, 2.0, -1.0], &dev).unwrap();
        let ours = rms_norm(&x, &w, 1e-6).unwrap();
        let fast = candle_nn::ops::rms_norm(&x, &w, 1e-6).unwrap();
        let diff = (ours - fast)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-5, "{diff}");
    }
}
