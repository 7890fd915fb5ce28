#!/usr/bin/env python3
"""PyTorch's decode attention on the shapes `stepppo bench kernels` measures, for the figure beside
ours: one query token per sequence and head over a contiguous bf16 K/V cache, through
`torch.nn.functional.scaled_dot_product_attention` (GQA by `enable_gqa`, the backend PyTorch picks),
timed with CUDA events after a warm-up; bandwidth counts every K and V byte once, as ours does,
beside a device copy of the same size. Prints one JSON object per shape as it finishes.

    python3 scripts/torch_decode_bench.py [--shapes 64x4096,8x32768] [--head-dims 64,128]
"""

import argparse
import json

import torch
import torch.nn.functional as F


def timed(fn, iters):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="64x4096,8x32768")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--q-heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    dev = torch.device("cuda")
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        for hd in (int(x) for x in args.head_dims.split(",")):
            q = torch.randn(batch, args.q_heads, 1, hd, device=dev, dtype=torch.bfloat16)
            k = torch.randn(batch, args.kv_heads, context, hd, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            attend = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            seconds = timed(attend, args.iters)
            kv_bytes = 2 * k.numel() * k.element_size()
            src = torch.empty(2 * k.numel(), device=dev, dtype=torch.bfloat16)
            copy_s = timed(lambda: src.clone(), args.iters)
            gbs, copy_gbs = kv_bytes / seconds / 1e9, 2 * kv_bytes / copy_s / 1e9
            print(json.dumps({
                "impl": "torch_sdpa", "torch": torch.__version__, "batch": batch, "context": context,
                "q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": hd, "dtype": "bf16",
                "decode_ms": seconds * 1e3, "decode_gb_s": gbs, "copy_gb_s": copy_gbs,
                "fraction_of_copy": gbs / copy_gbs,
            }), flush=True)
            del q, k, v, src
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
