//! `stepppo plan`: the memory a training update of a model needs, part by part (per rank of a
//! data-parallel world, sharded or not), and the largest forward that fits in a given memory ([`stepppo::train::learner::memory_plan`]).

use std::path::Path;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use stepppo::dist::shard::Sharding;
use stepppo::model::checkpoint::CONFIG_FILE;
use stepppo::model::{LoraSpec, ModelConfig, Precision};
use stepppo::tokenizer::Tokenizer;
use stepppo::train::learner::memory_plan::{MemoryPlan, PlanDevice, PlanShape, TrainedModel};

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// `builtin` (the `small` model), `tiny` or `small`, an HF model directory, or a model config
    /// JSON file (e.g. `configs/models/qwen2.5-0.5b.json`).
    #[arg(long, default_value = "builtin")]
    model: String,
    /// Train LoRA adapters of this rank on every projection instead of the weights.
    #[arg(long)]
    lora_rank: Option<usize>,
    /// Where the update runs.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    /// Positions of one forward (a mini-batch's tokens, padding included).
    #[arg(long, default_value_t = 4096)]
    batch_tokens: usize,
    /// Positions whose logits the loss reads (the response tokens); default half of
    /// --batch-tokens.
    #[arg(long)]
    response_tokens: Option<usize>,
    /// Longest sequence of a mini-batch (the CUDA attention's scores grow with it); default
    /// --batch-tokens.
    #[arg(long)]
    sequence_tokens: Option<usize>,
    /// Slots of the rollout's KV pool (`cache.kv_slots`).
    #[arg(long, default_value_t = 0)]
    kv_slots: usize,
    /// Blocks recompute their activations in the backward (`activation_checkpointing`).
    #[arg(long)]
    activation_checkpointing: bool,
    /// The dtype of the training products (`precision`: f32 or bf16).
    #[arg(long, default_value = "f32")]
    precision: Precision,
    /// The dtype generation stores the weights in (`rollout_dtype`: f32 or bf16); default f32
    /// on the CPU, bf16 on CUDA.
    #[arg(long)]
    rollout_dtype: Option<Precision>,
    /// A separate critic of the policy's shape trains beside it (with LoRA when --lora-rank is
    /// given, sharing the policy's base).
    #[arg(long)]
    separate_critic: bool,
    /// Data-parallel ranks: the plan is each rank's.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// What the ranks partition (`sharding`: none, optimizer, gradients; parameters is not
    /// available yet).
    #[arg(long, default_value = "none")]
    sharding: ShardingArg,
    /// Memory to hold the plan against, in GiB; default what the device has available (on CUDA
    /// the free memory of the first GPU, in a build with the `cuda` feature).
    #[arg(long)]
    memory_gib: Option<f64>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ShardingArg {
    None,
    Optimizer,
    Gradients,
}

impl From<ShardingArg> for Sharding {
    fn from(a: ShardingArg) -> Self {
        match a {
            ShardingArg::None => Sharding::None,
            ShardingArg::Optimizer => Sharding::Optimizer,
            ShardingArg::Gradients => Sharding::Gradients,
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

pub fn plan(a: PlanArgs) -> anyhow::Result<()> {
    let config = model_config(&a.model)?;
    let lora = a.lora_rank.map(|rank| LoraSpec {
        rank,
        alpha: 2.0 * rank as f64,
        dropout: 0.0,
        target_modules: vec!["all-linear".into()],
    });
    if let Some(spec) = &lora {
        spec.validate_for_training()
            .map_err(|e| anyhow::anyhow!("--lora-rank: {e}"))?;
    }
    if a.ranks == 0 {
        bail!("--ranks: at least 1");
    }
    let batch_tokens = a.batch_tokens;
    let shape = PlanShape {
        policy: TrainedModel {
            config: config.clone(),
            lora: lora.clone(),
            is_critic: false,
            shares_policy_weights: false,
        },
        critic: a.separate_critic.then(|| TrainedModel {
            config,
            lora: lora.clone(),
            is_critic: true,
            shares_policy_weights: lora.is_some(),
        }),
        device: match a.device {
            DeviceArg::Cpu => PlanDevice::Cpu,
            DeviceArg::Cuda => PlanDevice::Cuda,
        },
        batch_tokens,
        logit_rows: a
            .response_tokens
            .unwrap_or(batch_tokens / 2)
            .min(batch_tokens),
        sequence_tokens: a.sequence_tokens.unwrap_or(batch_tokens),
        activation_checkpointing: a.activation_checkpointing,
        precision: a.precision,
        rollout_precision: a.rollout_dtype.unwrap_or(match a.device {
            DeviceArg::Cpu => Precision::F32,
            DeviceArg::Cuda => Precision::Bf16,
        }),
        kv_slots: a.kv_slots,
        extra_policy_copies: 0,
        ranks: a.ranks,
        sharding: a.sharding.into(),
    };
    let available = match a.memory_gib {
        Some(gib) if gib.is_finite() && gib > 0.0 => Some((gib * (1u64 << 30) as f64) as u64),
        Some(gib) => bail!("--memory-gib: must be positive, got {gib}"),
        None => match a.device {
            DeviceArg::Cpu => stepppo::device::memory_available(&candle_core::Device::Cpu),
            DeviceArg::Cuda => stepppo::device::parse_device("cuda")
                .ok()
                .and_then(|gpu| stepppo::device::memory_available(&gpu)),
        },
    };
    print!("{}", MemoryPlan::of(&shape).table(&shape, available));
    Ok(())
}

/// The model shape `spec` names: `builtin` (the `small` size), a built-in size by name (`tiny`,
/// `small`, as `stepppo bench` takes them), an HF model directory or a config file.
fn model_config(spec: &str) -> anyhow::Result<ModelConfig> {
    let tok = Tokenizer::builtin();
    let named = if spec == "builtin" { "small" } else { spec };
    if let Some(config) = ModelConfig::named(named, &tok) {
        return Ok(config);
    }
    let path = Path::new(spec);
    let file = if path.is_dir() {
        path.join(CONFIG_FILE)
    } else {
        path.to_path_buf()
    };
    let config = ModelConfig::from_file(&file).with_context(|| format!("--model {spec}"))?;
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("--model {spec}: {}: {e}", file.display()))?;
    Ok(config)
}
