#!/usr/bin/env bash
# Synchronous vs asynchronous rollout (async_rollout.staleness k = 0, 1, 2; ARMS picks others)
# side by side: one training run per arm and seed, one at a time (an async run computes on two threads, the trainer's
# and the rollout thread's, one compute thread each), then a table of wall time per step, the
# time each side spends, the overlap reached against its ideal, and validation success at equal
# steps.
#
#   cargo build --release   (STEPPPO_BIN=path runs another binary: a copy stays put while you rebuild)
#   bash scripts/async_bench.sh OUT [CONFIG|default] [STEPS] [EVAL_STEPS] [SEEDS...]
#
# e.g. `bash scripts/async_bench.sh /tmp/async-fl default 30 10 42 43` and
# `bash scripts/async_bench.sh /tmp/async-qa configs/hotpotqa_steppo.yaml 20 10 42 43`. Runs
# already finished under OUT are kept and only summarised again.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: async_bench.sh OUT [CONFIG|default] [STEPS] [EVAL_STEPS] [SEEDS...]}
config=${2:-default}
steps=${3:-30}
eval_steps=${4:-10}
shift $(( $# < 4 ? $# : 4 ))
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(42 43)
bin=${STEPPPO_BIN:-target/release/stepppo}
cfg=()
[ "$config" = default ] || cfg=(--config "$config")
mkdir -p "$out"

# An arm is a staleness k, with a `b` for `proximal: behaviour` (e.g. ARMS="0 1 1b 2").
arms=(${ARMS:-0 1 2})
for seed in "${seeds[@]}"; do
  for arm in "${arms[@]}"; do
    run="$out/k$arm-s$seed"
    [ -f "$run/ckpt-$steps/state.json" ] && continue
    rm -rf "$run"
    proximal=recompute
    [[ $arm == *b ]] && proximal=behaviour
    RAYON_NUM_THREADS=1 "$bin" train "${cfg[@]}" --out "$run" --set seed="$seed" \
      --set max_steps="$steps" --set eval_steps="$eval_steps" --set save_steps=0 \
      --set cpu_threads=1 --set async_rollout.staleness="${arm%b}" \
      --set async_rollout.proximal="$proximal" > "$run.log" 2>&1
  done
done

python3 scripts/async_summary.py "$out" "${seeds[@]}"
