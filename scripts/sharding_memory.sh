#!/usr/bin/env bash
# Each rank's planned peak against its measured one, for the sharding modes at 1, 2 and 3 ranks:
# the embedded default with the Qwen2.5-0.5B shape (random weights, the built-in tokenizer),
# LAYERS of its 24 layers (default 24), 2 RL steps of 4 groups × 2 episodes, one update a step,
# no warm start. Rank 0's `memory/peak_gib` (the process's peak resident memory, read at the
# step's end, before its checkpoint) beside `memory/planned_peak_gib` (the plan of the largest
# forward the step checked), at step 2. Needs a `--features mpi` release build and Open MPI.
#
#   cargo build --release --features mpi && LAYERS=4 bash scripts/sharding_memory.sh
#   RUNS="1:none 2:gradients" bash scripts/sharding_memory.sh   (ranks:mode pairs)
set -euo pipefail
cd "$(dirname "$0")/.."
layers=${LAYERS:-24}
read -r -a runs <<< "${RUNS:-1:none 2:none 2:optimizer 2:gradients 3:optimizer 3:gradients}"
bin=target/release/stepppo
out=${KEEP:-$(mktemp -d)}
[ -n "${KEEP:-}" ] || trap 'rm -rf "$out"' EXIT
python3 - "$layers" "$out/shape.json" <<'PY'
import json, sys
shape = json.load(open("configs/models/qwen2.5-0.5b.json"))
shape["num_hidden_layers"] = int(sys.argv[1])
json.dump(shape, open(sys.argv[2], "w"))
PY
sets=(--set pretrain="$out/shape.json" --set sft.steps=0 --set sft.copy.steps=0
      --set max_steps=2 --set eval_steps=0 --set save_steps=2 --set cpu_threads=1
      --set train_env_manager.group_size=2 --set "train_env_manager.num_groups_partition=[4]"
      --set generating_args.max_new_tokens=6 --set custom_envs.SimpleFrozenLake.env_config.max_turns=2
      --set ppo_mini_batch_size=8 --set self_imitation.coef=0)
root=()
[ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)

echo "| ranks | sharding | planned peak, rank 0 | measured peak, rank 0 | measured / planned |"
echo "|--:|---|--:|--:|--:|"
for run in "${runs[@]}"; do
  ranks=${run%%:*}
  mode=${run#*:}
  dir="$out/r$ranks-$mode"
  if [ "$ranks" -eq 1 ]; then
    RAYON_NUM_THREADS=1 "$bin" train --out "$dir" "${sets[@]}" --set sharding="$mode" 2>"$dir.log"
  else
    mpirun "${root[@]}" --oversubscribe --bind-to none -np "$ranks" -x RAYON_NUM_THREADS=1 \
      "$bin" train --out "$dir" "${sets[@]}" --set sharding="$mode" 2>"$dir.log"
  fi
  python3 - "$dir" "$ranks" "$mode" <<'PY'
import json, sys
run, ranks, mode = sys.argv[1:]
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
last = [r for r in rows if "memory/peak_gib" in r][-1]
planned, measured = last["memory/planned_peak_gib"], last["memory/peak_gib"]
print(f"| {ranks} | {mode} | {planned:.2f} GiB | {measured:.2f} GiB | {measured / planned:.2f} |")
PY
done
