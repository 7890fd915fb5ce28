#!/usr/bin/env python3
"""Writes tests/fixtures/hf/: tiny random Qwen2, Qwen3 and Llama 3 checkpoints saved by Hugging Face
transformers, RoPE-scaling variants, bf16, f16 and sharded copies, a transformers-4-layout config, a
chat-template tokenizer, and what transformers computes for each (greedy tokens and their
log-probs, rendered chat ids), so the Rust tests compare against transformers without Python.

Run from the repository root with torch, transformers (5.x) and tokenizers installed:
    python3 scripts/make_hf_fixtures.py
Every run re-creates the same files (fixed seeds). The script also checks that each RoPE variant
changes the greedy result, so the tests really exercise the scaling.

    python3 scripts/make_hf_fixtures.py --check-export DIR FIXTURE
loads a directory written by `stepppo` export with transformers, fails on missing or unexpected
keys, and compares its greedy tokens/log-probs with FIXTURE's expected.json.
"""

import copy
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

OUT = Path("tests/fixtures/hf")
NEW_TOKENS = 64
PROMPT = [3, 17, 42, 99, 7, 200, 5, 61]
VOCAB = 256

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def randomize(model, seed, std=0.15):
    """Random weights everywhere (norms around 1, biases non-zero) so every tensor matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(std * noise)
    return model


def greedy(model):
    """Greedy tokens and their log-probs from transformers' cached generation."""
    model.eval()
    ids = torch.tensor([PROMPT])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
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
    return {"prompt": PROMPT, "tokens": tokens, "logprobs": logprobs,
            "transformers_version": transformers.__version__}


def write_expected(directory, expected):
    (directory / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def load_checked(directory, **kwargs):
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True, **kwargs)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, f"{directory}: {bad}"
    return model


def save(model, name, **kwargs):
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory, **kwargs)
    expected = greedy(load_checked(directory))
    write_expected(directory, expected)
    return directory, expected


def qwen2():
    cfg = transformers.Qwen2Config(**COMMON, max_position_embeddings=128, rope_theta=1e6,
                                   tie_word_embeddings=True)
    model = randomize(transformers.Qwen2ForCausalLM(cfg), 1)
    directory, expected = save(model, "qwen2")
    write_v4_layout(directory)
    return model, expected


def write_v4_layout(directory):
    """The same model as transformers 4.x wrote it: top-level rope_theta, rope_scaling null."""
    cfg = json.loads((directory / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    assert params["rope_type"] == "default", params
    cfg["rope_theta"] = params["rope_theta"]
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    cfg["transformers_version"] = "4.51.3"
    (directory / "config.v4.json").write_text(json.dumps(cfg, indent=2) + "\n")


def qwen3():
    cfg = transformers.Qwen3Config(**COMMON, head_dim=32, max_position_embeddings=128,
                                   rope_theta=1e6, tie_word_embeddings=True, attention_bias=False)
    save(randomize(transformers.Qwen3ForCausalLM(cfg), 2), "qwen3")


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def llama3():
    cfg = transformers.LlamaConfig(**COMMON, max_position_embeddings=128, rope_parameters=dict(LLAMA3_ROPE),
                                   tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    model = randomize(transformers.LlamaForCausalLM(cfg), 3)
    directory, expected = save(model, "llama3")
    plain = dict(LLAMA3_ROPE, rope_type="default")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        plain.pop(key)
    assert_changes(directory, expected, plain, "llama3")
    # The transformers 4 layout of the same config.
    cfg = json.loads((directory / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (directory / "config.v4.json").write_text(json.dumps(cfg, indent=2) + "\n")


def attention_bias():
    """`attention_bias: true` (q/k/v/o biases) in the two families that read it; smaller models."""
    small = dict(COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    cfg = transformers.LlamaConfig(**small, max_position_embeddings=128, attention_bias=True)
    save(randomize(transformers.LlamaForCausalLM(cfg), 4), "llama-attention-bias")
    cfg = transformers.Qwen3Config(**small, head_dim=16, max_position_embeddings=128, attention_bias=True,
                                   tie_word_embeddings=True)
    save(randomize(transformers.Qwen3ForCausalLM(cfg), 5), "qwen3-attention-bias")


def variant_model(base_dir, rope_parameters, max_position_embeddings=None):
    cfg = json.loads((base_dir / "config.json").read_text())
    cfg["rope_parameters"] = rope_parameters
    if max_position_embeddings is not None:
        cfg["max_position_embeddings"] = max_position_embeddings
    config = transformers.AutoConfig.for_model(**cfg)
    return load_checked(base_dir, config=config), cfg


def assert_changes(base_dir, expected, rope_parameters, name, max_position_embeddings=None):
    """Fails unless the model under `rope_parameters` generates something else than `expected`."""
    model, _ = variant_model(base_dir, rope_parameters, max_position_embeddings)
    other = greedy(model)
    diff = max(abs(a - b) for a, b in zip(other["logprobs"], expected["logprobs"]))
    assert other["tokens"] != expected["tokens"] and diff > 1e-2, f"{name}: RoPE change has no effect ({diff})"


def rope_variants(base_expected):
    """Configs (weights are the qwen2 fixture's) whose RoPE scaling changes the greedy tokens."""
    base_dir = OUT / "qwen2"
    variants = {
        "rope-linear": ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, None),
        "rope-dynamic": ({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}, 32),
        "rope-yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                       "rope_theta": 1e6}, 64),
    }
    for name, (params, max_pos) in variants.items():
        model, cfg = variant_model(base_dir, params, max_pos)
        expected = greedy(model)
        diff = max(abs(a - b) for a, b in zip(expected["logprobs"], base_expected["logprobs"]))
        assert expected["tokens"] != base_expected["tokens"] and diff > 1e-2, f"{name}: no effect ({diff})"
        directory = OUT / name
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        write_expected(directory, expected)


def half_and_sharded(model, expected):
    save(copy.deepcopy(model).to(torch.bfloat16), "qwen2-bf16")
    save(copy.deepcopy(model).to(torch.float16), "qwen2-f16")
    directory, sharded = save(model, "qwen2-sharded", max_shard_size="100KB")
    assert (directory / "model.safetensors.index.json").exists(), "not sharded"
    assert sharded == expected, "sharding changed the outputs"


CHAT_TEMPLATE_QWEN = (
    "{%- for message in messages %}"
    "{%- if loop.first and message.role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set content = message.content | trim if message.role == 'assistant' else message.content %}"
    "{%- if message.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content.strip() + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "You are solving the FrozenLake puzzle."},
    {"role": "user", "content": "Turn 1:\nState:\nP_O_\n__G_\nYou have 10 actions left."},
    {"role": "assistant", "content": "<think>go right</think><answer>Right</answer>"},
    {"role": "user", "content": "  Turn 2: you moved right.  "},
]


def chat_fixture():
    """A tiny byte-level BPE tokenizer with Qwen's special tokens and a chat template that uses
    Python string methods, plus what apply_chat_template renders for a conversation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB + 64, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [m["content"] for m in CONVERSATION] + ["system user assistant helpful"] * 4
    tok.train_from_iterator(corpus, trainer)
    directory = OUT / "chat"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE_QWEN,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf = AutoTokenizer.from_pretrained(directory)
    cases = []
    for n in range(2, len(CONVERSATION) + 1):
        for gen_prompt in (True, False):
            ids = hf.apply_chat_template(CONVERSATION[:n], add_generation_prompt=gen_prompt, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            text = hf.apply_chat_template(CONVERSATION[:n], add_generation_prompt=gen_prompt, tokenize=False)
            cases.append({"messages": CONVERSATION[:n], "add_generation_prompt": gen_prompt,
                          "text": text, "ids": list(ids)})
    (directory / "expected.json").write_text(json.dumps({"cases": cases}, indent=1) + "\n")


def check_export(directory, fixture):
    expected = json.loads((Path(fixture) / "expected.json").read_text())
    got = greedy(load_checked(directory))
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], expected["logprobs"]))
    assert got["tokens"] == expected["tokens"], "greedy tokens differ"
    print(f"{directory}: loads with no missing/unexpected keys; {len(got['tokens'])} tokens match; "
          f"max |d logprob| = {diff:.2e}")
    assert diff <= 1e-4


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--check-export":
        check_export(sys.argv[2], sys.argv[3])
        return
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    model, expected = qwen2()
    rope_variants(expected)
    half_and_sharded(model, expected)
    qwen3()
    llama3()
    attention_bias()
    chat_fixture()
    for d in sorted(OUT.iterdir()):
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{d}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
