#!/usr/bin/env python3
"""Hugging Face transformers `generate` on stepppo's multi-turn group workload (the baseline).

The workload is the one `stepppo bench prefix --spec NAME:groups,G,T,P,O,R` runs: `groups`
groups of G trajectories share a P-token prompt; each of T turns samples R tokens per
trajectory, then O observation tokens are appended. transformers keeps no KV across
`generate` calls, so every turn re-prefills the whole context (the stateless arm). Weights are
random, built from an HF config.json (default: Qwen2.5-0.5B's shape), in bf16 on the GPU or in
f32 on the CPU (`--device cpu --threads N`, as `RAYON_NUM_THREADS=N stepppo bench prefix` runs).

    python3 scripts/hf_rollout_bench.py --spec gpu_group:8,8,4,1024,64,64 --json [--caches dynamic,static]
    python3 scripts/hf_rollout_bench.py --device cpu --threads 2 --spec probe:1,1,1,512,1,32 --caches dynamic

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
    contexts = prompts.repeat_interleave(g, dim=0).to(model.device)
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
            obs = torch.randint(0, vocab, (contexts.shape[0], o), generator=gen).to(model.device)
            contexts = torch.cat([contexts, obs], dim=1)
    return generated


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/models/qwen2.5-0.5b.json")
    ap.add_argument("--spec", default="gpu_group:8,8,4,1024,64,64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", choices=["bf16", "f32"], help="default: bf16 on cuda, f32 on cpu")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads on the CPU")
    ap.add_argument("--caches", default="dynamic,static",
                    help="generate's cache_implementation arms, each timed after its own warm-up")
    a = ap.parse_args()
    name, groups, g, t, p, o, r = parse_spec(a.spec)
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.dtype or ("bf16" if a.device == "cuda" else "f32")]
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    torch.manual_seed(a.seed)
    cfg = Qwen2Config.from_json_file(a.config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(a.device).eval()
    for cache in a.caches.split(","):
        gen = torch.Generator().manual_seed(a.seed)
        with torch.inference_mode():
            rollout(model, 1, 2, 2, 64, 8, 8, cfg.vocab_size, gen, cache)  # warm-up
            sync()
            start = time.perf_counter()
            generated = rollout(model, groups, g, t, p, o, r, cfg.vocab_size, gen, cache)
            sync()
            wall = time.perf_counter() - start
        row = {
            "workload": name, "engine": "hf_transformers_generate", "device": a.device,
            "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(), "cache": cache, "groups": groups,
            "group_size": g, "turns": t, "prompt": p, "obs": o, "response": r, "generated_tokens": generated,
            "wall_s": wall, "tokens_per_s": generated / wall, "trajectories_per_s": groups * g / wall,
        }
        print(json.dumps(row) if a.json else row, flush=True)


if __name__ == "__main__":
    main()
