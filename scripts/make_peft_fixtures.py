#!/usr/bin/env python3
"""Writes tests/fixtures/peft/: small LoRA adapters made and saved by Hugging Face PEFT on the tiny
base models of tests/fixtures/hf/ (written by scripts/make_hf_fixtures.py), and what the adapted
model computes, so the Rust tests load real PEFT adapters and compare against PEFT without Python.

    qwen2-all/   base tests/fixtures/hf/qwen2,  r=4, lora_alpha=8,  all seven projections
    qwen3-qv/    base tests/fixtures/hf/qwen3,  r=2, lora_alpha=3,  q_proj, v_proj
    llama3-mlp/  base tests/fixtures/hf/llama3, r=8, lora_alpha=16, gate_proj, up_proj, down_proj

Each holds adapter_config.json and adapter_model.safetensors exactly as `save_pretrained` writes
them (base_model_name_or_path is the repo-relative base directory; the generic model card
README.md that PEFT also writes is dropped; the script re-runs itself under PYTHONHASHSEED=0
because PEFT saves target_modules, a set, in hash order), with every lora_A and lora_B
randomised (fixed seeds, std 0.2: PEFT's default zero B would make the adapter a no-op), and
expected.json: "prompt", "tokens" (64 greedy new tokens of the adapted model in float32, from
generate), "logprobs" (each greedy token's log-prob from a teacher-forced forward over
prompt + tokens), "base_tokens" (the base model's greedy tokens; the script asserts they differ)
and "merged_logprobs_max_abs_diff" (adapted vs merge_and_unload() teacher-forced log-probs).

Run from the repository root in the venv it was made with (outside the repo):
    python3 -m venv /work/venv-peft
    /work/venv-peft/bin/pip install torch transformers==5.24.0 peft==0.21.2
    /work/venv-peft/bin/python scripts/make_peft_fixtures.py
Made with torch 2.15.0, transformers 5.24.0, peft 0.21.2, safetensors 0.8.0. Every run re-creates
the same files (fixed seeds).

Check modes, for engineers and scripts (not run by cargo test):

    python3 scripts/make_peft_fixtures.py --check-adapter BASE_DIR ADAPTER_DIR LOGPROBS_JSON
loads BASE_DIR (float32) and ADAPTER_DIR with peft.PeftModel.from_pretrained, fails on any missing
or unexpected adapter key (PEFT itself only warns on missing keys and drops unexpected ones), and
compares LOGPROBS_JSON = {"tokens": [prompt and completion ids], "prompt_len": N,
"logprobs": [log-prob of tokens[N:] each]} with PEFT's teacher-forced log-probs (max |d| <= 1e-4).

    python3 scripts/make_peft_fixtures.py --check-merged MERGED_DIR FIXTURE_DIR
loads a full model directory (config.json + model.safetensors, e.g. from stepppo's merge) with
transformers, fails on missing/unexpected/mismatched keys, and checks its greedy tokens equal
FIXTURE_DIR/expected.json "tokens" and its teacher-forced log-probs are within 1e-4 of "logprobs".
"""

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors import safe_open
from transformers import AutoModelForCausalLM

OUT = Path("tests/fixtures/peft")
HF = Path("tests/fixtures/hf")
NEW_TOKENS = 64
PROMPT = [3, 17, 42, 99, 7, 200, 5, 61]
TOLERANCE = 1e-4

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FIXTURES = {
    # name: (base directory, LoraConfig arguments, seed for the lora weights)
    "qwen2-all": (HF / "qwen2", dict(r=4, lora_alpha=8, target_modules=ALL_PROJ), 11),
    "qwen3-qv": (HF / "qwen3", dict(r=2, lora_alpha=3, target_modules=["q_proj", "v_proj"]), 12),
    "llama3-mlp": (HF / "llama3", dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]), 13),
}


def randomize_lora(model, seed, std=0.2):
    """Non-zero random values in every lora_A and lora_B (PEFT starts B at zero, a no-op adapter)."""
    gen = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(std * torch.randn(p.shape, generator=gen))
                count += 1
    assert count > 0, "no LoRA parameters"
    return model


def load_base(directory):
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, f"{directory}: {bad}"
    return model.eval()


def load_adapter(base, adapter_dir):
    """PeftModel.from_pretrained, failing on missing or unexpected adapter keys: PEFT only warns
    on missing ones and loads with strict=False, which drops unexpected ones silently."""
    adapter_dir = Path(adapter_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, adapter_dir)
    for w in caught:
        assert "missing adapter keys" not in str(w.message), f"{adapter_dir}: {w.message}"
    with safe_open(adapter_dir / "adapter_model.safetensors", "pt") as f:
        file_keys = set(f.keys())
    model_keys = set(get_peft_model_state_dict(model).keys())
    missing, unexpected = sorted(model_keys - file_keys), sorted(file_keys - model_keys)
    assert not missing and not unexpected, f"{adapter_dir}: missing {missing}, unexpected {unexpected}"
    return model.eval()


def generate(model):
    """Greedy new tokens from transformers' cached generation."""
    ids = torch.tensor([PROMPT])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(PROMPT):].tolist()


@torch.no_grad()
def teacher_forced(model, tokens, prompt_len):
    """log p(tokens[i] | tokens[:i]) for i in prompt_len.., from one full forward (no cache)."""
    ids = torch.tensor([tokens])
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    targets = ids[0, 1:]
    picked = logp.gather(1, targets[:, None])[:, 0]
    return picked[prompt_len - 1:].tolist(), logp.argmax(-1)[prompt_len - 1:].tolist()


def max_diff(a, b):
    assert len(a) == len(b), f"lengths differ: {len(a)} vs {len(b)}"
    return max(abs(x - y) for x, y in zip(a, b))


def make(name, base_dir, lora_args, seed):
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    config = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **lora_args)
    model = randomize_lora(get_peft_model(load_base(base_dir), config), seed)
    model.peft_config["default"].base_model_name_or_path = str(base_dir)
    model.save_pretrained(directory)
    (directory / "README.md").unlink()  # PEFT's generic model card, 5 KiB of boilerplate
    saved = json.loads((directory / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(base_dir), saved["base_model_name_or_path"]

    # Everything below comes from the saved files, reloaded as a user would.
    base_tokens = generate(load_base(base_dir))
    adapted = load_adapter(load_base(base_dir), directory)
    tokens = generate(adapted)
    logprobs, argmax = teacher_forced(adapted, PROMPT + tokens, len(PROMPT))
    assert argmax == tokens, f"{name}: teacher-forced argmax differs from generate"
    assert tokens != base_tokens, f"{name}: the adapter does not change the greedy tokens"
    merged = adapted.merge_and_unload()
    merged_logprobs, _ = teacher_forced(merged, PROMPT + tokens, len(PROMPT))
    merged_diff = max_diff(logprobs, merged_logprobs)
    assert merged_diff <= TOLERANCE, f"{name}: merged differs by {merged_diff}"
    expected = {"prompt": PROMPT, "tokens": tokens, "logprobs": logprobs, "base_tokens": base_tokens,
                "merged_logprobs_max_abs_diff": merged_diff,
                "torch_version": torch.__version__.split("+")[0],
                "transformers_version": transformers.__version__, "peft_version": peft.__version__}
    (directory / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    same = sum(a == b for a, b in zip(tokens, base_tokens))
    print(f"{directory}: {same}/{NEW_TOKENS} greedy tokens equal the base's; "
          f"merged max |d logprob| = {merged_diff:.2e}")
    return directory


def print_tensors(directory):
    with safe_open(directory / "adapter_model.safetensors", "pt") as f:
        for key in f.keys():
            t = f.get_slice(key)
            print(f"  {key} {t.get_shape()} {t.get_dtype()}")


def check_adapter(base_dir, adapter_dir, logprobs_json):
    data = json.loads(Path(logprobs_json).read_text())
    tokens, prompt_len, want = data["tokens"], data["prompt_len"], data["logprobs"]
    assert 0 < prompt_len < len(tokens), f"prompt_len {prompt_len} of {len(tokens)} tokens"
    assert len(want) == len(tokens) - prompt_len, f"{len(want)} logprobs for {len(tokens) - prompt_len} tokens"
    model = load_adapter(load_base(base_dir), adapter_dir)
    got, _ = teacher_forced(model, tokens, prompt_len)
    diff = max_diff(got, want)
    print(f"{adapter_dir} on {base_dir}: loads with no missing/unexpected adapter keys; "
          f"{len(want)} logprobs; max |d logprob| = {diff:.2e}")
    assert diff <= TOLERANCE, f"max |d logprob| {diff} > {TOLERANCE}"


def check_merged(merged_dir, fixture_dir):
    expected = json.loads((Path(fixture_dir) / "expected.json").read_text())
    model = load_base(merged_dir)
    tokens = generate(model)
    same = sum(a == b for a, b in zip(tokens, expected["tokens"]))
    logprobs, _ = teacher_forced(model, expected["prompt"] + expected["tokens"], len(expected["prompt"]))
    diff = max_diff(logprobs, expected["logprobs"])
    print(f"{merged_dir}: loads with no missing/unexpected keys; {same}/{len(tokens)} greedy tokens match; "
          f"max |d logprob| = {diff:.2e}")
    assert tokens == expected["tokens"], "greedy tokens differ"
    assert diff <= TOLERANCE, f"max |d logprob| {diff} > {TOLERANCE}"


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--check-adapter":
        check_adapter(*sys.argv[2:])
        return
    if len(sys.argv) == 4 and sys.argv[1] == "--check-merged":
        check_merged(*sys.argv[2:])
        return
    if len(sys.argv) != 1:
        sys.exit(__doc__)
    if os.environ.get("PYTHONHASHSEED") != "0":
        # PEFT keeps target_modules as a set and saves it in iteration order, which follows
        # Python's per-process string hashing: fix it so every run writes the same config.
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, PYTHONHASHSEED="0"))
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (base_dir, lora_args, seed) in FIXTURES.items():
        directory = make(name, base_dir, lora_args, seed)
        if name == "qwen2-all":
            print_tensors(directory)
    for d in sorted(OUT.iterdir()):
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
