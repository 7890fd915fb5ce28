//! HF-layout model directories: `config.json`, weights as `model.safetensors` or shards listed in
//! `model.safetensors.index.json` (f32, bf16 or f16), and the tokenizer files. Loading validates
//! the config (see [`ModelConfig::validate`]), checks every expected tensor by name and shape (a
//! `VarMap` would silently skip missing names) and converts weights to f32; errors name the tensor
//! and file. Saving writes f32 safetensors with `{"format": "pt"}` metadata and a config whose
//! dtype says so, so transformers loads the directory with no missing or unexpected keys.
//! Optimiser state is the trainer's.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;

use super::critic::{value_head_shapes, SCORE_WEIGHT};
use super::lora::{Adapters, ADAPTER_CONFIG_FILE};
pub use super::params::write_safetensors;
use super::{params, Critic, Model, ModelConfig, ModelError, Result, ValueMlp};
use crate::tokenizer::Tokenizer;

/// File name of the model config in a checkpoint directory.
pub const CONFIG_FILE: &str = "config.json";
/// File name of unsharded weights.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// File name of the index that maps each tensor of sharded weights to its shard file.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub use crate::tokenizer::TOKENIZER_FILE;

/// Tensors of a checkpoint directory with the file each came from.
struct Loaded {
    tensors: HashMap<String, (Tensor, PathBuf)>,
    files: Vec<PathBuf>,
}

impl Loaded {
    fn read(dir: &Path, device: &Device) -> Result<Self> {
        Self::read_files(weight_files(dir)?, device)
    }

    /// The tensors of one safetensors file.
    fn read_file(file: &Path, device: &Device) -> Result<Self> {
        Self::read_files(vec![file.to_path_buf()], device)
    }

    fn read_files(files: Vec<PathBuf>, device: &Device) -> Result<Self> {
        let mut tensors = HashMap::new();
        for file in &files {
            let loaded = candle_core::safetensors::load(file, device).map_err(|e| {
                ModelError::Safetensors {
                    path: file.display().to_string(),
                    message: e.to_string(),
                }
            })?;
            for (name, t) in loaded {
                tensors.insert(name, (t, file.clone()));
            }
        }
        Ok(Self { tensors, files })
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Fails on a tensor of the files that `varmap` did not take: weights the config does not
    /// account for (say, a Qwen3 checkpoint labelled `qwen2`) would be a different model.
    /// transformers 4's saved RoPE buffers (`rotary_emb.inv_freq`) are recomputed, so allowed.
    fn check_all_used(&self, varmap: &VarMap, model_type: &str) -> Result<()> {
        self.check_all_known(&|name| params::has_var(varmap, name), model_type)
    }

    /// [`Loaded::check_all_used`] with the names the model takes given by `known`.
    fn check_all_known(&self, known: &dyn Fn(&str) -> bool, model_type: &str) -> Result<()> {
        let mut unused: Vec<(&String, &PathBuf)> = self
            .tensors
            .iter()
            .filter(|(name, _)| !known(name) && !name.ends_with("rotary_emb.inv_freq"))
            .map(|(name, (_, file))| (name, file))
            .collect();
        unused.sort();
        match unused.first() {
            Some((name, file)) => Err(ModelError::UnexpectedTensor {
                name: name.to_string(),
                file: file.display().to_string(),
                model_type: model_type.to_string(),
            }),
            None => Ok(()),
        }
    }

    /// A `VarMap` with every `(name, shape)` of `specs`, as f32.
    fn take(&self, specs: &[(String, Vec<usize>)], varmap: &VarMap) -> Result<()> {
        for (name, shape) in specs {
            let (t, file) = self
                .tensors
                .get(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: name.clone(),
                    files: self
                        .files
                        .iter()
                        .map(|f| f.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::WrongShape {
                    name: name.clone(),
                    file: file.display().to_string(),
                    expected: shape.clone(),
                    found: t.dims().to_vec(),
                });
            }
            params::insert(varmap, name, &t.to_dtype(DType::F32)?)?;
        }
        Ok(())
    }
}

/// The safetensors files of `dir`: the shards of the index when present, else `model.safetensors`.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(INDEX_FILE);
    if !index.exists() {
        return Ok(vec![dir.join(WEIGHTS_FILE)]);
    }
    let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
        path: index.display().to_string(),
        source,
    })?;
    let bad = |message: String| ModelError::Config {
        path: index.display().to_string(),
        message,
    };
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("key `weight_map` must be an object".into()))?;
    let mut files: Vec<String> = Vec::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("key `weight_map.{name}` must be a file name")))?;
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    files.sort();
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

fn write_dir(
    dir: &Path,
    cfg: &ModelConfig,
    varmap: &VarMap,
    tokenizer: Option<&Tokenizer>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    f32_config(cfg).save(&dir.join(CONFIG_FILE))?;
    let tensors: Vec<(String, Tensor)> = params::named_vars(varmap)
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().detach()))
        .collect();
    write_safetensors(&dir.join(WEIGHTS_FILE), &tensors)?;
    if let Some(tok) = tokenizer {
        tok.save_dir(dir)?;
    }
    Ok(())
}

/// `cfg` with its dtype keys (`dtype`, transformers 4's `torch_dtype`) saying float32, the dtype
/// of the written weights, so transformers does not cast them (a bf16 checkpoint is exported as
/// the f32 model stepppo computed with).
fn f32_config(cfg: &ModelConfig) -> ModelConfig {
    let mut cfg = cfg.clone();
    for key in ["dtype", "torch_dtype"] {
        if let Some(v) = cfg.extra.get_mut(key) {
            *v = "float32".into();
        }
    }
    cfg
}

impl Model {
    /// Loads an HF-layout directory (`config.json` + `model.safetensors` or sharded index). The LM
    /// head is untied when `lm_head.weight` is present or `tie_word_embeddings` is false; a shared
    /// value head `score.*` is picked up when present.
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let mut cfg = ModelConfig::from_file(&dir.join(CONFIG_FILE))?;
        let loaded = Loaded::read(dir, device)?;
        if loaded.has("lm_head.weight") {
            cfg.tie_word_embeddings = false;
        }
        let varmap = VarMap::new();
        loaded.take(&Self::param_shapes(&cfg), &varmap)?;
        if loaded.has(SCORE_WEIGHT) {
            loaded.take(&value_head_shapes(&cfg), &varmap)?;
        }
        loaded.check_all_used(&varmap, &cfg.model_type)?;
        Self::from_varmap(&cfg, varmap, device)
    }

    /// Writes `config.json`, `model.safetensors` (every var, f32) and, when given, `tokenizer.json`;
    /// a model with LoRA adapters writes the adapters alone, in PEFT's layout (their
    /// `base_model_name_or_path` names the base), plus the tokenizer.
    pub fn save(&self, dir: &Path, tokenizer: Option<&Tokenizer>) -> Result<()> {
        let Some(adapters) = self.adapters() else {
            return write_dir(dir, self.config(), self.varmap(), tokenizer);
        };
        adapters.save(dir)?;
        if let Some(tok) = tokenizer {
            tok.save_dir(dir)?;
        }
        Ok(())
    }
}

/// The value head of a critic with LoRA adapters (`score.weight`, `score.bias`), beside the
/// adapter's PEFT files in its directory.
pub const VALUE_HEAD_FILE: &str = "value_head.safetensors";

impl Critic {
    /// Loads a critic directory; a policy directory without `score.*` gives a critic whose trunk
    /// starts from the policy's weights and whose head is initialised from `seed`. A directory
    /// that [`Critic::save`] wrote for a critic with LoRA adapters (PEFT's adapter files and
    /// [`VALUE_HEAD_FILE`]) gives its base (`base_model_name_or_path`) with the adapters and the
    /// head attached.
    pub fn load(dir: &Path, device: &Device, seed: u64) -> Result<Self> {
        if dir.join(ADAPTER_CONFIG_FILE).is_file() {
            return Self::load_adapted(dir, device, seed);
        }
        let cfg = ModelConfig::from_file(&dir.join(CONFIG_FILE))?;
        let loaded = Loaded::read(dir, device)?;
        let varmap = VarMap::new();
        loaded.take(&super::decoder::trunk_param_shapes(&cfg), &varmap)?;
        if loaded.has(SCORE_WEIGHT) {
            loaded.take(&value_head_shapes(&cfg), &varmap)?;
        } else {
            params::insert_init(&varmap, &cfg, &value_head_shapes(&cfg), seed, device)?;
        }
        Self::from_varmap(&cfg, varmap, device)
    }

    /// A critic with adapters: the base its adapter names, the head of [`VALUE_HEAD_FILE`].
    fn load_adapted(dir: &Path, device: &Device, seed: u64) -> Result<Self> {
        let base = Adapters::base_model_of(dir)?;
        let base_dir = Path::new(&base);
        if !base_dir.join(CONFIG_FILE).is_file() {
            return Err(ModelError::Config {
                path: dir.join(ADAPTER_CONFIG_FILE).display().to_string(),
                message: format!(
                    "key `base_model_name_or_path`: {base:?} is not a model directory here"
                ),
            });
        }
        let plain = Self::load(base_dir, device, seed)?;
        let cfg = plain.config().clone();
        let head_file = dir.join(VALUE_HEAD_FILE);
        let head = Loaded::read_file(&head_file, device)?;
        let varmap = VarMap::new();
        for (name, var) in plain.named_vars() {
            if !name.starts_with(super::critic::VALUE_HEAD_PREFIX) {
                params::insert(&varmap, &name, var.as_tensor())?;
            }
        }
        head.take(&value_head_shapes(&cfg), &varmap)?;
        head.check_all_used(&varmap, &cfg.model_type)?;
        let mut critic = Self::from_varmap(&cfg, varmap, device)?;
        critic.attach_adapters(Adapters::load(dir, &cfg, device)?)?;
        Ok(critic)
    }

    /// Writes `config.json` and `model.safetensors` (trunk + `score.*`); a critic with LoRA
    /// adapters writes the adapters in PEFT's layout (their `base_model_name_or_path` names the
    /// base) and its head in [`VALUE_HEAD_FILE`].
    pub fn save(&self, dir: &Path) -> Result<()> {
        let Some(adapters) = self.adapters() else {
            return write_dir(dir, self.config(), self.varmap(), None);
        };
        adapters.save(dir)?;
        let head: Vec<(String, Tensor)> = self
            .head_vars()
            .into_iter()
            .map(|(name, var)| (name, var.as_tensor().detach()))
            .collect();
        write_safetensors(&dir.join(VALUE_HEAD_FILE), &head)
    }
}

impl ValueMlp {
    /// Loads the MLP and feature scaling that [`ValueMlp::save`] wrote into `dir`, for
    /// `policy`'s features.
    pub fn load(dir: &Path, policy: &Model) -> Result<Self> {
        Self::load_width(dir, policy.value_feature_width(), policy.device())
    }

    /// Loads the MLP and scaling that [`ValueMlp::save`] wrote into `dir`, for inputs
    /// `width` wide (an error when the stored shapes differ).
    pub fn load_width(dir: &Path, width: usize, device: &Device) -> Result<Self> {
        let loaded = Loaded::read(dir, device)?;
        let varmap = VarMap::new();
        loaded.take(&Self::param_shapes(width), &varmap)?;
        let scaling = VarMap::new();
        let [mean, scale] = Self::SCALING.map(String::from);
        let scaling_shapes = [(mean, vec![width]), (scale, vec![1])];
        loaded.take(&scaling_shapes, &scaling)?;
        loaded.check_all_known(
            &|name| params::has_var(&varmap, name) || params::has_var(&scaling, name),
            "feature critic",
        )?;
        let get = |name: &str| params::var_tensor(&scaling, name);
        Self::from_parts(varmap, &get(Self::SCALING[0])?, &get(Self::SCALING[1])?)
    }

    /// Writes `model.safetensors` (the MLP's parameters and the feature scaling) into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let tensors: Vec<(String, Tensor)> = self
            .named_vars()
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().detach()))
            .chain(self.scaling())
            .collect();
        write_safetensors(&dir.join(WEIGHTS_FILE), &tensors)
    }
}

/// transformers' sampling defaults beside a checkpoint's weights, which a merged model keeps.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// What [`merge_adapter`] wrote.
#[derive(Debug, Clone)]
pub struct MergeReport {
    /// The adapter's LoRA rank.
    pub rank: usize,
    /// The base the adapter's `base_model_name_or_path` names, when it names another one than
    /// the base merged onto (same shapes, or the merge would have failed).
    pub other_base: Option<String>,
    /// The base had a `tokenizer.json`, copied beside the merged weights.
    pub tokenizer: bool,
    /// The base's `generation_config.json` was copied.
    pub generation_config: bool,
}

/// Folds the PEFT LoRA adapter directory `adapter` into `base` (`builtin` or an HF directory) and
/// writes the merged model to `out` in HF layout with the base's tokenizer and
/// `generation_config.json` when it has them. An existing, non-empty `out` is an error unless
/// `overwrite`; an adapter made for another base of the same shapes merges, and the report says
/// which base it names.
pub fn merge_adapter(
    base: &str,
    adapter: &Path,
    out: &Path,
    overwrite: bool,
) -> Result<MergeReport> {
    let occupied = std::fs::read_dir(out).is_ok_and(|mut entries| entries.next().is_some());
    if occupied && !overwrite {
        return Err(ModelError::Config {
            path: out.display().to_string(),
            message: "exists and is not empty; pass --overwrite to replace it, or choose \
                      another --out"
                .into(),
        });
    }
    let (mut model, tok) = if base == "builtin" {
        let (model, tok) = builtin_policy(&Device::Cpu)?;
        (model, Some(tok))
    } else {
        // A base without a tokenizer (weights and config only) merges too, into a directory
        // without one.
        let dir = Path::new(base);
        if std::fs::canonicalize(dir).ok() == std::fs::canonicalize(out).ok() {
            return Err(ModelError::Config {
                path: out.display().to_string(),
                message: "is the base itself; write the merged model elsewhere".into(),
            });
        }
        let tok = dir
            .join(TOKENIZER_FILE)
            .is_file()
            .then(|| Tokenizer::from_dir(dir))
            .transpose()?;
        (Model::load(dir, &Device::Cpu)?, tok)
    };
    let named = Adapters::base_model_of(adapter)?;
    let adapters = Adapters::load(adapter, model.config(), &Device::Cpu)?;
    let rank = adapters.spec().rank;
    model.attach_adapters(adapters)?;
    let merged = model.merged()?;
    if occupied {
        // `overwrite`: the old contents go, so no file of another model stays beside the new.
        std::fs::remove_dir_all(out).map_err(|source| ModelError::Io {
            path: out.display().to_string(),
            source,
        })?;
    }
    merged.save(out, tok.as_ref())?;
    let generation_config = Path::new(base).join(GENERATION_CONFIG_FILE);
    let copied = base != "builtin" && generation_config.is_file();
    if copied {
        let to = out.join(GENERATION_CONFIG_FILE);
        std::fs::copy(&generation_config, &to).map_err(|source| ModelError::Io {
            path: to.display().to_string(),
            source,
        })?;
    }
    Ok(MergeReport {
        rank,
        other_base: (!named.is_empty() && !same_base(&named, base)).then_some(named),
        tokenizer: tok.is_some(),
        generation_config: copied,
    })
}

/// Whether the base an adapter names (`named`) is `base`: the same word, or the same directory.
fn same_base(named: &str, base: &str) -> bool {
    let canonical = |p: &str| std::fs::canonicalize(p).ok();
    named == base || canonical(named).is_some_and(|n| Some(n) == canonical(base))
}

/// Seed of the built-in policy (`--model builtin`).
pub const BUILTIN_SEED: u64 = 0;

/// The built-in policy: a freshly initialised `small` model over the built-in tokenizer.
pub fn builtin_policy(device: &Device) -> Result<(Model, Tokenizer)> {
    let tok = Tokenizer::builtin();
    let model = Model::new(&ModelConfig::small(tok.vocab_size()), BUILTIN_SEED, device)?;
    Ok((model, tok))
}

/// `builtin`, an HF-layout directory with `tokenizer.json` (and, when present, the chat template
/// and end-of-turn token of `tokenizer_config.json` / `chat_template.jinja`), or a PEFT LoRA
/// adapter directory, loaded onto the base model its `base_model_name_or_path` names (whose
/// tokenizer it uses).
pub fn load_policy(spec: &str, device: &Device) -> Result<(Model, Tokenizer)> {
    if spec == "builtin" {
        return builtin_policy(device);
    }
    let dir = Path::new(spec);
    if dir.join(ADAPTER_CONFIG_FILE).is_file() {
        let base = Adapters::base_model_of(dir)?;
        if !Path::new(&base).join(CONFIG_FILE).is_file() && base != "builtin" {
            return Err(ModelError::Config {
                path: dir.join(ADAPTER_CONFIG_FILE).display().to_string(),
                message: format!(
                    "key `base_model_name_or_path`: {base:?} is not a model directory here; \
                     load the base with --model DIR and this adapter with --adapter"
                ),
            });
        }
        return load_policy_with_adapter(&base, Some(dir), device);
    }
    load_plain_policy(spec, device)
}

/// What a user of the model `spec` (`builtin` or a directory) should hear when its tokenizer has
/// no chat template (neither `chat_template.jinja` nor `tokenizer_config.json`'s
/// `chat_template`): conversations are then rendered in ChatML, Qwen's turns, which a model
/// trained on another template does not expect. `None` for the built-in model, whose own turns
/// are ChatML, and for a tokenizer with a template.
pub fn chat_template_note(spec: &str, tok: &Tokenizer) -> Option<String> {
    (spec != "builtin" && tok.chat_template().is_none()).then(|| {
        format!(
            "{spec} has no chat template (no chat_template.jinja, no `chat_template` in \
             tokenizer_config.json): conversations are rendered as ChatML \
             (<|im_start|>role ... <|im_end|>); add the model's own template to render its turns"
        )
    })
}

/// `builtin` or an HF-layout model directory (no adapters).
fn load_plain_policy(spec: &str, device: &Device) -> Result<(Model, Tokenizer)> {
    if spec == "builtin" {
        return builtin_policy(device);
    }
    let dir = Path::new(spec);
    let tok = Tokenizer::from_dir(dir)?;
    Ok((Model::load(dir, device)?, tok))
}

/// The model `spec` names (`builtin` or an HF-layout directory) with the PEFT LoRA adapter in
/// `adapter` attached when given.
pub fn load_policy_with_adapter(
    spec: &str,
    adapter: Option<&Path>,
    device: &Device,
) -> Result<(Model, Tokenizer)> {
    let (mut model, tok) = match adapter {
        Some(_) => load_plain_policy(spec, device)?,
        None => load_policy(spec, device)?,
    };
    if let Some(dir) = adapter {
        let adapters = Adapters::load(dir, model.config(), device)?;
        model.attach_adapters(adapters)?;
    }
    Ok((model, tok))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_without_a_chat_template_is_told_its_turns_are_chatml() {
        let tok = Tokenizer::builtin();
        assert_eq!(chat_template_note("builtin", &tok), None);
        let note = chat_template_note("models/mine", &tok).unwrap();
        assert!(note.starts_with("models/mine has no chat template") && note.contains("ChatML"));
    }
}
