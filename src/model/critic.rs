//! Value models: [`ValueHead`] (a linear layer hidden → 1 named `score`, as in HF
//! `Qwen2ForTokenClassification` with one label) and [`Critic`], a separate model of the policy's
//! family (own trunk weights) with that head, the default critic of step-level PPO. The head can
//! also sit on the policy's trunk ([`super::Model::attach_value_head`]). [`ValueMlp`] is the
//! light option: a two-layer MLP on the policy's detached hidden states
//! ([`super::Model::value_features`]), so the value costs no trunk pass of its own and sends no
//! gradient into the policy (PPG's `detach` variant). The same MLP over an env's numeric facts about
//! the whole state ([`crate::env::Env::critic_state`]) is the asymmetric `state` critic: it
//! sees what the agent's render leaves out.

use candle_core::{Device, Tensor, Var, D};
use candle_nn::VarMap;

use super::decoder::{Linear, Trunk};
use super::lora::Adapters;
use super::{params, ModelConfig, Result, TrainInput};

/// HF name of the value head's weight `[1, hidden]`.
pub const SCORE_WEIGHT: &str = "score.weight";
/// Name prefix of a shared value head's parameters in the policy.
pub const VALUE_HEAD_PREFIX: &str = "score.";
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
            linear: Linear::plain(
                params::var_tensor(varmap, SCORE_WEIGHT)?,
                Some(params::var_tensor(varmap, SCORE_BIAS)?),
            ),
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
/// With LoRA adapters attached ([`Critic::attach_adapters`]) the trunk is a frozen base and only
/// the adapters and the head train.
pub struct Critic {
    cfg: ModelConfig,
    varmap: VarMap,
    device: Device,
    trunk: Trunk,
    head: ValueHead,
    adapters: Option<Adapters>,
}

impl Critic {
    /// A freshly initialised critic.
    pub fn new(cfg: &ModelConfig, seed: u64, device: &Device) -> Result<Self> {
        let varmap = params::init_varmap(cfg, &Self::param_shapes(cfg), seed, device)?;
        Self::from_varmap(cfg, varmap, device)
    }

    /// A critic whose trunk is `policy`'s trunk as it is now under a fresh value head from
    /// `seed`: the critic every LLM-agent recipe starts from, features that already read the
    /// observation. The trunk is a copy in storage of its own (training one never moves the
    /// other), or with `share_base` the policy's own tensors: only for a critic that will get
    /// LoRA adapters beside a policy whose base LoRA freezes too, so neither ever writes them.
    pub fn from_policy(policy: &super::Model, seed: u64, share_base: bool) -> Result<Self> {
        let cfg = policy.config();
        let varmap = VarMap::new();
        for (name, _) in super::decoder::trunk_param_shapes(cfg) {
            let tensor = params::var_tensor(policy.varmap(), &name)?;
            let tensor = if share_base { tensor } else { tensor.copy()? };
            params::insert(&varmap, &name, &tensor)?;
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
            adapters: None,
        })
    }

    /// Attaches LoRA `adapters` to the trunk's projections and freezes every base weight of the
    /// trunk: from now on only the adapters and the value head train ([`Critic::trainable_vars`]).
    pub fn attach_adapters(&mut self, adapters: Adapters) -> Result<()> {
        let mut trunk = self.trunk.frozen_base();
        for (path, linear) in trunk.projections_mut() {
            linear.lora = adapters.pair(&path)?;
        }
        self.trunk = trunk;
        self.adapters = Some(adapters);
        Ok(())
    }

    /// The attached LoRA adapters, if any.
    pub fn adapters(&self) -> Option<&Adapters> {
        self.adapters.as_ref()
    }

    /// Activation checkpointing of the trunk, as [`super::Model::set_activation_checkpointing`].
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        self.trunk.activation_checkpointing = on;
    }

    /// The dtype of the trunk's products, as [`super::Model::set_precision`] (the value head
    /// reads f32).
    pub fn set_precision(&mut self, precision: super::Precision) {
        self.trunk.precision = precision;
    }

    /// HF names and shapes: the trunk (`model.*`) and `score.*`.
    pub fn param_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
        let mut specs = super::decoder::trunk_param_shapes(cfg);
        specs.extend(value_head_shapes(cfg));
        specs
    }

    /// The hyper-parameters of the critic's trunk.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The device the critic's weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The critic's own weights, trunk (`model.*`) and head (`score.*`); not the adapters.
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// Every parameter of the critic by HF name, sorted by name (the trunk and `score.*`; not the
    /// adapters).
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        params::named_vars(&self.varmap)
    }

    /// The parameters an optimizer steps, sorted by name: every one of [`Critic::named_vars`]
    /// without adapters; with adapters, the adapters and the value head.
    pub fn trainable_vars(&self) -> Vec<(String, Var)> {
        let Some(adapters) = &self.adapters else {
            return self.named_vars();
        };
        let mut vars = adapters.named_vars();
        vars.extend(self.head_vars());
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        vars
    }

    /// The value head's parameters (`score.*`).
    pub fn head_vars(&self) -> Vec<(String, Var)> {
        self.named_vars()
            .into_iter()
            .filter(|(name, _)| name.starts_with(VALUE_HEAD_PREFIX))
            .collect()
    }

    /// Values `[B, T]`: the head on the final hidden state of each position (differentiable).
    pub fn values(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        self.head
            .forward(&self.trunk.forward_train(input_ids, attention_mask)?)
    }

    /// Values of a training input: `[B, T]` padded, `[1, N]` a tree (differentiable).
    pub fn values_of(&self, input: &TrainInput) -> Result<Tensor> {
        self.head.forward(&self.trunk.forward_input(input)?)
    }
}

/// How many of the policy's last blocks a [`ValueMlp`] reads.
pub const FEATURE_BLOCKS: usize = 4;
/// Hidden width of a [`ValueMlp`]'s MLP.
pub const FEATURE_MLP_WIDTH: usize = 256;

const FC1_WEIGHT: &str = "value_mlp.fc1.weight";
const FC1_BIAS: &str = "value_mlp.fc1.bias";
const FC2_WEIGHT: &str = "value_mlp.fc2.weight";
const FC2_BIAS: &str = "value_mlp.fc2.bias";
const FEATURE_MEAN: &str = "value_mlp.feature_mean";
const FEATURE_SCALE: &str = "value_mlp.feature_scale";
/// Floor of the features' spread in the scaling.
const MIN_FEATURE_SPREAD: f64 = 1e-6;

/// A value MLP `inputs → centre and scale → SiLU(fc1) → fc2 → value`, over the policy's detached
/// hidden states ([`ValueMlp::new`], `critic.mode: features`) or over an env's critic state
/// ([`ValueMlp::with_width`], `critic.mode: state`). The residual stream at a given token barely changes with the state
/// (the token's own embedding dominates it: across a FrozenLake batch a feature's spread is
/// about 0.2 % of its size), so the features are centred on the mean of the batch the MLP was
/// last fitted on and multiplied by one factor that gives them unit spread over that batch
/// ([`ValueMlp::standardize_on`]). One factor for all, not one per feature: a feature that
/// hardly varies in the batch stays small instead of turning a slight shift in the next batch
/// into a huge input. The scaling is part of the critic's state and its checkpoint, not trained.
pub struct ValueMlp {
    /// The trainable parameters (the MLP).
    varmap: VarMap,
    fc1: Linear,
    fc2: Linear,
    /// `[F]` and `[1]`; set by [`ValueMlp::standardize_on`], identity until then.
    mean: Var,
    scale: Var,
}

impl ValueMlp {
    /// Names and shapes of the MLP's parameters for features `input_width` wide.
    pub fn param_shapes(input_width: usize) -> Vec<(String, Vec<usize>)> {
        vec![
            (FC1_WEIGHT.into(), vec![FEATURE_MLP_WIDTH, input_width]),
            (FC1_BIAS.into(), vec![FEATURE_MLP_WIDTH]),
            (FC2_WEIGHT.into(), vec![1, FEATURE_MLP_WIDTH]),
            (FC2_BIAS.into(), vec![1]),
        ]
    }

    /// Names of the feature scaling's tensors (the mean `[F]`, the factor `[1]`), saved beside
    /// the parameters.
    pub const SCALING: [&'static str; 2] = [FEATURE_MEAN, FEATURE_SCALE];

    /// A fresh MLP for `policy`'s features (normal(0, initializer_range) weights, zero biases)
    /// with the identity scaling.
    pub fn new(policy: &super::Model, seed: u64) -> Result<Self> {
        Self::with_width(
            policy.value_feature_width(),
            policy.config(),
            seed,
            policy.device(),
        )
    }

    /// A fresh MLP over inputs `width` wide (an env's critic state), initialised like `cfg`'s
    /// weights, with the identity scaling.
    pub fn with_width(width: usize, cfg: &ModelConfig, seed: u64, device: &Device) -> Result<Self> {
        let varmap = params::init_varmap(cfg, &Self::param_shapes(width), seed, device)?;
        let mean = Tensor::zeros(width, candle_core::DType::F32, device)?;
        let scale = Tensor::ones(1, candle_core::DType::F32, device)?;
        Self::from_parts(varmap, &mean, &scale)
    }

    /// Width of the inputs the MLP reads.
    pub fn input_width(&self) -> usize {
        self.mean.as_tensor().dim(0).unwrap_or(0)
    }

    /// Builds the MLP over `varmap`, which holds every name of [`ValueMlp::param_shapes`],
    /// with the scaling `mean` (`[F]`) and `scale` (`[1]`).
    pub fn from_parts(varmap: VarMap, mean: &Tensor, scale: &Tensor) -> Result<Self> {
        let get = |name: &str| params::var_tensor(&varmap, name);
        Ok(Self {
            mean: Var::from_tensor(&mean.copy()?)?,
            scale: Var::from_tensor(&scale.copy()?)?,
            fc1: Linear::plain(get(FC1_WEIGHT)?, Some(get(FC1_BIAS)?)),
            fc2: Linear::plain(get(FC2_WEIGHT)?, Some(get(FC2_BIAS)?)),
            varmap,
        })
    }

    /// The MLP's trainable parameters (not the feature scaling).
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }

    /// Trainable parameters by name, sorted by name.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        params::named_vars(&self.varmap)
    }

    /// The feature scaling, named as in [`ValueMlp::SCALING`].
    pub fn scaling(&self) -> [(String, Tensor); 2] {
        [
            (FEATURE_MEAN.into(), self.mean.as_tensor().detach()),
            (FEATURE_SCALE.into(), self.scale.as_tensor().detach()),
        ]
    }

    /// Sets the feature scaling from `features` `[n, F]`: the mean of each feature over the rows,
    /// and the factor that brings the centred features to unit root-mean-square.
    pub fn standardize_on(&self, features: &Tensor) -> Result<()> {
        let mean = features.mean(0)?;
        let spread = features
            .broadcast_sub(&mean)?
            .sqr()?
            .mean_all()?
            .sqrt()?
            .maximum(MIN_FEATURE_SPREAD)?;
        self.mean.set(&mean)?;
        self.scale.set(&spread.recip()?.reshape(1)?)?;
        Ok(())
    }

    /// Values `[...]` of features `[..., F]` (differentiable in the MLP's parameters).
    pub fn forward(&self, features: &Tensor) -> Result<Tensor> {
        let x = features
            .broadcast_sub(self.mean.as_tensor())?
            .broadcast_mul(self.scale.as_tensor())?;
        let h = candle_nn::ops::silu(&self.fc1.forward(&x)?)?;
        Ok(self.fc2.forward(&h)?.squeeze(D::Minus1)?)
    }

    /// Values of `policy`'s features at every position of `input`: `[B, T]` padded, `[1, N]` a
    /// tree.
    pub fn values(&self, policy: &super::Model, input: &TrainInput) -> Result<Tensor> {
        self.forward(&policy.value_features(input)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_feature_scaling_centres_on_the_batch_and_scales_by_one_factor() {
        let policy =
            crate::model::Model::new(&crate::model::ModelConfig::tiny(16), 1, &Device::Cpu)
                .unwrap();
        let critic = ValueMlp::new(&policy, 2).unwrap();
        let width = policy.value_feature_width();
        // Two rows: feature 0 is 1 and 3 (mean 2, deviations ±1), every other feature is 5 in
        // both rows (no spread). Mean squared deviation over all features: 2 / (2 · width).
        let mut rows = vec![5f32; 2 * width];
        rows[0] = 1.0;
        rows[width] = 3.0;
        let features = Tensor::from_vec(rows, (2, width), &Device::Cpu).unwrap();
        critic.standardize_on(&features).unwrap();
        let [(_, mean), (_, scale)] = critic.scaling();
        let mean = mean.to_vec1::<f32>().unwrap();
        assert_eq!(mean[0], 2.0);
        assert!(mean[1..].iter().all(|&m| m == 5.0));
        let expected = (width as f32).sqrt();
        let scale = scale.to_vec1::<f32>().unwrap()[0];
        assert!(
            (scale - expected).abs() < 1e-4 * expected,
            "{scale} vs {expected}"
        );
    }
}
