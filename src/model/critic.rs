//! Value models: [`ValueHead`] (a linear layer hidden → 1 named `score`, as in HF
//! `Qwen2ForTokenClassification` with one label) and [`Critic`], a separate model of the policy's
//! family (own trunk weights) with that head, the default critic of step-level PPO. The head can
//! also sit on the policy's trunk ([`super::Model::attach_value_head`]). [`FeatureCritic`] is the
//! light option: a two-layer MLP on the policy's detached hidden states
//! ([`super::Model::value_features`]), so the value costs no trunk pass of its own and sends no
//! gradient into the policy (PPG's `detach` variant).

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

    /// A critic whose trunk is a copy of `policy`'s trunk as it is now (its own storage: training
    /// one never moves the other) under a fresh value head from `seed`: the critic every LLM-agent
    /// recipe starts from, features that already read the observation.
    pub fn from_policy(policy: &super::Model, seed: u64) -> Result<Self> {
        let cfg = policy.config();
        let varmap = VarMap::new();
        for (name, _) in super::decoder::trunk_param_shapes(cfg) {
            params::insert(
                &varmap,
                &name,
                &params::var_tensor(policy.varmap(), &name)?.copy()?,
            )?;
        }
        params::insert_init(&varmap, cfg, &value_head_shapes(cfg), seed, policy.device())?;
        Self::from_varmap(cfg, varmap, policy.device())
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

/// How many of the policy's last blocks a [`FeatureCritic`] reads.
pub const FEATURE_BLOCKS: usize = 4;
/// Hidden width of a [`FeatureCritic`]'s MLP.
pub const FEATURE_MLP_WIDTH: usize = 256;

const FC1_WEIGHT: &str = "value_mlp.fc1.weight";
const FC1_BIAS: &str = "value_mlp.fc1.bias";
const FC2_WEIGHT: &str = "value_mlp.fc2.weight";
const FC2_BIAS: &str = "value_mlp.fc2.bias";
const FEATURE_MEAN: &str = "value_mlp.feature_mean";
const FEATURE_INV_STD: &str = "value_mlp.feature_inv_std";
/// Floor of a feature's standard deviation in the scaling.
const MIN_FEATURE_STD: f64 = 1e-5;

/// A value MLP `features → standardise → SiLU(fc1) → fc2 → value` over the policy's detached
/// hidden states. The residual stream at a given token barely changes with the state (the
/// token's own embedding dominates it: across a FrozenLake batch each feature's spread is under
/// 1 % of its size), so each feature is standardised by the mean and standard deviation of the
/// batch the MLP was last fitted on ([`FeatureCritic::standardize_on`]); that scaling is part of
/// the critic's state and its checkpoint, not trained by the optimizer.
pub struct FeatureCritic {
    /// The trainable parameters (the MLP).
    varmap: VarMap,
    fc1: Linear,
    fc2: Linear,
    /// `[F]` each; set by [`FeatureCritic::standardize_on`], identity until then.
    mean: Var,
    inv_std: Var,
}

impl FeatureCritic {
    /// Names and shapes of the MLP's parameters for features `input_width` wide.
    pub fn param_shapes(input_width: usize) -> Vec<(String, Vec<usize>)> {
        vec![
            (FC1_WEIGHT.into(), vec![FEATURE_MLP_WIDTH, input_width]),
            (FC1_BIAS.into(), vec![FEATURE_MLP_WIDTH]),
            (FC2_WEIGHT.into(), vec![1, FEATURE_MLP_WIDTH]),
            (FC2_BIAS.into(), vec![1]),
        ]
    }

    /// Names of the feature scaling's tensors (`[F]` each), saved beside the parameters.
    pub const SCALING: [&'static str; 2] = [FEATURE_MEAN, FEATURE_INV_STD];

    /// A fresh MLP for `policy`'s features (normal(0, initializer_range) weights, zero biases)
    /// with the identity scaling.
    pub fn new(policy: &super::Model, seed: u64) -> Result<Self> {
        let width = policy.value_feature_width();
        let varmap = params::init_varmap(
            policy.config(),
            &Self::param_shapes(width),
            seed,
            policy.device(),
        )?;
        let device = policy.device();
        let mean = Tensor::zeros(width, candle_core::DType::F32, device)?;
        let inv_std = Tensor::ones(width, candle_core::DType::F32, device)?;
        Self::from_parts(varmap, &mean, &inv_std)
    }

    /// Builds the MLP over `varmap`, which holds every name of [`FeatureCritic::param_shapes`],
    /// with the scaling `mean` and `inv_std`.
    pub fn from_parts(varmap: VarMap, mean: &Tensor, inv_std: &Tensor) -> Result<Self> {
        let get = |name: &str| params::var_tensor(&varmap, name);
        Ok(Self {
            mean: Var::from_tensor(&mean.copy()?)?,
            inv_std: Var::from_tensor(&inv_std.copy()?)?,
            fc1: Linear {
                weight: get(FC1_WEIGHT)?,
                bias: Some(get(FC1_BIAS)?),
            },
            fc2: Linear {
                weight: get(FC2_WEIGHT)?,
                bias: Some(get(FC2_BIAS)?),
            },
            varmap,
        })
    }

    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// Trainable parameters by name, sorted by name.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        params::named_vars(&self.varmap)
    }

    /// The feature scaling, named as in [`FeatureCritic::SCALING`].
    pub fn scaling(&self) -> [(String, Tensor); 2] {
        [
            (FEATURE_MEAN.into(), self.mean.as_tensor().detach()),
            (FEATURE_INV_STD.into(), self.inv_std.as_tensor().detach()),
        ]
    }

    /// Sets the feature scaling to the mean and standard deviation (floored at 1e-5) of each
    /// feature over the rows of `features` `[n, F]`.
    pub fn standardize_on(&self, features: &Tensor) -> Result<()> {
        let mean = features.mean(0)?;
        let std = features
            .broadcast_sub(&mean)?
            .sqr()?
            .mean(0)?
            .sqrt()?
            .maximum(MIN_FEATURE_STD)?;
        self.mean.set(&mean)?;
        self.inv_std.set(&std.recip()?)?;
        Ok(())
    }

    /// Values `[...]` of features `[..., F]` (differentiable in the MLP's parameters).
    pub fn forward(&self, features: &Tensor) -> Result<Tensor> {
        let x = features
            .broadcast_sub(self.mean.as_tensor())?
            .broadcast_mul(self.inv_std.as_tensor())?;
        let h = candle_nn::ops::silu(&self.fc1.forward(&x)?)?;
        Ok(self.fc2.forward(&h)?.squeeze(D::Minus1)?)
    }

    /// Values `[B, T]` of `policy` at every position of a padded batch.
    pub fn values(
        &self,
        policy: &super::Model,
        input_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> Result<Tensor> {
        self.forward(&policy.value_features(input_ids, attention_mask)?)
    }
}
