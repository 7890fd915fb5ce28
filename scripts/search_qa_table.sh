#!/usr/bin/env bash
# StepPO against its baselines on the search-QA config: for each seed, one StepPO run
# (`configs/hotpotqa_steppo.yaml` as shipped: copy pre-training, oracle warm start, step_gae with a
# separate critic) saves its warm start as RUN/warm_start; `token_gae` (same critic), `grpo` and
# `gigpo` (no critic) then start their RL from that same warm start, with the same budget
# (max_steps, rollout batch, validation episodes). The seeds run side by side, one compute thread
# each; then the table of validation EM (mean ± std over seeds at every validation step) is printed.
#
# Usage: scripts/search_qa_table.sh OUT_DIR [SEED ...]   (default seeds 42 43 44; OUT_DIR must not
# hold these runs yet)
# Extra overrides for every run: SEARCH_QA_SETS="max_steps=30 eval_steps=5".
set -euo pipefail
out=${1:?usage: scripts/search_qa_table.sh OUT_DIR [SEED ...]}
shift
if [ $# -gt 0 ]; then seeds=("$@"); else seeds=(42 43 44); fi
root=$(cd "$(dirname "$0")/.." && pwd)
config="$root/configs/hotpotqa_steppo.yaml"
bin="$root/target/release/stepppo"
(cd "$root" && cargo build --release --quiet)
mkdir -p "$out"

sets=(--set save_steps=0)
for s in ${SEARCH_QA_SETS:-}; do sets+=(--set "$s"); done

run() { # name seed [--set ...]
  local name=$1 seed=$2
  shift 2
  "$bin" train --config "$config" --out "$out/$name-$seed" --set "seed=$seed" "${sets[@]}" "$@" \
    > "$out/$name-$seed.log" 2>&1 || { echo "run $name-$seed failed: $out/$name-$seed.log" >&2; return 1; }
}

one_seed() { # seed
  local seed=$1
  local from=(--set "pretrain=$out/step_gae-$seed/warm_start" --set sft.steps=0 --set sft.copy.steps=0)
  run step_gae "$seed"
  run token_gae "$seed" "${from[@]}" --set adv_estimator=token_gae
  run grpo "$seed" "${from[@]}" --set adv_estimator=grpo --set critic.mode=none
  run gigpo "$seed" "${from[@]}" --set adv_estimator=gigpo --set critic.mode=none
}

# Two seeds at a time (one per core); a failed seed is reported once every seed has stopped.
pids=()
failed=0
for seed in "${seeds[@]}"; do
  one_seed "$seed" &
  pids+=($!)
  if [ ${#pids[@]} -eq 2 ]; then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || failed=1; done
[ "$failed" -eq 0 ] || { echo "some runs failed; no table" >&2; exit 1; }

arms=()
for arm in step_gae token_gae grpo gigpo; do
  runs=("${seeds[@]/#/$out/$arm-}")
  list=$(IFS=,; echo "${runs[*]}")
  arms+=(--arm "$arm=$list")
done
# Success is EM on this task (an episode succeeds when its answer matches exactly).
python3 "$root/scripts/learning_table.py" --metric val/HotpotQAVal/success \
  --also val/HotpotQAVal/f1 --also val/HotpotQAVal/searches "${arms[@]}"
