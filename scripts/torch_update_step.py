#!/usr/bin/env python3
"""PyTorch's side of `cargo bench --bench training`: the actor update step of stepppo in PyTorch.

    python3 scripts/torch_update_step.py MODEL_DIR THREADS

MODEL_DIR is an HF directory the bench wrote (config.json, model.safetensors) holding the
bench's `inputs.json`. Loads it as transformers' `Qwen2ForCausalLM` (SDPA attention, f32) and
times the step stepppo's bench times: trunk forward, the LM head at the response positions only,
log-softmax, the targets' log-probs and the entropies, the PPO loss (token ratio, asymmetric
clip, the mean over each row's tokens then over rows, minus the entropy coefficient times the
same mean of the entropies), backward, gradient clipping and `torch.optim.AdamW`. One warm-up
step, then `runs` timed steps, then the best rate of the bench's probe product; prints
`RESULT {"first_loss": ..., "median_ms": ..., "product_gflops": ...}`.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

LOG_RATIO_BOUND = 20.0


def main():
    model_dir, threads = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(threads)
    x = json.loads((model_dir / "inputs.json").read_text())
    model = Qwen2ForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", dtype=torch.float32
    )
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=x["lr"],
        betas=tuple(x["betas"]),
        eps=x["eps"],
        weight_decay=x["weight_decay"],
    )
    tensors = {
        "input_ids": torch.tensor(x["input_ids"], dtype=torch.long),
        "positions": torch.tensor(x["positions"], dtype=torch.long),
        "targets": torch.tensor(x["targets"], dtype=torch.long),
        "old": torch.tensor(x["old_logprobs"], dtype=torch.float32),
        "adv": torch.tensor(x["advantages"], dtype=torch.float32),
    }
    first_loss = step(model, opt, tensors, x)
    times = []
    for _ in range(x["runs"]):
        start = time.perf_counter()
        step(model, opt, tensors, x)
        times.append((time.perf_counter() - start) * 1e3)
    report = {
        "first_loss": first_loss,
        "median_ms": statistics.median(times),
        "product_gflops": probe_gflops(*x["probe"]),
    }
    print("RESULT " + json.dumps(report))


def probe_gflops(m, k, n, runs=5):
    """The best GFLOP/s of `runs` products [m, k] x [k, n] (the bench's limit probe)."""
    a, b = torch.rand(m, k) * 2 - 1, torch.rand(k, n) * 2 - 1
    a @ b
    best = 0.0
    for _ in range(runs):
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * m * k * n / (time.perf_counter() - start) / 1e9)
    return best


def step(model, opt, t, x):
    """One update; returns its loss."""
    ids = t["input_ids"]
    hidden = model.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    picked = hidden.reshape(-1, hidden.shape[-1])[t["positions"]]
    logp_all = torch.log_softmax(model.lm_head(picked), dim=-1)
    logp = logp_all.gather(-1, t["targets"].unsqueeze(-1)).squeeze(-1).reshape(t["old"].shape)
    entropy = -(logp_all.exp() * logp_all).sum(-1).reshape(t["old"].shape)
    log_ratio = (logp - t["old"]).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = log_ratio.exp()
    adv = t["adv"]
    clipped = (ratio.clamp(1 - x["clip_low"], 1 + x["clip_high"]))
    token_loss = torch.maximum(-adv * ratio, -adv * clipped)
    loss = token_loss.mean(-1).mean() - x["entropy_coef"] * entropy.mean(-1).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), x["max_grad_norm"])
    opt.step()
    return loss.item()


if __name__ == "__main__":
    main()
