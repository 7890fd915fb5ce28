//! `stepppo generate`, `stepppo init-model`, `stepppo merge-adapter`.

use std::path::PathBuf;

use anyhow::{bail, Context};
use candle_core::Device;
use clap::Args;
use stepppo::kv::KvPool;
use stepppo::model::checkpoint::{
    chat_template_note, load_policy_with_adapter, merge_adapter as merge_adapter_into,
};
use stepppo::model::{Model, ModelConfig, Precision};
use stepppo::rollout::engine::{CacheMode, Engine, EngineConfig, GenRequest};
use stepppo::rollout::forced_logprobs;
use stepppo::rollout::sampling::SamplingParams;
use stepppo::tokenizer::{ChatTemplate, Tokenizer};

/// A model and a prompt: what `generate` continues and `score` scores a continuation of.
#[derive(Args, Debug)]
pub struct PromptedModel {
    /// `builtin` (the freshly initialised small model, seed 0), an HF-format model directory, or
    /// a PEFT LoRA adapter directory (on the base its `base_model_name_or_path` names).
    #[arg(long, default_value = "builtin")]
    model: String,
    /// A PEFT LoRA adapter directory to apply to --model.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Prompt text, wrapped in a chat user turn unless --raw.
    #[arg(
        long,
        required_unless_present = "prompt_ids",
        conflicts_with = "prompt_ids"
    )]
    prompt: Option<String>,
    /// Prompt token ids, comma-separated, used as they are.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Encode --prompt as-is instead of as a chat user turn.
    #[arg(long)]
    raw: bool,
    /// `cpu`, `cuda` or `cuda:N` (CUDA needs a `--features cuda` build).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The dtype the weights, activations and K/V are stored in: `f32` or `bf16` (norms,
    /// attention scores, log-probs and sampling accumulate in f32 either way). Default: f32 on
    /// the CPU, bf16 on CUDA.
    #[arg(long)]
    dtype: Option<Precision>,
    /// Prefill attention on CUDA: `paged` (ours) or `flash` (candle-flash-attn; a build with
    /// the `flash-attn` feature and bf16 K/V).
    #[arg(long, default_value = "paged")]
    prefill_attention: stepppo::kv::PrefillAttention,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    source: PromptedModel,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Take the most likely token at each step.
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k"])]
    greedy: bool,
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 keeps every token.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object with prompt_ids, output_ids, output_text, logprobs.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct ScoreArgs {
    #[command(flatten)]
    source: PromptedModel,
    /// The continuation to score, token ids comma-separated: each one's log-prob after the
    /// prompt and the ids before it (teacher forcing, temperature 1, the rollout's decode path).
    #[arg(long, value_delimiter = ',', required = true)]
    ids: Vec<u32>,
    /// Print one JSON object with prompt_ids, ids, logprobs and their sum.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct MergeAdapterArgs {
    /// The base: `builtin` or an HF-format model directory.
    #[arg(long)]
    model: String,
    /// The PEFT LoRA adapter directory to fold into it.
    #[arg(long)]
    adapter: PathBuf,
    /// Directory to write the merged model into (HF layout: config.json, model.safetensors,
    /// tokenizer.json, the base's generation_config.json); transformers loads it without PEFT.
    #[arg(long)]
    out: PathBuf,
    /// Replace the contents of an existing, non-empty --out.
    #[arg(long)]
    overwrite: bool,
}

#[derive(Args, Debug)]
pub struct InitModelArgs {
    /// `tiny`, `small` or the path of an HF config.json.
    #[arg(long)]
    config: String,
    /// Directory to write config.json, model.safetensors and tokenizer.json into.
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn sampling_params(a: &GenerateArgs) -> anyhow::Result<SamplingParams> {
    if a.greedy {
        return Ok(SamplingParams::greedy());
    }
    if !(a.temperature.is_finite() && a.temperature > 0.0) {
        bail!("--temperature must be positive, got {}", a.temperature);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", a.top_p);
    }
    Ok(SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        greedy: false,
    })
}

/// The model (in its rollout dtype), its tokenizer, the prompt's ids and the device, with a
/// warning where the checkpoint's turns fall back to ChatML.
fn load_prompted(a: &PromptedModel) -> anyhow::Result<(Model, Tokenizer, Vec<u32>, Device)> {
    let device = stepppo::device::parse_device(&a.device)?;
    let (mut model, tok) = load_policy_with_adapter(&a.model, a.adapter.as_deref(), &device)
        .with_context(|| format!("loading model {}", a.model))?;
    if let Some(note) = chat_template_note(&a.model, &tok).filter(|_| a.prompt.is_some() && !a.raw)
    {
        eprintln!("warning: {note}");
    }
    if let Some(dtype) = a.dtype {
        model.set_rollout_precision(dtype).context("--dtype")?;
    }
    let prompt = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) if a.raw => tok.encode(text),
        (None, Some(text)) => ChatTemplate.user_turn(&tok, text)?,
        (None, None) => Vec::new(),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    Ok((model, tok, prompt, device))
}

/// A KV pool of `slots` in the model's rollout dtype, with the prefill kernel `a` names.
fn pool_for(
    model: &Model,
    a: &PromptedModel,
    slots: usize,
    device: &Device,
) -> anyhow::Result<KvPool> {
    let mut pool = KvPool::with_dtype(
        model.config(),
        slots,
        device,
        model.rollout_precision().dtype(),
    )?;
    pool.set_prefill_attention(a.prefill_attention)
        .context("--prefill-attention")?;
    Ok(pool)
}

pub fn score(a: ScoreArgs) -> anyhow::Result<()> {
    let (model, tok, prompt, device) = load_prompted(&a.source)?;
    let vocab = model.config().vocab_size;
    if let Some(bad) = a.ids.iter().find(|&&id| id as usize >= vocab) {
        bail!("--ids: token id {bad} is outside the model's vocabulary of {vocab}");
    }
    let mut pool = pool_for(&model, &a.source, prompt.len() + a.ids.len(), &device)?;
    let logprobs = forced_logprobs(&model, &mut pool, &prompt, &a.ids)?;
    let sum: f64 = logprobs.iter().map(|&l| f64::from(l)).sum();
    if a.json {
        let out = serde_json::json!({
            "prompt_ids": prompt, "ids": a.ids, "text": tok.decode(&a.ids), "logprobs": logprobs,
            "sum_logprob": sum,
        });
        println!("{out}");
    } else {
        for (id, logprob) in a.ids.iter().zip(&logprobs) {
            println!("{id}\t{logprob:.6}\t{:?}", tok.decode(&[*id]));
        }
        println!("sum\t{sum:.6}");
    }
    Ok(())
}

pub fn generate(a: GenerateArgs) -> anyhow::Result<()> {
    let params = sampling_params(&a)?;
    let (model, tok, prompt, _device) = load_prompted(&a.source)?;
    let engine_cfg = EngineConfig {
        cache_mode: CacheMode::None,
        num_slots: prompt.len() + a.max_new_tokens,
        prefill_attention: a.source.prefill_attention,
        ..EngineConfig::default()
    };
    let mut engine = Engine::for_model(&model, engine_cfg).context("--prefill-attention")?;
    let seed = stepppo::seed::derive(a.seed, &[0]);
    let mut request = GenRequest::plain(prompt.clone(), params, seed, a.max_new_tokens);
    request.stop_token_ids = vec![tok.eos_id()];
    let gen = engine.generate(&model, &tok, &[request])?.remove(0);
    let text = tok.decode(&gen.tokens);
    if a.json {
        let out = serde_json::json!({
            "prompt_ids": prompt, "output_ids": gen.tokens, "output_text": text, "logprobs": gen.logprobs,
        });
        println!("{out}");
    } else {
        println!("{text}");
    }
    Ok(())
}

pub fn merge_adapter(a: MergeAdapterArgs) -> anyhow::Result<()> {
    let report = merge_adapter_into(&a.model, &a.adapter, &a.out, a.overwrite)
        .with_context(|| format!("merging adapter {} into {}", a.adapter.display(), a.model))?;
    if let Some(named) = &report.other_base {
        eprintln!(
            "warning: {} names the base `{named}`, merged onto `{}` (same shapes): the result is \
             only what was trained if the two hold the same weights",
            a.adapter.display(),
            a.model
        );
    }
    let mut notes = Vec::new();
    if !report.tokenizer {
        notes.push("the base has no tokenizer.json, so neither has this");
    }
    if report.generation_config {
        notes.push("with the base's generation_config.json");
    }
    println!(
        "wrote {} ({} with the rank-{} adapter of {} folded in{})",
        a.out.display(),
        a.model,
        report.rank,
        a.adapter.display(),
        notes.iter().map(|n| format!("; {n}")).collect::<String>()
    );
    Ok(())
}

pub fn init_model(a: InitModelArgs) -> anyhow::Result<()> {
    let tok = Tokenizer::builtin();
    let cfg = match ModelConfig::named(&a.config, &tok) {
        Some(cfg) => cfg,
        None => ModelConfig::from_file(a.config.as_ref())?,
    };
    if cfg.vocab_size < tok.vocab_size() {
        bail!(
            "{}: key `vocab_size` is {} but the built-in tokenizer needs {}",
            a.config,
            cfg.vocab_size,
            tok.vocab_size()
        );
    }
    let model = Model::new(&cfg, a.seed, &Device::Cpu)?;
    model.save(&a.out, Some(&tok))?;
    let params: usize = Model::param_shapes(&cfg)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    println!("wrote {} ({params} parameters)", a.out.display());
    Ok(())
}
