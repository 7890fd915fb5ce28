//! `stepppo generate`, `stepppo init-model`, `stepppo merge-adapter`.

use std::path::PathBuf;

use anyhow::{bail, Context};
use candle_core::Device;
use clap::Args;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use stepppo::kv::KvPool;
use stepppo::model::checkpoint::{
    chat_template_note, load_policy_with_adapter, merge_adapter as merge_adapter_into,
};
use stepppo::model::{Model, ModelConfig, Precision};
use stepppo::rollout::generate as generate_tokens;
use stepppo::rollout::sampling::SamplingParams;
use stepppo::tokenizer::{ChatTemplate, Tokenizer};

#[derive(Args, Debug)]
pub struct GenerateArgs {
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
    /// Encode --prompt as-is instead of as a chat user turn.
    #[arg(long)]
    raw: bool,
    /// Print one JSON object with prompt_ids, output_ids, output_text, logprobs.
    #[arg(long)]
    json: bool,
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

fn prompt_ids(a: &GenerateArgs, tok: &Tokenizer) -> anyhow::Result<Vec<u32>> {
    Ok(match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) if a.raw => tok.encode(text),
        (None, Some(text)) => ChatTemplate.user_turn(tok, text)?,
        (None, None) => Vec::new(),
    })
}

pub fn generate(a: GenerateArgs) -> anyhow::Result<()> {
    let params = sampling_params(&a)?;
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
    let prompt = prompt_ids(&a, &tok)?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let mut pool = KvPool::with_dtype(
        model.config(),
        prompt.len() + a.max_new_tokens,
        &device,
        model.rollout_precision().dtype(),
    )?;
    pool.set_prefill_attention(a.prefill_attention)
        .context("--prefill-attention")?;
    let mut rngs = [ChaCha8Rng::seed_from_u64(stepppo::seed::derive(
        a.seed,
        &[0],
    ))];
    let gen = generate_tokens(
        &model,
        &mut pool,
        std::slice::from_ref(&prompt),
        a.max_new_tokens,
        &params,
        &mut rngs,
        Some(tok.eos_id()),
    )?
    .remove(0);
    let text = tok.decode(&gen.output_ids);
    if a.json {
        let out = serde_json::json!({
            "prompt_ids": prompt, "output_ids": gen.output_ids, "output_text": text, "logprobs": gen.logprobs,
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
