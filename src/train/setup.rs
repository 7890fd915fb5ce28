//! Construction shared by the training loop, the warm start and evaluation: the device a config
//! names ([`device_of`]), the rollout engine of a policy ([`engine_for`]) and the policy a fresh
//! run starts from ([`fresh_policy`]) with its LoRA adapters ([`attach_run_adapters`]). It builds things from a config; it runs nothing and holds
//! no run state (the loop's critic, optimizers and checkpoints are [`super::trainer`]'s).

use super::{run_dir, TrainError};
use crate::config::{BuiltinSize, Config, DeviceKind};
use crate::model::{Adapters, LoraSpec, Model, ModelConfig};
use crate::rollout::engine::{CacheMode, Engine, EngineConfig};
use crate::seed;
use crate::tokenizer::Tokenizer;
use candle_core::Device;
use std::path::{Path, PathBuf};

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
        ..EngineConfig::default()
    };
    Ok(Engine::new(policy.config(), engine_cfg, policy.device())?)
}

/// The policy a fresh run starts from: the built-in model (`tiny`/`small`, initialised from the
/// run seed, over the built-in tokenizer plus the words the run's envs write) or an HF
/// checkpoint directory.
pub(crate) fn fresh_policy(
    cfg: &Config,
    device: &Device,
) -> Result<(Model, Tokenizer), TrainError> {
    if cfg.pretrain != "builtin" {
        return Ok(crate::model::checkpoint::load_policy(
            &cfg.pretrain,
            device,
        )?);
    }
    let tok = Tokenizer::builtin_with_words(&cfg.builtin_words().map_err(TrainError::Data)?);
    let mc = match cfg.builtin_size {
        BuiltinSize::Tiny => ModelConfig::tiny(tok.vocab_size()),
        BuiltinSize::Small => ModelConfig::small(tok.vocab_size()),
    };
    let model = Model::new(&mc, seed::derive(cfg.seed, &[SEED_POLICY]), device)?;
    Ok((model, tok))
}

/// Seed-path tag of a fresh LoRA adapter's initialisation.
const SEED_ADAPTERS: u64 = 6;

/// Where a LoRA run's base model lives: the warm start when one ran, `<run>/base` for a built-in
/// model used as it was initialised (written by [`attach_run_adapters`]), else `pretrain`.
fn lora_base_dir(cfg: &Config, run_dir: &Path, warm_started: bool) -> PathBuf {
    if warm_started {
        run_dir.join(run_dir::WARM_START_DIR)
    } else if cfg.pretrain == "builtin" {
        run_dir.join(run_dir::LORA_BASE_DIR)
    } else {
        PathBuf::from(&cfg.pretrain)
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
    let base = lora_base_dir(cfg, run_dir, warm_started);
    if write_base && !warm_started && cfg.pretrain == "builtin" {
        policy.save(&base, Some(tok))?;
    }
    let base = std::path::absolute(&base).map_err(|source| TrainError::Io {
        path: base.clone(),
        source,
    })?;
    let base = base.display().to_string();
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
