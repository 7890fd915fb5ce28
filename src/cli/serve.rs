//! `stepppo serve`: the OpenAI-compatible gateway over a fixed policy, recording the sessions it
//! serves into a step dataset when `--record` is given.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use stepppo::model::checkpoint::{chat_template_note, load_policy_with_adapter};
use stepppo::model::lora::ADAPTER_CONFIG_FILE;
use stepppo::model::Precision;
use stepppo::rollout::engine::{Engine, EngineConfig};
use stepppo::serve::{self, ApiKey, GatewayOptions, PolicyBackend, Recorder, API_KEY_ENV};
use stepppo::store::WriterOptions;
use stepppo::train::run::checkpoint;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// `builtin` (the freshly initialised small model), an HF-layout model directory, a run
    /// directory (its latest checkpoint) or a checkpoint directory.
    #[arg(long, default_value = "builtin")]
    pub model: String,
    /// A PEFT LoRA adapter directory to apply to --model.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// The model id clients send (default: the `--model` value).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Address to bind. The default serves this machine only; any other address needs an API
    /// key.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The key clients must send (`Authorization: Bearer <key>`, the OpenAI clients' `api_key`).
    /// Prefer the STEPPPO_API_KEY environment variable: a flag shows in the process list.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Port to listen on; 0 picks a free one (printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Write every closed session into the step dataset in this directory (created, or appended
    /// to).
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// Reply length when a request gives no `max_tokens`.
    #[arg(long, default_value_t = 256)]
    pub default_max_tokens: usize,
    /// Added to the reward of a recorded step whose tool call did not parse (≤ 0).
    #[arg(long, default_value_t = serve::DEFAULT_TOOL_CALL_PENALTY, allow_negative_numbers = true)]
    pub tool_call_penalty: f32,
    /// Seconds an idle session is kept open before it is dropped unrecorded.
    #[arg(long, default_value_t = 600)]
    pub session_ttl: u64,
    /// Largest request body in bytes (larger ones get 413).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// KV slots of the engine's pool (the radix cache and running sequences share them).
    #[arg(long, default_value_t = 65_536)]
    pub kv_slots: usize,
    /// Seed of the sampling of requests that give no `seed`.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// `cpu`, `cuda` or `cuda:N` (CUDA needs a `--features cuda` build).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The dtype the weights, activations and K/V are stored in: `f32` or `bf16` (norms,
    /// attention scores, log-probs and sampling accumulate in f32 either way). Default: f32 on
    /// the CPU, bf16 on CUDA.
    #[arg(long)]
    pub dtype: Option<Precision>,
    /// Prefill attention on CUDA: `paged` (ours) or `flash` (candle-flash-attn; a build with
    /// the `flash-attn` feature and bf16 K/V).
    #[arg(long, default_value = "paged")]
    pub prefill_attention: stepppo::kv::PrefillAttention,
    /// Compute threads on CPU (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

/// The policy directory a `--model` value names (`builtin` stays as it is).
fn model_spec(model: &str) -> anyhow::Result<String> {
    let path = Path::new(model);
    if model == "builtin"
        || path.join("config.json").is_file() && !path.join("ckpt-latest").exists()
        || path.join(ADAPTER_CONFIG_FILE).is_file()
    {
        return Ok(model.to_string());
    }
    let ckpt = checkpoint::resolve(path).with_context(|| {
        format!("--model {model}: neither `builtin`, a model directory nor a checkpoint")
    })?;
    Ok(ckpt.join("policy").display().to_string())
}

pub fn serve(a: ServeArgs) -> anyhow::Result<()> {
    stepppo::device::set_cpu_threads(a.threads);
    let device = stepppo::device::parse_device(&a.device)?;
    let spec = model_spec(&a.model)?;
    let (mut model, tokenizer) = load_policy_with_adapter(&spec, a.adapter.as_deref(), &device)
        .with_context(|| format!("loading model {spec}"))?;
    if let Some(note) = chat_template_note(&spec, &tokenizer) {
        eprintln!("warning: {note}");
    }
    if let Some(dtype) = a.dtype {
        model.set_rollout_precision(dtype).context("--dtype")?;
    }
    let engine_cfg = EngineConfig {
        num_slots: a.kv_slots,
        prefill_attention: a.prefill_attention,
        ..EngineConfig::default()
    };
    let engine = Engine::for_model(&model, engine_cfg)?;
    let recorder = match &a.record {
        Some(dir) => {
            let mut opts = WriterOptions::default();
            opts.metadata
                .insert("recorded_by".into(), "stepppo serve".into());
            opts.metadata.insert("model".into(), spec.clone().into());
            Some(Recorder::open(dir, opts).with_context(|| format!("--record {}", dir.display()))?)
        }
        None => None,
    };
    let max_context = model.config().max_position_embeddings.min(a.kv_slots);
    let mut opts = GatewayOptions::new(
        a.served_model_name.as_deref().unwrap_or(&a.model),
        max_context,
        a.seed,
    );
    opts.host = a.host;
    opts.port = a.port;
    opts.api_key = ApiKey::from_flag_or_env(a.api_key)
        .map_err(|e| anyhow::anyhow!("--api-key / {API_KEY_ENV}: {e}"))?;
    opts.max_body_bytes = a.max_body_bytes;
    opts.worker.default_max_tokens = a.default_max_tokens;
    opts.worker.session_ttl = Duration::from_secs(a.session_ttl);
    anyhow::ensure!(
        a.tool_call_penalty <= 0.0 && a.tool_call_penalty.is_finite(),
        "--tool-call-penalty: must be finite and ≤ 0, got {}",
        a.tool_call_penalty
    );
    opts.worker.tool_call_penalty = a.tool_call_penalty;
    let gateway = serve::start(&opts)?;
    println!(
        "stepppo serve: http://{}/v1 serving `{}`{}{} (Ctrl-C stops)",
        gateway.addr(),
        opts.model_name,
        if opts.api_key.is_some() {
            ", API key required"
        } else {
            ""
        },
        a.record
            .as_ref()
            .map(|d| format!(", recording into {}", d.display()))
            .unwrap_or_default()
    );
    let mut backend = PolicyBackend {
        model,
        tokenizer,
        engine,
        recorder,
    };
    gateway.serve(&mut backend)
}
