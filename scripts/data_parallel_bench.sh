#!/usr/bin/env bash
# Step time and rollout throughput of one training run on 1 rank and on N ranks under mpirun (one
# compute thread per rank), side by side: the embedded default for STEPS steps after its warm
# start, no validation or checkpoints. Needs a `--features mpi` release build and Open MPI.
#
#   cargo build --release --features mpi && bash scripts/data_parallel_bench.sh [N] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-2}
steps=${2:-6}
bin=target/release/stepppo
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
sets=(--set max_steps="$steps" --set eval_steps=0 --set save_steps="$steps" --set cpu_threads=1)
root=()
[ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)

RAYON_NUM_THREADS=1 "$bin" train --out "$out/n1" "${sets[@]}" 2>/dev/null
mpirun "${root[@]}" --oversubscribe --bind-to none -np "$ranks" -x RAYON_NUM_THREADS=1 \
  "$bin" train --out "$out/n$ranks" "${sets[@]}" 2>/dev/null

python3 - "$out/n1" "$out/n$ranks" "$ranks" <<'PY'
import json, sys
def summary(run):
    rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
    # Step 1 warms caches and allocators up: the mean is over the steps after it.
    steps = [r for r in rows if "time/step" in r][1:]
    mean = lambda k: sum(r.get(k, 0.0) for r in steps) / len(steps)
    tokens = sum(r["rollout/generated_tokens"] for r in steps)
    rollout_s = sum(r["time/rollout"] for r in steps)
    return dict(step=mean("time/step"), rollout=mean("time/rollout"), update=mean("time/update"),
                tok_s=tokens / rollout_s, bytes=mean("dist/bytes"), comm=mean("dist/seconds"),
                n=len(steps))
one, many, n = summary(sys.argv[1]), summary(sys.argv[2]), int(sys.argv[3])
print(f"| ranks | s/step | rollout s | update s | rollout tokens/s | bytes/step | collective s/step |")
print(f"|---|---|---|---|---|---|---|")
for k, s in ((1, one), (n, many)):
    print(f"| {k} | {s['step']:.2f} | {s['rollout']:.2f} | {s['update']:.2f} | {s['tok_s']:.0f} "
          f"| {s['bytes']/1e6:.2f} MB | {s['comm']:.2f} |")
print(f"speed-up of a step: {one['step']/many['step']:.2f}× (ideal {n}×); "
      f"rollout throughput {many['tok_s']/one['tok_s']:.2f}×; over {one['n']} steps each")
PY
