#!/usr/bin/env python3
"""PyTorch's side of `cargo bench --bench training`: the actor update step of stepppo in PyTorch.

    python3 scripts/torch_update_step.py MODEL_DIR THREADS [--device cpu|cuda] [--arm ARM]

MODEL_DIR is an HF directory the bench wrote (config.json, model.safetensors) holding the
bench's `inputs.json`. Loads it as transformers' `Qwen2ForCausalLM` (SDPA attention, f32 weights)
on the device and times the step stepppo's bench times: trunk forward, the LM head at the
response positions only, log-softmax, the targets' log-probs and the entropies, the PPO loss
(token ratio, asymmetric clip, the mean over each row's tokens then over rows, minus the entropy
coefficient times the same mean of the entropies), backward, gradient clipping and
`torch.optim.AdamW` over the trained parameters. ARM (default `full`) is `full` or `lora`, then
any of `+bf16` (the forward and loss under `torch.autocast` bf16, f32 master weights) and `+ckpt`
(transformers' gradient checkpointing); `lora` freezes the weights and trains rank-16 adapters
(alpha 32, A as PEFT draws it, B zero) on all seven projections. One warm-up step, then `runs`
timed steps and their peak memory (`torch.cuda.max_memory_allocated` on a GPU, the peak resident
set on the CPU), then the best rate of the bench's probe product in the arm's dtype; prints
`RESULT {"first_loss": ..., "median_ms": ..., "peak_mib": ..., "product_gflops": ...}`.
"""

import argparse
import contextlib
import json
import math
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

LOG_RATIO_BOUND = 20.0
LORA_RANK, LORA_ALPHA = 16, 32.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraLinear(torch.nn.Module):
    """A frozen linear layer plus a trained low-rank update, as PEFT's `lora.Linear` computes it."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        dev = base.weight.device
        self.lora_A = torch.nn.Parameter(torch.empty(LORA_RANK, base.in_features, device=dev))
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, LORA_RANK, device=dev))
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale = LORA_ALPHA / LORA_RANK

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale


def add_adapters(model):
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                if hasattr(parent, name):
                    setattr(parent, name, LoraLinear(getattr(parent, name)))


def peak_mib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    status = Path("/proc/self/status").read_text()
    line = next(l for l in status.splitlines() if l.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    cli = argparse.ArgumentParser()
    cli.add_argument("model_dir", type=Path)
    cli.add_argument("threads", type=int)
    cli.add_argument("--device", default="cpu")
    cli.add_argument("--arm", default="full")
    a = cli.parse_args()
    base, *flags = a.arm.split("+")
    if base not in ("full", "lora") or not set(flags) <= {"bf16", "ckpt"}:
        raise SystemExit(f"--arm {a.arm!r}: full or lora, then any of +bf16 and +ckpt")
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    x = json.loads((a.model_dir / "inputs.json").read_text())
    model = Qwen2ForCausalLM.from_pretrained(
        a.model_dir, attn_implementation="sdpa", dtype=torch.float32
    ).to(device)
    if "ckpt" in flags:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if base == "lora":
        add_adapters(model)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        trained,
        lr=x["lr"],
        betas=tuple(x["betas"]),
        eps=x["eps"],
        weight_decay=x["weight_decay"],
    )
    tensors = {
        "input_ids": torch.tensor(x["input_ids"], dtype=torch.long, device=device),
        "positions": torch.tensor(x["positions"], dtype=torch.long, device=device),
        "targets": torch.tensor(x["targets"], dtype=torch.long, device=device),
        "old": torch.tensor(x["old_logprobs"], dtype=torch.float32, device=device),
        "adv": torch.tensor(x["advantages"], dtype=torch.float32, device=device),
    }
    dtype = torch.bfloat16 if "bf16" in flags else torch.float32
    autocast = lambda: torch.autocast(device.type, dtype=dtype, enabled="bf16" in flags)
    first_loss = step(model, opt, trained, tensors, x, autocast)
    reset_peak(device)
    times = []
    for _ in range(x["runs"]):
        synchronize(device)
        start = time.perf_counter()
        step(model, opt, trained, tensors, x, autocast)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    report = {
        "first_loss": first_loss,
        "median_ms": statistics.median(times),
        "peak_mib": peak_mib(device),
        "product_gflops": probe_gflops(*x["probe"], device=device, dtype=dtype),
    }
    print("RESULT " + json.dumps(report))


def probe_gflops(m, k, n, runs=5, device=torch.device("cpu"), dtype=torch.float32):
    """The best GFLOP/s of `runs` products [m, k] x [k, n] (the bench's limit probe)."""
    a = (torch.rand(m, k, device=device) * 2 - 1).to(dtype)
    b = (torch.rand(k, n, device=device) * 2 - 1).to(dtype)
    a @ b
    synchronize(device)
    best = 0.0
    for _ in range(runs):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = max(best, 2 * m * k * n / (time.perf_counter() - start) / 1e9)
    return best


def step(model, opt, trained, t, x, autocast):
    """One update; returns its loss."""
    ids = t["input_ids"]
    with autocast():
        out = model.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        hidden = out.last_hidden_state
        picked = hidden.reshape(-1, hidden.shape[-1])[t["positions"]]
        logp_all = torch.log_softmax(model.lm_head(picked).float(), dim=-1)
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
    torch.nn.utils.clip_grad_norm_(trained, x["max_grad_norm"])
    opt.step()
    return loss.item()


if __name__ == "__main__":
    main()
