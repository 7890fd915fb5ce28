#!/usr/bin/env python3
"""Hugging Face transformers `generate` on stepppo's multi-turn group workload (GPU baseline).

The workload is the one `stepppo bench prefix --spec NAME:groups,G,T,P,O,R` runs: `groups`
groups of G trajectories share a P-token prompt; each of T turns samples R tokens per
trajectory, then O observation tokens are appended. transformers keeps no KV across
`generate` calls, so every turn re-prefills the whole context (the stateless arm). Weights are
random, built from an HF config.json (default: Qwen2.5-0.5B's shape), in bf16 on the GPU.

    python3 scripts/hf_rollout_bench.py --spec gpu_group:8,8,4,1024,64,64 --json [--caches dynamic,static]

Each cache arm (generate's `cache_implementation`) prints its row as it finishes. The static
cache's warm-up is a smaller workload, so any compilation for the real shapes lands in its time.
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config


def parse_spec(spec):
    name, numbers = spec.split(":")
    groups, g, t, p, o, r = (int(x) for x in numbers.split(","))
    return name, groups, g, t, p, o, r


def rollout(model, groups, g, t, p, o, r, vocab, gen, cache):
    prompts = torch.randint(0, vocab, (groups, p), generator=gen)
    contexts = prompts.repeat_interleave(g, dim=0).cuda()
    generated = 0
    for turn in range(t):
        out = model.generate(
            input_ids=contexts,
            attention_mask=torch.ones_like(contexts),
            max_new_tokens=r,
            min_new_tokens=r,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=0,
            use_cache=True,
            cache_implementation=cache,
        )
        generated += (out.shape[1] - contexts.shape[1]) * out.shape[0]
        contexts = out
        if turn + 1 < t:
            obs = torch.randint(0, vocab, (contexts.shape[0], o), generator=gen).cuda()
            contexts = torch.cat([contexts, obs], dim=1)
    return generated


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/models/qwen2.5-0.5b.json")
    ap.add_argument("--spec", default="gpu_group:8,8,4,1024,64,64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--caches", default="dynamic,static",
                    help="generate's cache_implementation arms, each timed after its own warm-up")
    a = ap.parse_args()
    name, groups, g, t, p, o, r = parse_spec(a.spec)
    torch.manual_seed(a.seed)
    cfg = Qwen2Config.from_json_file(a.config)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    for cache in a.caches.split(","):
        gen = torch.Generator().manual_seed(a.seed)
        with torch.inference_mode():
            rollout(model, 1, 2, 2, 64, 8, 8, cfg.vocab_size, gen, cache)  # warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            generated = rollout(model, groups, g, t, p, o, r, cfg.vocab_size, gen, cache)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        row = {
            "workload": name, "engine": "hf_transformers_generate", "cache": cache, "groups": groups,
            "group_size": g, "turns": t, "prompt": p, "obs": o, "response": r, "generated_tokens": generated,
            "wall_s": wall, "tokens_per_s": generated / wall, "trajectories_per_s": groups * g / wall,
        }
        print(json.dumps(row) if a.json else row, flush=True)


if __name__ == "__main__":
    main()
