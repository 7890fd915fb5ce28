#!/usr/bin/env bash
# Step time and rollout throughput of one training run on 1 rank and on N ranks under mpirun (one
# compute thread per rank), side by side, for each sharding mode at N ranks: the embedded default
# for STEPS steps after its warm start, no validation or checkpoints. Beside each mode's bytes
# (handed to collectives, and a ring algorithm's volume sent per rank) stands the theoretical
# ring volume of its optimizer steps alone: per step over P trained f32 parameters, all-reduce
# 2(N−1)/N·4P (none), all-reduce plus all-gather 3(N−1)/N·4P (optimizer), reduce-scatter plus
# all-gather 2(N−1)/N·4P (gradients). Needs a `--features mpi` release build and Open MPI.
#
#   cargo build --release --features mpi && bash scripts/data_parallel_bench.sh [N] [STEPS]
#   SHARDING="none gradients" bash scripts/data_parallel_bench.sh 2 6   (modes at N ranks)
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-2}
steps=${2:-6}
read -r -a modes <<< "${SHARDING:-none optimizer gradients}"
bin=target/release/stepppo
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
sets=(--set max_steps="$steps" --set eval_steps=0 --set save_steps="$steps" --set cpu_threads=1)
root=()
[ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)

RAYON_NUM_THREADS=1 "$bin" train --out "$out/n1" "${sets[@]}" 2>/dev/null
for mode in "${modes[@]}"; do
  mpirun "${root[@]}" --oversubscribe --bind-to none -np "$ranks" -x RAYON_NUM_THREADS=1 \
    "$bin" train --out "$out/$mode" "${sets[@]}" --set sharding="$mode" 2>/dev/null
done
params=$("$bin" plan | sed -n 's/.*weights (\([0-9]*\) parameters.*/\1/p')

python3 - "$out" "$ranks" "$params" "${modes[@]}" <<'PY'
import json, sys
out, n, params, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
factor = {"none": 2, "optimizer": 3, "gradients": 2}
def summary(run):
    rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
    # Step 1 warms caches and allocators up: the mean is over the steps after it.
    steps = [r for r in rows if "time/step" in r][1:]
    mean = lambda k: sum(r.get(k, 0.0) for r in steps) / len(steps)
    tokens = sum(r["rollout/generated_tokens"] for r in steps)
    rollout_s = sum(r["time/rollout"] for r in steps)
    return dict(step=mean("time/step"), rollout=mean("time/rollout"), update=mean("time/update"),
                tok_s=tokens / rollout_s, bytes=mean("dist/bytes"), ring=mean("dist/ring_bytes"),
                comm=mean("dist/seconds"), updates=mean("actor/updates"), n=len(steps))
one = summary(f"{out}/n1")
print("| ranks | sharding | s/step | rollout s | update s | rollout tokens/s | bytes/step "
      "| ring bytes/step | optimizer steps' ring volume (theory) | collective s/step |")
print("|---|---|---|---|---|---|---|---|---|---|")
print(f"| 1 | — | {one['step']:.2f} | {one['rollout']:.2f} | {one['update']:.2f} "
      f"| {one['tok_s']:.0f} | — | — | — | — |")
for mode in modes:
    s = summary(f"{out}/{mode}")
    theory = s["updates"] * factor[mode] * (n - 1) / n * 4 * params
    print(f"| {n} | {mode} | {s['step']:.2f} | {s['rollout']:.2f} | {s['update']:.2f} "
          f"| {s['tok_s']:.0f} | {s['bytes']/1e6:.2f} MB | {s['ring']/1e6:.2f} MB "
          f"| {theory/1e6:.2f} MB | {s['comm']:.2f} |")
    print(f"speed-up of a step ({mode}): {one['step']/s['step']:.2f}× (ideal {n}×); "
          f"{s['updates']:.1f} optimizer steps a step; over {one['n']} steps each", file=sys.stderr)
PY
