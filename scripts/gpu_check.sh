#!/usr/bin/env bash
# Runs the CUDA checks on a GPU machine from the repository root, with the `.gpu` bundle made by
# scripts/build_gpu_bundle.sh (no Rust toolchain needed there). Writes every result into
# ${OUT:-gpu-results}: the GPU tests, the decode kernel's bandwidth against a device copy,
# stepppo's rollout throughput with the radix cache vs without it, and Hugging Face
# transformers `generate` on the same workload (Qwen2.5-0.5B shape, random bf16 weights).
set -uo pipefail
out=${OUT:-gpu-results}
mkdir -p "$out" /tmp/stepppo-gpu
for f in .gpu/*.xz; do xz -dc "$f" > "/tmp/stepppo-gpu/$(basename "$f" .xz)"; done
chmod +x /tmp/stepppo-gpu/*
libs=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bin=/tmp/stepppo-gpu/stepppo
spec=${SPEC:-gpu_group:8,8,4,1024,64,64}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
for t in /tmp/stepppo-gpu/cuda_*; do
  "$t" --nocapture 2>&1 | tee "$out/test-$(basename "$t").log"
done
if command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck /tmp/stepppo-gpu/cuda_kernels 2>&1 | tail -n 20 | tee "$out/memcheck.log"
fi
"$bin" bench kernels --device cuda --json | tee "$out/kernels.jsonl"
"$bin" bench kernels --device cuda --batch 8 --context 32768 --json | tee -a "$out/kernels.jsonl"
"$bin" bench prefix --device cuda --model configs/models/qwen2.5-0.5b.json --spec "$spec" --json | tee "$out/prefix.jsonl"
python3 scripts/hf_rollout_bench.py --spec "$spec" --json | tee "$out/hf.jsonl"
