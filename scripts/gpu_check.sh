#!/usr/bin/env bash
# Runs the CUDA checks on a GPU machine from the repository root, with the `.gpu` bundle made by
# scripts/build_gpu_bundle.sh (no Rust toolchain needed there), within BUDGET_S seconds (default
# 470: under 8 minutes), every part under its own timeout and the budget left, its figures
# printed as they come (a part cut short still leaves them), the logs kept in /tmp/gpu-check and
# packed at the end into ${OUT:-gpu-results}/gpu-check.tgz, the one file it writes there (a device
# call brings back few files). In order of what matters most:
#   - transformers samples the tiny fixtures in bf16 on the GPU (its log-probs for the test);
#   - the GPU tests: our kernels against reference attention (bf16 and f32 pools), generation on
#     CUDA against the CPU in f32 and in bf16, and against transformers' bf16 on the same GPU;
#   - decode attention's bandwidth (Qwen2.5-0.5B's heads, head_dim 64 and 128, batch 64 x 4,096
#     and 8 x 32,768 tokens of context) against a device copy, and PyTorch's SDPA on the same
#     shapes; decode tokens/s of G 16 sharing a 4,096-token prompt with cascade attention and
#     without (the paged decode kernel alone);
#   - prefill attention, our paged kernel next to candle-flash-attn (a bundle built with
#     `flash-attn`) on the same pool: a group's 1,024-token prompts, a turn's 64 tokens over a
#     2,048-token cached context, one 4,096-token prompt;
#   - stepppo's rollout throughput with the radix cache vs without it, and transformers
#     `generate` on the same workload (Qwen2.5-0.5B shape, random bf16 weights);
#   - the embedded default trained on the GPU for 3 steps; compute-sanitizer on our kernels;
#   - real sizes: the actor update next to PyTorch's on the same GPU, weights and batch (the
#     `training` bench: Qwen2.5-0.5B's and Qwen2.5-3B's shapes; bf16, bf16 with activation
#     checkpointing, LoRA with both; tokens/s and peak memory of each side), then 3 steps of the
#     search-QA config on the Qwen2.5-0.5B shape (bf16) and on the Qwen2.5-3B shape (bf16,
#     activation checkpointing, LoRA on the policy and the critic), random weights, each step's
#     time, update time and peak GPU memory (`memory/peak_gib`) printed. ONLY=train runs these
#     alone.
# ONLY=dist runs the data-parallel checks alone: a bundle built with `nccl` brings Open MPI's
# Debian packages (.gpu/debs), unpacked under /tmp/mpiroot and relocated there (the machine has no
# MPI); the `dist_mpi` test runs as one rank under that `mpirun`, its gradient summed by NCCL on the
# GPU, and a short training run on the GPU as a plain process, as one NCCL rank and as one NCCL
# rank with `sharding: gradients` (reduce-scatter and all-gather on the device) must end with
# the same weights.
set -uo pipefail
results=${OUT:-gpu-results}
out=/tmp/gpu-check
rm -rf "$out"
mkdir -p "$results" "$out" /tmp/stepppo-gpu
deadline=$((SECONDS + ${BUDGET_S:-470}))
export PYTHONUNBUFFERED=1
# part NAME SECONDS CMD...: CMD under the smaller of SECONDS and the budget left (skipped under
# 5 s), its output shown as it comes and kept in $out/NAME.log.
part() {
  local name=$1 limit=$2 left=$((deadline - SECONDS))
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    echo "== $name: skipped, the budget is spent" | tee "$out/$name.log"
    return
  fi
  echo "== $name (at most ${limit} s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
}
pack() { tar czf "$results/gpu-check.tgz" -C "$out" . && echo "packed $results/gpu-check.tgz"; }
trap pack EXIT
tar xJf .gpu/bins.tar.xz -C /tmp/stepppo-gpu
chmod +x /tmp/stepppo-gpu/*
libs=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null || true)
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="${libs}${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ -d .gpu/debs ]; then
  # Open MPI from the Debian packages, relocated: OPAL_DESTDIR and PMIX_DESTDIR put the root in
  # front of every installed path (plugins, help texts, settings); PMIx's settings name its
  # plugin folder absolutely, so that one is given again. The two links are what the packages'
  # maintainer scripts (update-alternatives) would have made.
  mpiroot=/tmp/mpiroot
  rm -rf "$mpiroot"
  for f in .gpu/debs/*.deb; do dpkg -x "$f" "$mpiroot"; done
  mlib=$mpiroot/usr/lib/x86_64-linux-gnu
  ln -sf ../libpsm1/libpsm_infinipath.so.1.16 "$mlib/libpsm_infinipath.so.1"
  ln -sf orterun "$mpiroot/usr/bin/mpirun"
  export PATH="$mpiroot/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$mlib:$mlib/openmpi/lib:$mlib/ucx:$mpiroot/lib/x86_64-linux-gnu"
  export OPAL_DESTDIR=$mpiroot PMIX_DESTDIR=$mpiroot
  export PMIX_MCA_mca_base_component_path=$mlib/pmix2/lib/pmix
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
bin=/tmp/stepppo-gpu/stepppo
spec=${SPEC:-gpu_group:8,8,4,1024,64,64}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
if [ "${ONLY:-}" = dist ]; then
  if ! [ -x /tmp/stepppo-gpu/dist_mpi ] || ! command -v mpirun >/dev/null; then
    echo "ONLY=dist: the bundle has no dist_mpi or Open MPI (build it with FEATURES=nccl)"
    exit 1
  fi
  ldd /tmp/stepppo-gpu/dist_mpi > "$out/dist_mpi-ldd.txt" 2>&1
  grep 'not found' "$out/dist_mpi-ldd.txt"
  NCCL_DEBUG=${NCCL_DEBUG:-WARN} part test-dist_mpi 90 mpirun -np 1 /tmp/stepppo-gpu/dist_mpi --nocapture
  # Training on the GPU, as a plain process and as one launched rank whose every gradient NCCL
  # sums: the same short run of the built-in small model (the CUDA kernels need head_dim 32, 64
  # or 128; `tiny` has 8), the same weights.
  short=(--set device=cuda --set max_steps=2 --set eval_steps=2
    --set save_steps=2 --set sft.steps=3 --set sft.episodes=4 --set sft.batch_size=2
    --set ppo_mini_batch_size=4
    --set train_env_manager.group_size=2 --set train_env_manager.num_groups_partition=[4]
    --set val_env_manager.num_groups_partition=[2] --set generating_args.max_new_tokens=6
    --set val_generating_args.max_new_tokens=6 --set custom_envs.SimpleFrozenLake.env_config.max_turns=2)
  part train-cuda-single 120 "$bin" train --out /tmp/dp-single "${short[@]}"
  NCCL_DEBUG=${NCCL_DEBUG:-WARN} part train-cuda-nccl 120 mpirun -np 1 "$bin" train --out /tmp/dp-nccl "${short[@]}"
  python3 - /tmp/dp-single /tmp/dp-nccl <<'PY' 2>&1 | tee "$out/train-cuda-compare.log"
import sys
from safetensors.torch import load_file
a, b = (load_file(f"{d}/ckpt-2/policy/model.safetensors") for d in sys.argv[1:])
worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
print(f"plain CUDA run vs one NCCL rank, policy after 2 steps: {len(a)} tensors, max |diff| {worst:.3g}")
PY
  # The sharded optimizer step over NCCL (reduce-scatter, all-gather on the device) as one rank:
  # the same weights as the unsharded NCCL rank.
  NCCL_DEBUG=${NCCL_DEBUG:-WARN} part train-cuda-nccl-zero2 120 mpirun -np 1 "$bin" train \
    --out /tmp/dp-zero2 "${short[@]}" --set sharding=gradients
  python3 - /tmp/dp-nccl /tmp/dp-zero2 <<'PY' 2>&1 | tee "$out/train-cuda-zero2-compare.log"
import sys
from safetensors.torch import load_file
a, b = (load_file(f"{d}/ckpt-2/policy/model.safetensors") for d in sys.argv[1:])
worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
print(f"one NCCL rank, sharding none vs gradients, policy after 2 steps: max |diff| {worst:.3g}")
PY
  exit 0
fi
# Real sizes: 3 StepPO steps of the search-QA config from random weights of a model shape (no warm
# start: every answer is a format penalty; the runs measure time and memory, not learning).
real_size_training() {
  local qa=(--config configs/hotpotqa_steppo.yaml --set device=cuda --set precision=bf16
    --set sft.steps=0 --set sft.copy.steps=0 --set max_steps=3 --set eval_steps=0 --set save_steps=0
    --set cpu_threads=0)
  local shape
  for shape in 0.5b 3b; do
    part "update-vs-torch-$shape" 120 env STEPPPO_BENCH_DEVICE=cuda STEPPPO_TORCH_PYTHON=python3 \
      STEPPPO_BENCH_RUNS=3 STEPPPO_BENCH_DIR=/tmp/update-bench /tmp/stepppo-gpu/training "_$shape"
    rm -rf /tmp/update-bench
  done
  part train-qwen2.5-0.5b-bf16 100 "$bin" train --out /tmp/real-0.5b "${qa[@]}" \
    --set pretrain=configs/models/qwen2.5-0.5b.json
  part train-qwen2.5-3b-bf16-ckpt-lora 160 "$bin" train --out /tmp/real-3b "${qa[@]}" \
    --set pretrain=configs/models/qwen2.5-3b.json --set activation_checkpointing=true \
    --set 'lora={rank: 16, alpha: 32}' --set 'critic.lora={rank: 16, alpha: 32}'
  for run in /tmp/real-0.5b /tmp/real-3b; do
    [ -f "$run/metrics.jsonl" ] || continue
    cp "$run/metrics.jsonl" "$out/$(basename "$run")-metrics.jsonl"
    python3 - "$run/metrics.jsonl" <<'PY' 2>&1 | tee -a "$out/real-size.log"
import json, sys
print(sys.argv[1])
for line in open(sys.argv[1]):
    m = json.loads(line)
    if "time/update" in m:
        print(f"  step {m['step']}: {m['time/step']:.1f} s (rollout {m['time/rollout']:.1f}, "
              f"update {m['time/update']:.1f}), peak {m.get('memory/peak_gib', float('nan')):.2f} GiB "
              f"(planned {m.get('memory/planned_peak_gib', float('nan')):.2f}), "
              f"{m['throughput/tokens_per_s']:.0f} tokens/s")
PY
    rm -rf "$run"
  done
}
if [ "${ONLY:-}" = train ]; then
  real_size_training
  exit 0
fi
# In order of what matters most, each bounded, so a slow or hung part leaves the rest their time.
# The test against transformers' bf16 on the GPU runs only where transformers made its fixtures.
if part transformers-gpu-fixtures 40 python3 scripts/make_bf16_generation_fixtures.py --device cuda \
  --out /tmp/transformers-gpu; then
  export STEPPPO_TRANSFORMERS_GPU_FIXTURES=/tmp/transformers-gpu
fi
for t in /tmp/stepppo-gpu/cuda_*; do
  part "test-$(basename "$t")" 75 "$t" --nocapture
done
part test-lib-on-cuda 40 /tmp/stepppo-gpu/lib_tests on_cuda --nocapture
for shape in "64 4096" "8 32768"; do
  set -- $shape
  for hd in 64 128; do
    part "kernels-$1x$2-d$hd" 20 "$bin" bench kernels --device cuda --batch "$1" --context "$2" --head-dim "$hd" --json
  done
done
for shape in "8 1024 1024 64" "8 2048 64 64" "1 4096 4096 64" "8 1024 1024 128"; do
  set -- $shape
  part "prefill-$1x$3of$2-d$4" 20 "$bin" bench kernels --device cuda --batch "$1" --context "$2" \
    --prefill "$3" --head-dim "$4" --iters 20 --json
done
part torch-decode 40 python3 scripts/torch_decode_bench.py --shapes 64x4096,8x32768 --head-dims 64,128
# Cascade decode (the group's shared prompt as one matrix product) against the paged decode
# kernel alone: G 16 sharing a 4,096-token prompt, the Qwen2.5-0.5B shape in bf16.
part decode-cascade 60 "$bin" bench decode --device cuda --model configs/models/qwen2.5-0.5b.json \
  --group 16 --prompt 4096 --new 32 --json
part prefix 80 "$bin" bench prefix --device cuda --model configs/models/qwen2.5-0.5b.json --spec "$spec" --json
part hf-rollout 80 python3 scripts/hf_rollout_bench.py --spec "$spec" --json
# The embedded default trained on the GPU for a few steps (its step time next to the CPU's).
part train-default-cuda 45 "$bin" train --out /tmp/default-cuda --set device=cuda --set max_steps=3 \
  --set eval_steps=3 --set save_steps=0
cp /tmp/default-cuda/metrics.jsonl "$out/train-default-cuda-metrics.jsonl" 2>/dev/null
# The rollout again with flash-attention serving the prefill (radix arm's wall time against the
# paged run above); a bundle without `flash-attn` says so and moves on.
part prefix-flash 60 "$bin" bench prefix --device cuda --model configs/models/qwen2.5-0.5b.json \
  --spec "$spec" --prefill-attention flash --json
if command -v compute-sanitizer >/dev/null; then
  part memcheck 60 compute-sanitizer --tool memcheck /tmp/stepppo-gpu/cuda_kernels
fi
real_size_training
