//! Construction shared by the training loop, the warm start and evaluation: the device a config
//! names ([`device_of`]), the rollout engine of a policy ([`engine_for`]) and the policy a fresh
//! run starts from ([`fresh_policy`]) with its LoRA adapters ([`attach_run_adapters`]), and a
//! separate critic's adapters ([`attach_critic_adapters`]), and the names of the run-directory
//! entries these write ([`WARM_START_DIR`], [`LORA_BASE_DIR`], [`CRITIC_BASE_DIR`]). It builds
//! things from a config; it runs nothing and holds no run state (the loop's critic, optimizers
//! and checkpoints are the run's).

use crate::config::{BuiltinSize, Config, DeviceKind, PretrainSource};
use crate::model::{Adapters, Critic, LoraSpec, Model, ModelConfig, ModelError};
use crate::rollout::engine::{CacheMode, Engine, EngineConfig};
use crate::seed;
use crate::tokenizer::Tokenizer;
use crate::train::TrainError;
use candle_core::Device;
use std::path::{Path, PathBuf};

/// The policy as the warm start left it (HF layout), for a run that had one: another run with
/// `pretrain` set to it and the warm start off starts its RL from the very same policy (and
/// critic, where the critic is copied from the policy as RL starts; a critic pre-trained apart,
/// `critic.pretrain`, is not saved here).
pub const WARM_START_DIR: &str = "warm_start";
/// The frozen base model of a LoRA run whose base is on no disk otherwise (the built-in model
/// without a warm start); the adapters of its checkpoints name it.
pub const LORA_BASE_DIR: &str = "base";
/// The frozen base of a separate critic with LoRA adapters, where it is on no disk otherwise (a
/// built-in trunk, or a critic the warm start trained); the critic's adapters name it.
pub const CRITIC_BASE_DIR: &str = "critic_base";

/// Seed-path tag of the policy's initialisation (the loop's other components use 2 and up).
const SEED_POLICY: u64 = 1;

pub(crate) fn device_of(kind: DeviceKind) -> Result<Device, TrainError> {
    let name = match kind {
        DeviceKind::Cpu => "cpu".to_string(),
        // Each data-parallel rank of a node on its own GPU.
        DeviceKind::Cuda => format!("cuda:{}", crate::dist::local_rank()),
    };
    crate::device::parse_device(&name).map_err(|e| TrainError::Data(format!("key `device`: {e}")))
}

/// The rollout engine of a run (radix cache unless `cache.prefix_cache` is off).
pub(crate) fn engine_for(cfg: &Config, policy: &Model) -> Result<Engine, TrainError> {
    let engine_cfg = EngineConfig {
        cache_mode: if cfg.cache.prefix_cache {
            CacheMode::Radix
        } else {
            CacheMode::None
        },
        num_slots: cfg.cache.kv_slots,
        prefill_attention: cfg.cache.prefill_attention,
        cascade_attention: cfg.cache.cascade_attention,
        ..EngineConfig::default()
    };
    Ok(Engine::for_model(policy, engine_cfg)?)
}

/// The policy a fresh run starts from: an HF checkpoint directory, or a model initialised from
/// the run seed over the built-in tokenizer plus the words the run's envs write (the built-in
/// model of `builtin_size`, or the shape of a model config file).
pub(crate) fn fresh_policy(
    cfg: &Config,
    device: &Device,
) -> Result<(Model, Tokenizer), TrainError> {
    let builtin_tokenizer = || {
        cfg.builtin_words()
            .map(|words| Tokenizer::builtin_with_words(&words))
            .map_err(TrainError::Data)
    };
    let (mc, tok) = match cfg.pretrain_source() {
        PretrainSource::Checkpoint(dir) => {
            return Ok(crate::model::checkpoint::load_policy(
                &dir.display().to_string(),
                device,
            )?)
        }
        PretrainSource::Builtin(size) => {
            let tok = builtin_tokenizer()?;
            let mc = match size {
                BuiltinSize::Tiny => ModelConfig::tiny(tok.vocab_size()),
                BuiltinSize::Small => ModelConfig::small(tok.vocab_size()),
            };
            (mc, tok)
        }
        PretrainSource::Shape(file) => {
            let tok = builtin_tokenizer()?;
            (shape_over_builtin_tokenizer(file, &tok)?, tok)
        }
    };
    let model = Model::new(&mc, seed::derive(cfg.seed, &[SEED_POLICY]), device)?;
    Ok((model, tok))
}

/// The model shape `file` states (`pretrain` naming a config file), checked to be one we compute
/// exactly and to hold every id of `tok`.
fn shape_over_builtin_tokenizer(file: &Path, tok: &Tokenizer) -> Result<ModelConfig, TrainError> {
    let fail = |message: String| ModelError::Config {
        path: file.display().to_string(),
        message: format!("(`pretrain`) {message}"),
    };
    let mc = ModelConfig::from_file(file)?;
    mc.validate().map_err(fail)?;
    if mc.vocab_size < tok.vocab_size() {
        return Err(fail(format!(
            "vocab_size {} is below the built-in tokenizer's {} ids",
            mc.vocab_size,
            tok.vocab_size()
        ))
        .into());
    }
    Ok(mc)
}

/// Seed-path tag of a fresh LoRA adapter's initialisation.
const SEED_ADAPTERS: u64 = 6;
/// Seed-path tag of a separate critic's fresh LoRA adapters.
const SEED_CRITIC_ADAPTERS: u64 = 7;

/// Where a LoRA run's base model lives: the warm start when one ran, `<run>/base` for a built-in
/// or shaped model used as it was initialised (written by [`attach_run_adapters`]), else
/// `pretrain`.
fn lora_base_dir(cfg: &Config, run_dir: &Path, warm_started: bool) -> PathBuf {
    if warm_started {
        run_dir.join(WARM_START_DIR)
    } else {
        match cfg.pretrain_source() {
            PretrainSource::Checkpoint(dir) => dir.to_path_buf(),
            PretrainSource::Builtin(_) | PretrainSource::Shape(_) => run_dir.join(LORA_BASE_DIR),
        }
    }
}

/// Attaches a fresh LoRA run's adapters to `policy` (as any warm start left it, which becomes the
/// frozen base): `pretrain_adapter`'s, checked against `lora`, or fresh ones of `lora`. With
/// `write_base` (rank 0) a built-in base that is on no disk yet is saved to `<run>/base`, so
/// checkpoints, `eval` and resumes find it by the path the adapters record.
pub(crate) fn attach_run_adapters(
    cfg: &Config,
    run_dir: &Path,
    (policy, tok): (&mut Model, &Tokenizer),
    warm_started: bool,
    write_base: bool,
) -> Result<(), TrainError> {
    if !cfg.lora_enabled() {
        return Ok(());
    }
    let base = absolute(&policy_base(
        cfg,
        run_dir,
        (policy, tok),
        warm_started,
        write_base,
    )?)?;
    let adapters = match (&cfg.pretrain_adapter, &cfg.lora) {
        (Some(dir), spec) => {
            let loaded = Adapters::load(Path::new(dir), policy.config(), policy.device())?;
            if let Some(spec) = spec {
                check_same_adapter(spec, loaded.spec(), dir)?;
            }
            loaded.with_base_model(&base)
        }
        (None, Some(spec)) => Adapters::fresh(
            policy.config(),
            spec,
            seed::derive(cfg.seed, &[SEED_ADAPTERS]),
            policy.device(),
            &base,
        )?,
        (None, None) => return Ok(()),
    };
    policy.attach_adapters(adapters)?;
    Ok(())
}

/// The directory of the policy as RL starts, for adapters to name as their base
/// ([`lora_base_dir`]); a built-in policy without a warm start is written there first by rank 0
/// (`write_base`), once.
fn policy_base(
    cfg: &Config,
    run_dir: &Path,
    (policy, tok): (&Model, &Tokenizer),
    warm_started: bool,
    write_base: bool,
) -> Result<PathBuf, TrainError> {
    let base = lora_base_dir(cfg, run_dir, warm_started);
    let on_disk = base.join(crate::model::checkpoint::CONFIG_FILE).is_file();
    let initialised = !matches!(cfg.pretrain_source(), PretrainSource::Checkpoint(_));
    if write_base && !warm_started && initialised && !on_disk {
        policy.save(&base, Some(tok))?;
    }
    Ok(base)
}

/// `path` made absolute, as an adapter records its base.
fn absolute(path: &Path) -> Result<String, TrainError> {
    let path = std::path::absolute(path).map_err(|source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(path.display().to_string())
}

/// Attaches fresh adapters of `critic.lora` to a fresh run's separate `critic` (as the warm start
/// left it, which becomes its frozen base). The base they record: `critic.pretrain` when the
/// critic is that directory unchanged; the policy's base when the critic is a copy of the policy
/// as RL starts ([`Critic::from_policy`]); else `<run>/critic_base`, which rank 0 (`write_base`)
/// writes. Call before the policy's own adapters attach, so a built-in base is still the policy.
pub(crate) fn attach_critic_adapters(
    cfg: &Config,
    run_dir: &Path,
    (critic, policy, tok): (&mut Critic, &Model, &Tokenizer),
    warm_started: bool,
    write_base: bool,
) -> Result<(), TrainError> {
    let Some(spec) = &cfg.critic.lora else {
        return Ok(());
    };
    if critic.adapters().is_some() {
        return Err(TrainError::Data(format!(
            "critic.pretrain {}: a critic with LoRA adapters of its own; critic.lora adds fresh \
             ones on a plain base (merge the adapters into a model directory first)",
            cfg.critic.pretrain.as_deref().unwrap_or_default()
        )));
    }
    let critic_warmed = cfg.sft.steps > 0 && cfg.sft.value_loss_coef > 0.0;
    let base = match cfg.critic.pretrain.as_deref() {
        None => policy_base(cfg, run_dir, (policy, tok), warm_started, write_base)?,
        Some(dir) if dir != "builtin" && !critic_warmed => PathBuf::from(dir),
        Some(_) => {
            let base = run_dir.join(CRITIC_BASE_DIR);
            if write_base {
                critic.save(&base)?;
            }
            base
        }
    };
    let adapters = Adapters::fresh(
        critic.config(),
        spec,
        seed::derive(cfg.seed, &[SEED_CRITIC_ADAPTERS]),
        critic.device(),
        &absolute(&base)?,
    )?;
    critic.attach_adapters(adapters)?;
    Ok(())
}

/// The LoRA adapters a fresh run of `cfg` trains: `lora`, else `pretrain_adapter`'s.
pub(crate) fn run_lora_spec(cfg: &Config) -> Result<Option<LoraSpec>, TrainError> {
    Ok(match (&cfg.lora, &cfg.pretrain_adapter) {
        (Some(spec), _) => Some(spec.clone()),
        (None, Some(dir)) => Some(Adapters::spec_of(Path::new(dir))?),
        (None, None) => None,
    })
}

/// `pretrain_adapter`'s spec must be the `lora` the config states (rank, alpha, modules).
fn check_same_adapter(want: &LoraSpec, found: &LoraSpec, dir: &str) -> Result<(), TrainError> {
    let targets = |s: &LoraSpec| s.targets().unwrap_or_default();
    if want.rank != found.rank || want.alpha != found.alpha || targets(want) != targets(found) {
        return Err(TrainError::Data(format!(
            "pretrain_adapter {dir}: r {}, lora_alpha {}, target_modules {:?} differ from lora \
             (rank {}, alpha {}, target_modules {:?}); leave lora unset to take the adapter's",
            found.rank,
            found.alpha,
            targets(found),
            want.rank,
            want.alpha,
            targets(want)
        )));
    }
    Ok(())
}
