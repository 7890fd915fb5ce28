#!/usr/bin/env bash
# Wall time per step of synchronous vs asynchronous rollout from one trained policy: arms k = 0, 1,
# 2 (async_rollout.staleness) and 1b, 2b (the same with `proximal: behaviour`; ARMS picks others),
# interleaved (k0, k1, k1b, …, k0, …) for ROUNDS rounds so that a
# change of load on a shared machine falls on every arm alike. Each run: STEPS RL steps from
# PRETRAIN (an HF policy directory, e.g. a checkpoint's `policy/`), no warm start, no validation.
# Prints per arm the mean seconds per step (steps after the first), the rollout's and the update's
# share, and the speed-up over k = 0 next to its ideal, the synchronous runs' mean of
# rollout + update over their mean of max(rollout, update).
#
#   cargo build --release
#   bash scripts/async_timing.sh PRETRAIN [CONFIG|default] [ROUNDS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
pretrain=${1:?usage: async_timing.sh PRETRAIN [CONFIG|default] [ROUNDS] [STEPS]}
config=${2:-default}
rounds=${3:-3}
steps=${4:-6}
bin=${STEPPPO_BIN:-target/release/stepppo}
cfg=()
[ "$config" = default ] || cfg=(--config "$config")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# An arm is a staleness k, with a `b` for `proximal: behaviour`.
arms=(${ARMS:-0 1 1b 2 2b})
for round in $(seq "$rounds"); do
  for arm in "${arms[@]}"; do
    proximal=recompute
    [[ $arm == *b ]] && proximal=behaviour
    RAYON_NUM_THREADS=1 "$bin" train "${cfg[@]}" --out "$out/k$arm-r$round" \
      --set pretrain="$pretrain" --set sft.steps=0 --set max_steps="$steps" --set eval_steps=0 \
      --set save_steps=0 --set cpu_threads=1 --set async_rollout.staleness="${arm%b}" \
      --set async_rollout.proximal="$proximal" > /dev/null 2>&1
  done
done

python3 - "$out" "$rounds" "${arms[@]}" <<'PY'
import json, statistics, sys
out, rounds, arms = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def steps(k):
    rows = []
    for r in range(1, rounds + 1):
        with open(f"{out}/k{k}-r{r}/metrics.jsonl") as f:
            metrics = [json.loads(line) for line in f]
        # Step 1 warms up (and an async run's first batch cannot overlap anything).
        rows += [m for m in metrics if "time/step" in m][1:]
    return rows
base = steps(0)
ideal = (sum(r["time/rollout"] + r["time/update"] for r in base)
         / sum(max(r["time/rollout"], r["time/update"]) for r in base))
mean = lambda rows, key: statistics.mean(r.get(key, 0.0) for r in rows)
print("| k | s/step (mean ± std) | rollout s | update s | proximal s | trainer wait s | speed-up | ideal |")
print("|---|---|---|---|---|---|---|---|")
for k in arms:
    rows = steps(k)
    per_step = [r["time/step"] for r in rows]
    print(f"| {k} | {statistics.mean(per_step):.2f} ± {statistics.stdev(per_step):.2f} "
          f"| {mean(rows, 'time/rollout'):.2f} | {mean(rows, 'time/update'):.2f} "
          f"| {mean(rows, 'time/proximal'):.2f} | {mean(rows, 'time/trainer_wait'):.2f} "
          f"| {mean(base, 'time/step') / statistics.mean(per_step):.2f}× | {ideal:.2f}× |")
PY
