//! Value models: [`ValueHead`] (a linear layer hidden → 1 named `score`, as in HF
//! `Qwen2ForTokenClassification` with one label) and [`Critic`], a separate model of the policy's
//! family (own trunk weights) with that head, the default critic of step-level PPO. The head can
//! also sit on the policy's trunk ([`super::Model::attach_value_head`]).

use candle_core::{Device, Tensor, Var, D};
use candle_nn::VarMap;

use super::decoder::{Linear, Trunk};
use super::{params, ModelConfig, Result};

/// HF name of the value head's weight `[1, hidden]`.
pub const SCORE_WEIGHT: &str = "score.weight";
/// HF name of the value head's bias `[1]`.
pub const SCORE_BIAS: &str = "score.bias";

/// Names and shapes of the value head's parameters.
pub fn value_head_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    vec![
        (SCORE_WEIGHT.into(), vec![1, cfg.hidden_size]),
        (SCORE_BIAS.into(), vec![1]),
    ]
}

/// `value = hidden · w + b` per position.
#[derive(Clone)]
pub struct ValueHead {
    linear: Linear,
}

impl ValueHead {
    /// The head stored in `varmap`, if it has `score.weight` and `score.bias`.
    pub(crate) fn from_varmap(varmap: &VarMap) -> Result<Option<Self>> {
        if !(params::has_var(varmap, SCORE_WEIGHT) && params::has_var(varmap, SCORE_BIAS)) {
            return Ok(None);
        }
        Ok(Some(Self {
            linear: Linear {
                weight: params::var_tensor(varmap, SCORE_WEIGHT)?,
                bias: Some(params::var_tensor(varmap, SCORE_BIAS)?),
            },
        }))
    }

    /// Creates `score.*` in `varmap` (normal(0, initializer_range) weight, zero bias).
    pub(crate) fn init_in(
        varmap: &VarMap,
        cfg: &ModelConfig,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        params::insert_init(varmap, cfg, &value_head_shapes(cfg), seed, device)?;
        Ok(Self::from_varmap(varmap)?.expect("just inserted"))
    }

    /// Values `[B, T]` from hidden states `[B, T, hidden]`.
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.linear.forward(hidden)?.squeeze(D::Minus1)?)
    }
}

/// A separate critic: a trunk of the policy's family with its own weights and a value head.
pub struct Critic {
    cfg: ModelConfig,
    varmap: VarMap,
    device: Device,
    trunk: Trunk,
    head: ValueHead,
}

impl Critic {
    /// A freshly initialised critic.
    pub fn new(cfg: &ModelConfig, seed: u64, device: &Device) -> Result<Self> {
        let varmap = params::init_varmap(cfg, &Self::param_shapes(cfg), seed, device)?;
        Self::from_varmap(cfg, varmap, device)
    }

    /// Builds the critic over `varmap`, which holds every name of [`Critic::param_shapes`].
    pub fn from_varmap(cfg: &ModelConfig, varmap: VarMap, device: &Device) -> Result<Self> {
        let trunk = Trunk::from_named(cfg, &|name: &str| params::var_tensor(&varmap, name))?;
        let head =
            ValueHead::from_varmap(&varmap)?.ok_or_else(|| super::ModelError::MissingTensor {
                name: SCORE_WEIGHT.into(),
                files: "the VarMap".into(),
            })?;
        Ok(Self {
            cfg: cfg.clone(),
            varmap,
            device: device.clone(),
            trunk,
            head,
        })
    }

    /// HF names and shapes: the trunk (`model.*`) and `score.*`.
    pub fn param_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
        let mut specs = super::decoder::trunk_param_shapes(cfg);
        specs.extend(value_head_shapes(cfg));
        specs
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// Trainable parameters by HF name, sorted by name.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        params::named_vars(&self.varmap)
    }

    /// Values `[B, T]`: the head on the final hidden state of each position (differentiable).
    pub fn values(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        self.head
            .forward(&self.trunk.forward_train(input_ids, attention_mask)?)
    }
}
