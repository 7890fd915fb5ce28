#!/usr/bin/env python3
"""Writes `bf16_generation.json` beside the tiny Qwen2, Qwen3 and Llama 3 checkpoints of
tests/fixtures/hf/: 64 tokens transformers samples from each model loaded in bf16 (cached
`generate`, sdpa attention, on the CPU), the log-prob transformers gives each sampled token in
bf16 (its bf16 logits widened to f32 before the log-softmax, as its samplers do) and in f32 (the
same tokens scored by the f32 model), so that `tests/model_hf_fixtures.rs` checks stepppo's bf16
generation against transformers' bf16 without Python, apart from the rounding both make.

Run from the repository root with torch and transformers (5.x) installed:
    python3 scripts/make_bf16_generation_fixtures.py
Re-creates the same files (fixed seeds).

    python3 scripts/make_bf16_generation_fixtures.py --device cuda --out DIR
does the same with transformers on the GPU, writing DIR/<model>/bf16_generation.json, which
`tests/cuda_generation.rs` reads (STEPPPO_TRANSFORMERS_GPU_FIXTURES=DIR) to hold stepppo's CUDA
bf16 generation against transformers' bf16 on the same GPU (scripts/gpu_check.sh does both).
stepppo's CUDA attention runs heads 32, 64 or 128 wide: a fixture with narrower heads (Qwen2's
and Llama 3's are 16) is sampled from a variant of its family with 32-wide heads instead, random
weights drawn as scripts/make_hf_fixtures.py draws them, saved as DIR/<model>/model for the test
to load.
"""

import argparse
import json
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from make_hf_fixtures import randomize

FIXTURES = Path("tests/fixtures/hf")
MODELS = ["qwen2", "qwen3", "llama3"]
NEW_TOKENS = 64
PROMPT = [3, 17, 42, 99, 7, 200, 5, 61]
CUDA_HEAD_DIMS = (32, 64, 128)


def cuda_model(name, out):
    """The fixture's directory where stepppo's CUDA attention runs its heads; else a variant of
    the family with 32-wide heads and fresh random weights, saved under OUT/<name>/model."""
    config = AutoConfig.from_pretrained(FIXTURES / name)
    width = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if width in CUDA_HEAD_DIMS:
        return FIXTURES / name
    config.head_dim = CUDA_HEAD_DIMS[0]
    torch.manual_seed(0)
    model = randomize(AutoModelForCausalLM.from_config(config), seed=7)
    directory = out / name / "model"
    model.save_pretrained(directory)
    return directory


def sample_bf16(directory, device):
    """Tokens sampled at temperature 1 (no top-k/top-p) from the bf16 model, with their log-probs."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.to(device).eval()
    torch.manual_seed(0)
    ids = torch.tensor([PROMPT], device=device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    tokens = out.sequences[0, len(PROMPT):].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), dim=-1)[tok].item()
        for step, tok in zip(out.logits, tokens)
    ]
    return tokens, logprobs


def score_f32(directory, tokens, device):
    """Log-probs the f32 model gives `tokens` after the prompt (one teacher-forced forward)."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.to(device).eval()
    full = torch.tensor([PROMPT + tokens], device=device)
    with torch.no_grad():
        logits = model(full).logits[0, len(PROMPT) - 1:-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i, tok].item() for i, tok in enumerate(tokens)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=FIXTURES, help="writes OUT/<model>/bf16_generation.json")
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # f32 scores exact, as stepppo's
    for name in MODELS:
        on_gpu = args.device.startswith("cuda")
        directory = cuda_model(name, args.out) if on_gpu else FIXTURES / name
        tokens, bf16 = sample_bf16(directory, args.device)
        f32 = score_f32(directory, tokens, args.device)
        gap = max(abs(a - b) for a, b in zip(bf16, f32))
        fixture = {
            "prompt": PROMPT,
            "tokens": tokens,
            "logprobs_bf16": bf16,
            "logprobs_f32": f32,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "device": args.device,
        }
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "bf16_generation.json").write_text(json.dumps(fixture, indent=1) + "\n")
        print(f"{name} ({args.device}): {len(tokens)} sampled tokens; transformers bf16 vs f32 max |d logprob| {gap:.3e}")


if __name__ == "__main__":
    main()
