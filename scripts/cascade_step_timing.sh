#!/usr/bin/env bash
# Rollout time per training step with and without cascade attention, same config and seed:
# each run's mean `time/rollout` over its steps, and whether the two runs agree: their datasets
# byte for byte, and every metric other than timings, throughput and memory (else the largest
# relative drift and the first step that drifts).
#
# Usage: scripts/cascade_step_timing.sh OUT_DIR STEPS [CONFIG] [--set key=value ...]
#   scripts/cascade_step_timing.sh runs/cascade-default 10
#   scripts/cascade_step_timing.sh runs/cascade-qa 5 configs/hotpotqa_steppo.yaml
# Environment: STEPPPO_BIN=PATH (a fixed binary; default: target/release/stepppo, built first);
#   WARM_START=DIR (a run's warm_start directory both runs start from, skipping their own warm
#   start: e.g. OUT/cascade-true/warm_start of an earlier call, for configs whose warm start is long).
set -euo pipefail
out=${1:?usage: scripts/cascade_step_timing.sh OUT_DIR STEPS [CONFIG] [--set key=value ...]}
steps=${2:?name the number of steps}
shift 2
config=()
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then
  config=(--config "$1")
  shift
fi
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${STEPPPO_BIN:-$root/target/release/stepppo}
[ -n "${STEPPPO_BIN:-}" ] || (cd "$root" && cargo build --release --quiet)
mkdir -p "$out"
warm=()
if [ -n "${WARM_START:-}" ]; then
  warm=(--set "pretrain=$WARM_START" --set sft.steps=0 --set sft.copy.steps=0)
fi
for cascade in true false; do
  dir="$out/cascade-$cascade"
  rm -rf "$dir"
  "$bin" train "${config[@]}" --out "$dir" --set max_steps="$steps" --set save_steps=0 \
    --set eval_steps="$steps" --set cache.cascade_attention="$cascade" "${warm[@]}" "$@" \
    > "$dir.log" 2>&1 \
    || { echo "run with cascade_attention=$cascade failed: $dir.log" >&2; exit 1; }
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
runs = {c: [json.loads(l) for l in open(f"{out}/cascade-{c}/metrics.jsonl")] for c in ("true", "false")}
def mean_rollout(rows):
    xs = [r["time/rollout"] for r in rows if "time/rollout" in r]
    return sum(xs) / len(xs), len(xs)
(on, n), (off, _) = mean_rollout(runs["true"]), mean_rollout(runs["false"])
print(f"time/rollout per step over {n} steps: cascade {on:.3f} s, without {off:.3f} s ({off / on:.2f}x)")
worst, first = 0.0, None
for a, b in zip(runs["true"], runs["false"]):
    for k, x in a.items():
        if k.startswith(("time/", "memory/", "throughput/")) or not isinstance(x, (int, float)) or k not in b:
            continue
        y = b[k]
        if x != y:
            rel = abs(x - y) / max(abs(x), abs(y), 1e-12)
            worst = max(worst, rel)
            first = first or (a.get("step"), k)
import glob, hashlib
def dataset_digest(c):
    h = hashlib.sha256()
    for path in sorted(glob.glob(f"{out}/cascade-{c}/dataset/seg-*.stp")):
        h.update(open(path, "rb").read())
    return h.hexdigest()
same = dataset_digest("true") == dataset_digest("false")
print("datasets (every segment) " + ("byte-identical" if same else "differ"))
if first is None:
    print("every metric other than timings, throughput and memory is identical")
else:
    print(f"metrics drift: largest relative difference {worst:.2e}, first at step {first[0]} ({first[1]})")
PY
