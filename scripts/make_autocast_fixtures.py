#!/usr/bin/env python3
"""Writes `autocast.json` beside the tiny Qwen2 and Qwen3 checkpoints of tests/fixtures/hf/: what
PyTorch computes for one policy-gradient update on a fixed batch, in f32 and under
`torch.autocast("cpu", dtype=torch.bfloat16)` from the same f32 weights, so that
`tests/model_precision.rs` checks stepppo's `precision: bf16` against PyTorch's mixed precision
without Python.

The loss is the first PPO update's surrogate at ratio 1 — `mean(-adv · logp) - 0.01 ·
mean(entropy)` over the scored positions — whose gradient is the first update's. Log-probs,
entropies and the loss are f32 in both (autocast's logits are bf16, widened before the
log-softmax, as transformers does). The gradient norm is over every parameter (f32 gradients of
the f32 weights in both).

Run from the repository root with torch and transformers (5.x) installed:
    python3 scripts/make_autocast_fixtures.py
Re-creates the same files (fixed inputs).
"""

import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

FIXTURES = Path("tests/fixtures/hf")
LENGTHS = [24, 17]  # the second row right-padded
SCORED = 12  # the last tokens of each row's real part are scored
ENTROPY_COEF = 0.01


def batch():
    """Token ids, mask, scored flat positions, their targets and advantages (fixed)."""
    width = max(LENGTHS)
    ids, mask, positions, targets, adv = [], [], [], [], []
    for b, n in enumerate(LENGTHS):
        row = [(b * 7919 + t * 104729 + 13) % 253 + 3 for t in range(n)]
        ids.append(row + [0] * (width - n))
        mask.append([1] * n + [0] * (width - n))
        for t in range(n - SCORED - 1, n - 1):
            positions.append(b * width + t)
            targets.append(row[t + 1])
            adv.append(1.0 if (t + b) % 3 == 0 else -0.5)
    return ids, mask, positions, targets, adv


def update(model, inputs, autocast):
    ids, mask, positions, targets, adv = inputs
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        picked = hidden.reshape(-1, hidden.shape[-1])[positions]
        logits = model.lm_head(picked)
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    loss = (-adv * logp).mean() - ENTROPY_COEF * entropy.mean()
    loss.backward()
    grad_norm = math.sqrt(
        sum(float((p.grad.float() ** 2).sum()) for p in model.parameters() if p.grad is not None)
    )
    return {
        "loss": loss.item(),
        "grad_norm": grad_norm,
        "logp": [float(x) for x in logp.detach()],
        "entropy": [float(x) for x in entropy.detach()],
    }


def main():
    ids, mask, positions, targets, adv = batch()
    inputs = (
        torch.tensor(ids),
        torch.tensor(mask),
        torch.tensor(positions),
        torch.tensor(targets),
        torch.tensor(adv),
    )
    for name in ["qwen2", "qwen3"]:
        directory = FIXTURES / name
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="sdpa"
        )
        model.eval()
        out = {
            "input_ids": ids,
            "attention_mask": mask,
            "positions": positions,
            "targets": targets,
            "advantages": adv,
            "entropy_coef": ENTROPY_COEF,
            "f32": update(model, inputs, autocast=False),
            "bf16_autocast": update(model, inputs, autocast=True),
            "torch": torch.__version__,
        }
        (directory / "autocast.json").write_text(json.dumps(out, indent=1) + "\n")
        f, b = out["f32"], out["bf16_autocast"]
        print(
            f"{name}: loss f32 {f['loss']:.6f} bf16 {b['loss']:.6f}; "
            f"grad norm f32 {f['grad_norm']:.6f} bf16 {b['grad_norm']:.6f}"
        )


if __name__ == "__main__":
    main()
