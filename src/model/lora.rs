//! LoRA adapters on the decoder's projections, in PEFT's format.
//!
//! An adapter on a projection `W` `[out, in]` is `A` `[r, in]` and `B` `[out, r]`; the layer
//! computes `x Wᵀ + (alpha / r) · (x Aᵀ) Bᵀ`. [`LoraSpec`] says which projections get one (module
//! names as in transformers and PEFT) with what rank and alpha; [`Adapters`] holds the tensors as
//! `Var`s named by module path (`model.layers.0.self_attn.q_proj.lora_A.weight`), initialised as
//! PEFT does (A uniform in ±1/√in, B zero, so a fresh adapter leaves the model unchanged).
//!
//! On disk an adapter is PEFT's directory: `adapter_config.json` and `adapter_model.safetensors`
//! with PEFT's tensor names (`base_model.model.` + the module path). Reading one accepts only what
//! is computed exactly here: a key of the config that would change the function (DoRA, rsLoRA
//! scaling, per-layer rank patterns, biases, extra trained modules, …) with a non-neutral value is
//! an error naming the key, as is a tensor the adapter would need but lacks, or one it has that is
//! not an adapter of a projection we have.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use rand::Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::decoder::LoraPair;
use super::{params, ModelConfig, ModelError, Result};

/// PEFT's adapter config file.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// PEFT's adapter weights file.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The prefix PEFT puts before a module path in tensor names.
const PEFT_PREFIX: &str = "base_model.model.";
/// The projections an adapter can sit on, by their transformers module names.
pub const TARGET_MODULES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];
/// PEFT's name for every linear layer but the output head.
const ALL_LINEAR: &str = "all-linear";

/// Which projections get a LoRA adapter, of what rank and scale (PEFT's `LoraConfig`: `r`,
/// `lora_alpha`, `lora_dropout`, `target_modules`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LoraSpec {
    /// Rank r of every adapter (≥ 1): A is r × in, B is out × r.
    pub rank: usize,
    /// PEFT's `lora_alpha`: an adapter's output is scaled by alpha / rank (> 0).
    pub alpha: f64,
    /// Dropout on an adapter's input while training. Only 0 is supported (no seeded dropout
    /// mask yet): another value is an error rather than an unseeded, irreproducible run. A
    /// loaded adapter's `lora_dropout` does not matter for generation and is kept as written.
    #[serde(default)]
    pub dropout: f64,
    /// Module names as in transformers and PEFT (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
    /// `gate_proj`, `up_proj`, `down_proj`), or `[all-linear]` (every one of them; the LM head is
    /// never adapted). A plain string is read as a one-element list.
    #[serde(default = "all_linear", deserialize_with = "one_or_many")]
    pub target_modules: Vec<String>,
}

fn all_linear() -> Vec<String> {
    vec![ALL_LINEAR.to_string()]
}

fn one_or_many<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

impl LoraSpec {
    /// alpha / rank, the factor on every adapter's output.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// The targeted module names, `all-linear` expanded, in [`TARGET_MODULES`] order; an error
    /// names a module we do not have.
    pub fn targets(&self) -> std::result::Result<Vec<&'static str>, String> {
        for name in &self.target_modules {
            if name != ALL_LINEAR && !TARGET_MODULES.contains(&name.as_str()) {
                return Err(format!(
                    "target_modules: `{name}` is not a projection of these models (one of {}, or \
                     {ALL_LINEAR})",
                    TARGET_MODULES.join(", ")
                ));
            }
        }
        if self.target_modules.is_empty() {
            return Err("target_modules: empty".into());
        }
        let all = self.target_modules.iter().any(|m| m == ALL_LINEAR);
        Ok(TARGET_MODULES
            .into_iter()
            .filter(|m| all || self.target_modules.iter().any(|t| t == m))
            .collect())
    }

    /// Checks the values a run can train with; the message names the key.
    pub fn validate_for_training(&self) -> std::result::Result<(), String> {
        self.validate()?;
        if self.dropout != 0.0 {
            return Err(format!(
                "dropout: {} is not supported (only 0: stepppo has no seeded LoRA dropout mask)",
                self.dropout
            ));
        }
        Ok(())
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.rank == 0 {
            return Err("rank: must be at least 1".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(format!("alpha: must be positive, got {}", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("dropout: must be in [0, 1), got {}", self.dropout));
        }
        self.targets().map(|_| ())
    }
}

/// Names and shapes of every adapter tensor of `spec` on a model of `cfg`, by module path, in a
/// fixed order.
pub fn adapter_param_shapes(
    cfg: &ModelConfig,
    spec: &LoraSpec,
) -> std::result::Result<Vec<(String, Vec<usize>)>, String> {
    let targets = spec.targets()?;
    let (h, hd, i) = (cfg.hidden_size, cfg.head_dim(), cfg.intermediate_size);
    let (q_out, kv_out) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    let mut specs = Vec::new();
    for l in 0..cfg.num_hidden_layers {
        for &module in &targets {
            let (group, out, inner) = match module {
                "q_proj" => ("self_attn", q_out, h),
                "k_proj" | "v_proj" => ("self_attn", kv_out, h),
                "o_proj" => ("self_attn", h, q_out),
                "gate_proj" | "up_proj" => ("mlp", i, h),
                _ => ("mlp", h, i),
            };
            let path = format!("model.layers.{l}.{group}.{module}");
            specs.push((format!("{path}.lora_A.weight"), vec![spec.rank, inner]));
            specs.push((format!("{path}.lora_B.weight"), vec![out, spec.rank]));
        }
    }
    Ok(specs)
}

/// The adapters of a model: their spec, their tensors as `Var`s named by module path, and the
/// base model they adapt as PEFT records it (`base_model_name_or_path`: a directory here).
#[derive(Clone)]
pub struct Adapters {
    spec: LoraSpec,
    varmap: VarMap,
    base_model: String,
}

impl Adapters {
    /// Fresh adapters as PEFT initialises them: A uniform in ±1/√in (kaiming-uniform with
    /// a = √5), B zero; one seeded stream per tensor name.
    pub fn fresh(
        cfg: &ModelConfig,
        spec: &LoraSpec,
        seed: u64,
        device: &Device,
        base_model: &str,
    ) -> Result<Self> {
        let shapes = adapter_param_shapes(cfg, spec).map_err(lora_config_error)?;
        let varmap = VarMap::new();
        for (name, shape) in &shapes {
            let t = if name.ends_with(".lora_A.weight") {
                uniform(name, shape, 1.0 / (shape[1] as f64).sqrt(), seed, device)?
            } else {
                Tensor::zeros(shape.as_slice(), DType::F32, device)?
            };
            params::insert(&varmap, name, &t)?;
        }
        Ok(Self {
            spec: spec.clone(),
            varmap,
            base_model: base_model.to_string(),
        })
    }

    /// The spec (rank, alpha, dropout, target modules) the adapters were built with.
    pub fn spec(&self) -> &LoraSpec {
        &self.spec
    }

    /// The same adapters recorded as adapting `base_model`.
    pub fn with_base_model(self, base_model: &str) -> Self {
        Self {
            base_model: base_model.to_string(),
            ..self
        }
    }

    /// The adapter tensors, sorted by name (what the optimizer steps).
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        params::named_vars(&self.varmap)
    }

    /// The adapter of the projection at module `path`, if it has one.
    pub(crate) fn pair(&self, path: &str) -> Result<Option<LoraPair>> {
        let a = format!("{path}.lora_A.weight");
        if !params::has_var(&self.varmap, &a) {
            return Ok(None);
        }
        Ok(Some(LoraPair {
            a: params::var_tensor(&self.varmap, &a)?,
            b: params::var_tensor(&self.varmap, &format!("{path}.lora_B.weight"))?,
            scale: self.spec.scale(),
        }))
    }

    /// A copy in storage of its own.
    pub fn deep_copy(&self) -> Result<Self> {
        let varmap = VarMap::new();
        for (name, var) in self.named_vars() {
            params::insert(&varmap, &name, &var.as_tensor().copy()?)?;
        }
        Ok(Self {
            spec: self.spec.clone(),
            varmap,
            base_model: self.base_model.clone(),
        })
    }

    /// Writes PEFT's `adapter_config.json` and `adapter_model.safetensors` into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(io_error(dir))?;
        let config = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model,
            "r": self.spec.rank,
            "lora_alpha": self.spec.alpha,
            "lora_dropout": self.spec.dropout,
            "target_modules": self.spec.targets().map_err(lora_config_error)?,
            "bias": "none",
            "fan_in_fan_out": false,
            "use_rslora": false,
            "use_dora": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
        });
        let path = dir.join(ADAPTER_CONFIG_FILE);
        let text = serde_json::to_vec_pretty(&config).expect("a JSON value serialises");
        std::fs::write(&path, text).map_err(io_error(&path))?;
        let tensors: Vec<(String, Tensor)> = self
            .named_vars()
            .into_iter()
            .map(|(n, v)| (format!("{PEFT_PREFIX}{n}"), v.as_tensor().detach()))
            .collect();
        params::write_safetensors(&dir.join(ADAPTER_WEIGHTS_FILE), &tensors)
    }

    /// Reads a PEFT adapter directory for a model of `cfg`; see the module doc for what is
    /// refused.
    pub fn load(dir: &Path, cfg: &ModelConfig, device: &Device) -> Result<Self> {
        let config_path = dir.join(ADAPTER_CONFIG_FILE);
        let (spec, base_model) = read_peft_config(&config_path)?;
        let weights = dir.join(ADAPTER_WEIGHTS_FILE);
        let loaded = candle_core::safetensors::load(&weights, device).map_err(|e| {
            ModelError::Safetensors {
                path: weights.display().to_string(),
                message: e.to_string(),
            }
        })?;
        let mut by_path: HashMap<String, Tensor> = HashMap::new();
        for (name, t) in loaded {
            let Some(path) = name.strip_prefix(PEFT_PREFIX) else {
                return Err(unexpected(&name, &weights));
            };
            by_path.insert(path.to_string(), t);
        }
        let shapes = adapter_param_shapes(cfg, &spec).map_err(|message| ModelError::Config {
            path: config_path.display().to_string(),
            message,
        })?;
        let varmap = VarMap::new();
        for (name, shape) in &shapes {
            let t = by_path
                .remove(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: format!("{PEFT_PREFIX}{name}"),
                    files: weights.display().to_string(),
                })?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::WrongShape {
                    name: format!("{PEFT_PREFIX}{name}"),
                    file: weights.display().to_string(),
                    expected: shape.clone(),
                    found: t.dims().to_vec(),
                });
            }
            params::insert(&varmap, name, &t.to_dtype(DType::F32)?)?;
        }
        let mut left: Vec<&String> = by_path.keys().collect();
        left.sort();
        if let Some(name) = left.first() {
            return Err(unexpected(&format!("{PEFT_PREFIX}{name}"), &weights));
        }
        Ok(Self {
            spec,
            varmap,
            base_model,
        })
    }

    /// The base model named in the PEFT adapter directory `dir` (`base_model_name_or_path`).
    pub fn base_model_of(dir: &Path) -> Result<String> {
        Ok(read_peft_config(&dir.join(ADAPTER_CONFIG_FILE))?.1)
    }

    /// The spec (rank, alpha, target modules) of the adapter directory `dir`, from its config
    /// alone.
    pub fn spec_of(dir: &Path) -> Result<LoraSpec> {
        Ok(read_peft_config(&dir.join(ADAPTER_CONFIG_FILE))?.0)
    }
}

/// Keys of PEFT's `LoraConfig` that describe an adapter without changing what it computes
/// (`qalora_group_size` only counts with `use_qalora`, which must be false).
const METADATA_KEYS: [&str; 10] = [
    "peft_type",
    "task_type",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "auto_mapping",
    "peft_version",
    "lora_dropout",
    "megatron_core",
    "qalora_group_size",
];

/// The spec and base model of a PEFT `adapter_config.json`: `r`, `lora_alpha`, `lora_dropout` and
/// `target_modules` are read; metadata keys are ignored; any other key must hold a neutral value
/// (null, false, 0, "none", an empty list or object), else the adapter computes something we do
/// not and the key is named.
fn read_peft_config(path: &Path) -> Result<(LoraSpec, String)> {
    let bad = |message: String| ModelError::Config {
        path: path.display().to_string(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(io_error(path))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = json
        .as_object()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    match map.get("peft_type").and_then(|v| v.as_str()) {
        Some("LORA") => {}
        other => {
            return Err(bad(format!(
                "key `peft_type`: {other:?} is not a LoRA adapter (stepppo reads LORA only)"
            )))
        }
    }
    let number = |key: &str| {
        map.get(key)
            .and_then(|v| v.as_f64())
            .ok_or_else(|| bad(format!("key `{key}`: a number is required")))
    };
    let rank = number("r")?;
    if rank < 1.0 || rank.fract() != 0.0 {
        return Err(bad(format!(
            "key `r`: must be a positive integer, got {rank}"
        )));
    }
    let target_modules = match map.get("target_modules") {
        Some(serde_json::Value::String(s)) if s == ALL_LINEAR => vec![s.clone()],
        Some(serde_json::Value::String(s)) => {
            return Err(bad(format!(
                "key `target_modules`: the regular expression {s:?} is not supported; list the \
                 module names"
            )))
        }
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad(format!("key `target_modules`: {v} is not a name")))
            })
            .collect::<Result<Vec<_>>>()?,
        other => {
            return Err(bad(format!(
                "key `target_modules`: a list of module names is required, got {other:?}"
            )))
        }
    };
    // PEFT re-runs the initialisation when it loads an adapter; PiSSA, OLoRA, LoftQ and the like
    // rewrite the base weights then, so the adapter only means something on that rewritten base.
    match map.get("init_lora_weights") {
        None | Some(serde_json::Value::Bool(_)) => {}
        Some(serde_json::Value::String(s)) if s == "gaussian" => {}
        Some(other) => {
            return Err(bad(format!(
                "key `init_lora_weights` = {other}: this initialisation rewrites the base weights \
                 when PEFT loads the adapter, which stepppo does not do (convert the adapter to \
                 plain LoRA first)"
            )))
        }
    }
    for (key, value) in map {
        let read =
            ["r", "lora_alpha", "target_modules", "init_lora_weights"].contains(&key.as_str());
        if read || METADATA_KEYS.contains(&key.as_str()) || is_neutral(key, value) {
            continue;
        }
        return Err(bad(format!(
            "key `{key}` = {value}: stepppo cannot compute this adapter exactly (it supports \
             plain LoRA: no DoRA, rsLoRA, rank or alpha patterns, biases or extra modules)"
        )));
    }
    let spec = LoraSpec {
        rank: rank as usize,
        alpha: number("lora_alpha")?,
        dropout: map
            .get("lora_dropout")
            .and_then(|v| v.as_f64())
            .unwrap_or(0.0),
        target_modules,
    };
    spec.validate().map_err(bad)?;
    let base_model = map
        .get("base_model_name_or_path")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_string();
    Ok((spec, base_model))
}

/// Whether `value` of config `key` leaves plain LoRA unchanged.
fn is_neutral(key: &str, value: &serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::String(s) => s == "none" || (key == "layers_pattern" && s.is_empty()),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::Bool(true) => false,
    }
}

fn unexpected(name: &str, file: &Path) -> ModelError {
    ModelError::Safetensors {
        path: file.display().to_string(),
        message: format!(
            "tensor `{name}` is not a LoRA A or B of a module that {ADAPTER_CONFIG_FILE}'s \
             target_modules name on this model"
        ),
    }
}

fn lora_config_error(message: String) -> ModelError {
    ModelError::Config {
        path: "lora".into(),
        message,
    }
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Uniform values in ±`bound`, one ChaCha stream per `name` under `seed`.
fn uniform(name: &str, shape: &[usize], bound: f64, seed: u64, device: &Device) -> Result<Tensor> {
    let mut rng = params::name_rng(name, seed);
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| ((rng.random::<f64>() * 2.0 - 1.0) * bound) as f32)
        .collect();
    Ok(Tensor::from_vec(values, shape, device)?)
}
