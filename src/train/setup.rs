//! Construction shared by the training loop, the warm start and evaluation: the device a config
//! names ([`device_of`]), the rollout engine of a policy ([`engine_for`]) and the policy a fresh
//! run starts from ([`fresh_policy`]). It builds things from a config; it runs nothing and holds
//! no run state (the loop's critic, optimizers and checkpoints are [`super::trainer`]'s).

use super::TrainError;
use crate::config::{BuiltinSize, Config, DeviceKind};
use crate::model::{Model, ModelConfig};
use crate::rollout::engine::{CacheMode, Engine, EngineConfig};
use crate::seed;
use crate::tokenizer::Tokenizer;
use candle_core::Device;

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
