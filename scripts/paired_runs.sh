#!/usr/bin/env bash
# Paired comparison of training arms (advantage estimators, critic ablations) on one config: per
# seed, one warm start shared by every arm, each arm's RL from it, and greedy success of every
# EVAL_EVERY-th checkpoint on held-out episodes (`stepppo eval --episodes N --json`). Resumable: a
# run whose last checkpoint exists, or an evaluation whose JSON exists, is not redone; a run cut
# short continues from its latest checkpoint (`stepppo train --resume`, exact), or starts again
# when it saved none. `scripts/paired_table.py OUT` prints the tables (mean and 95 % CI
# per arm, paired differences of the first arm minus each other).
#
# Usage: scripts/paired_runs.sh OUT_DIR SEED [SEED ...]
# Environment (defaults for configs/hotpotqa_steppo.yaml, 60 steps):
#   CONFIG=configs/hotpotqa_steppo.yaml   MAX_STEPS=(the config's)   EVAL_EVERY=20   EPISODES=256
#   SAVE_EVERY=EVAL_EVERY (a divisor of it: how much of a run cut short is kept)
#   JOBS=1 (seeds side by side)
#   ARMS="step_gae token_gae grpo gigpo"  (the first arm's run makes the warm start; the names below)
#   SETS="key=value ..."                  (overrides for every run)
#   ENV_TAG=SimpleFrozenLake              (the custom_envs entry the critic_facts arms set)
#   STEPPPO_BIN=PATH                       (a fixed binary, e.g. a copy, so that rebuilding the tree
#                                           during a long comparison does not change its later runs)
# Arms: step_gae (the config as shipped), token_gae (same critic), grpo and gigpo (no critic),
#   step_gae_boot (the Turn-PPO recipe: lambda 0.9, so GAE bootstraps from V between steps, and
#   5 critic warm-up steps); step_gae_lambda1 (lambda 1: step GAE as a per-step baseline); for
#   search QA, privileged_critic and privileged_boot (a state critic on the env's privileged
#   facts: the gold paragraphs and answer found so far; lambda 1 and 0.9); for FrozenLake's state
#   critic: facts_no_nearer and facts_map (critic_facts; see the env's keys) and no_critic
#   (step_reinforce, the same returns without a critic baseline).
# Search QA, 10 seeds:  scripts/paired_runs.sh runs/paired 42 43 44 45 46 47 48 49 50 51
# Long horizons:        CONFIG=configs/frozenlake_long.yaml EVAL_EVERY=40 EPISODES=128 \
#   ARMS="step_gae step_gae_lambda1 token_gae grpo gigpo" scripts/paired_runs.sh runs/long 42 43 …
#   (then scripts/credit_table.py runs/long for the critic's EV by turn and the advantages' variance)
# FrozenLake critic:    CONFIG=configs/frozenlake_steppo.yaml MAX_STEPS=60 \
#   ARMS="step_gae facts_no_nearer facts_map no_critic" scripts/paired_runs.sh runs/fl-critic 42 43 44
set -euo pipefail
out=${1:?usage: scripts/paired_runs.sh OUT_DIR SEED [SEED ...]}
shift
[ $# -gt 0 ] || { echo "name at least one seed" >&2; exit 2; }
env_tag=${ENV_TAG:-SimpleFrozenLake}
seeds=("$@")
root=$(cd "$(dirname "$0")/.." && pwd)
config=${CONFIG:-$root/configs/hotpotqa_steppo.yaml}
every=${EVAL_EVERY:-20}
save_every=${SAVE_EVERY:-$every}
(( every % save_every == 0 )) || { echo "SAVE_EVERY $save_every must divide EVAL_EVERY $every" >&2; exit 2; }
episodes=${EPISODES:-256}
jobs=${JOBS:-1}
read -r -a arms <<< "${ARMS:-step_gae token_gae grpo gigpo}"
if [ -n "${STEPPPO_BIN:-}" ]; then
  bin=$STEPPPO_BIN
else
  bin="$root/target/release/stepppo"
  (cd "$root" && cargo build --release --quiet)
fi
mkdir -p "$out"
max_steps=${MAX_STEPS:-$(sed -n 's/^max_steps: *\([0-9]*\).*/\1/p' "$config")}
[ -n "$max_steps" ] || { echo "$config: no top-level max_steps; set MAX_STEPS" >&2; exit 2; }

sets=(--set max_steps="$max_steps" --set save_steps="$save_every" --set eval_steps="$max_steps")
for s in ${SETS:-}; do sets+=(--set "$s"); done

# A state critic as the FrozenLake default fits one: 10 passes over the last 32 batches' steps.
state_critic="critic.mode=state critic.ppo_epochs=10 critic.history_batches=32"
arm_sets() { # arm -> the overrides that make it
  case $1 in
    step_gae) ;;
    token_gae) echo "adv_estimator=token_gae" ;;
    grpo) echo "adv_estimator=grpo critic.mode=none" ;;
    gigpo) echo "adv_estimator=gigpo critic.mode=none" ;;
    step_gae_boot) echo "lambd=0.9 critic.warmup_steps=5" ;;
    step_gae_lambda1) echo "lambd=1.0" ;;
    privileged_critic) echo "$state_critic" ;;
    privileged_boot) echo "$state_critic lambd=0.9 critic.warmup_steps=5" ;;
    facts_no_nearer) echo "custom_envs.$env_tag.env_config.critic_facts=no_nearer" ;;
    facts_map) echo "custom_envs.$env_tag.env_config.critic_facts=map" ;;
    no_critic) echo "adv_estimator=step_reinforce critic.mode=none" ;;
    *) echo "unknown arm $1" >&2; return 1 ;;
  esac
}

run() { # arm seed first_arm
  local arm=$1 seed=$2 first=$3 dir="$out/$1-$2" extra=()
  [ -d "$dir/ckpt-$max_steps" ] && return 0
  if compgen -G "$dir/ckpt-[0-9]*" > /dev/null; then
    echo "resuming $arm-$seed from its latest checkpoint" >> "$dir.log"
    "$bin" train --resume --out "$dir" >> "$dir.log" 2>&1 \
      || { echo "run $arm-$seed failed: $dir.log" >&2; return 1; }
    return 0
  fi
  rm -rf "$dir"
  for s in $(arm_sets "$arm"); do extra+=(--set "$s"); done
  if [ "$arm" != "$first" ]; then
    extra+=(--set "pretrain=$out/$first-$seed/warm_start" --set sft.steps=0 --set sft.copy.steps=0)
  fi
  "$bin" train --config "$config" --out "$dir" --set "seed=$seed" "${sets[@]}" "${extra[@]}" \
    > "$dir.log" 2>&1 || { echo "run $arm-$seed failed: $dir.log" >&2; return 1; }
}

evaluate() { # checkpoint_or_model_dir seed json
  [ -s "$3" ] && return 0
  "$bin" eval --checkpoint "$1" --config "$config" --set "seed=$2" ${SETS:+$(printf -- '--set %s ' $SETS)} \
    --episodes "$episodes" --json > "$3.tmp" 2> "$3.log" && mv "$3.tmp" "$3" \
    || { echo "eval of $1 failed: $3.log" >&2; return 1; }
}

one_seed() { # seed
  local seed=$1 first=${arms[0]}
  run "$first" "$seed" "$first"
  evaluate "$out/$first-$seed/warm_start" "$seed" "$out/warm_start-$seed.eval.json"
  for arm in "${arms[@]}"; do
    run "$arm" "$seed" "$first"
    for ((step = every; step <= max_steps; step += every)); do
      evaluate "$out/$arm-$seed/ckpt-$step" "$seed" "$out/$arm-$seed.eval-$step.json"
    done
  done
  echo "seed $seed done $(date -u +%H:%M)"
}

pids=()
failed=0
for seed in "${seeds[@]}"; do
  one_seed "$seed" &
  pids+=($!)
  if [ ${#pids[@]} -ge "$jobs" ]; then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || failed=1; done
python3 "$root/scripts/paired_table.py" "$out"
[ "$failed" -eq 0 ] || { echo "some runs failed (their logs are named above)" >&2; exit 1; }
