//! Mixed precision of the training forward and backward (`precision`).
//!
//! The trained weights are always f32 `Var`s (the master weights AdamW steps, with f32 moments).
//! Under [`Precision::Bf16`] every matrix product of the training path — the projections, the
//! MLP, LoRA adapters and the LM head — reads bf16 copies of its weights and its input and writes
//! bf16, as PyTorch's `autocast(dtype=bfloat16)` does; the casts are differentiable, so each
//! gradient reaches its f32 master. The SwiGLU gate runs in bf16 on the bf16 products, as under
//! autocast. Everything that accumulates stays f32: the residual stream, the RMSNorms, RoPE, the
//! attention (its scores, softmax and products, so far), the value heads, log-probs, entropies
//! and losses. [`Precision::F32`] is the path without casts, in the weights' own dtype.
//!
//! Generation (`rollout_dtype`, `stepppo generate --dtype`) reads the same two names as the dtype
//! it stores its weights, activations and K/V in, as a transformers model loaded in that dtype
//! does: under bf16 every product, the residual stream, RoPE and the SwiGLU gate are bf16, while
//! the RMSNorms, the attention's scores and softmax, the log-softmax and sampling accumulate in
//! f32.

use candle_core::{DType, Tensor};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Result;

/// The dtype the training path's matrix products run in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// Everything in f32 (the weights' dtype): no casts.
    #[default]
    F32,
    /// Matrix products in bf16 from bf16 copies of the f32 master weights; accumulation in f32.
    Bf16,
}

impl Precision {
    /// The dtype products read and write, when it is not the weights' own.
    pub(crate) fn product_dtype(self) -> Option<DType> {
        match self {
            Precision::F32 => None,
            Precision::Bf16 => Some(DType::BF16),
        }
    }

    /// `x` in f32 for an op that accumulates (norm, RoPE, attention, the residual stream); under
    /// [`Precision::F32`], `x` as it is (the rollout path computes in the weights' dtype).
    pub(crate) fn widen(self, x: Tensor) -> Result<Tensor> {
        match self {
            Precision::F32 => Ok(x),
            Precision::Bf16 => Ok(x.to_dtype(DType::F32)?),
        }
    }

    /// The dtype of tensors stored in this precision (generation's weights, activations and K/V).
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// Bytes of one element of a product's input or output.
    pub fn product_bytes(self) -> u64 {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 => 2,
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        })
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(format!("unknown precision `{other}` (f32 or bf16)")),
        }
    }
}
