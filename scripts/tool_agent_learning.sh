#!/usr/bin/env bash
# Training a tool-calling agent from outside: `stepppo train` with configs/hotpotqa_tools_gateway.yaml
# serves the gateway; `stepppo env serve hotpotqa` (tool mode, the config's train split) serves the
# episodes; examples/openai_search_agent.py (the official openai client) plays them through the
# gateway until the run ends. Prints the trainer's validation EM (held-out split, in-process, tool
# mode) and the agent's EM per 128 episodes.
# Usage: scripts/tool_agent_learning.sh [OUT_DIR] [STEPS] [SEED] [--set KEY=VALUE ...]
# Environment: CONFIG (default configs/hotpotqa_tools_gateway.yaml); ENV_SETS="key=value ..." (env
# keys for the env server beyond the task's, e.g. the searcher recipe's retrieval bonus); STEPPPO_BIN.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/tool-agent}
steps=${2:-60}
seed=${3:-42}
shift $(( $# < 3 ? $# : 3 ))
bash scripts/examples_venv.sh >/dev/null
cargo build --release --quiet
bin=${STEPPPO_BIN:-target/release/stepppo}
config=${CONFIG:-configs/hotpotqa_tools_gateway.yaml}
env_sets=()
for s in ${ENV_SETS:-}; do env_sets+=(--set "$s"); done
rm -rf "$out"
mkdir -p "$(dirname "$out")"
log="$out.train.log"
"$bin" env serve hotpotqa --port 0 --set world=generated --set world_seed=0 --set world_size=60 \
  --set episode_worlds=true --set split=train --set corpus=distractor --set max_turns=4 \
  --set tools=true "${env_sets[@]}" > "$out.env.log" 2>&1 &
env_server=$!
"$bin" train --config "$config" --out "$out" \
  --set max_steps="$steps" --set save_steps=0 --set seed="$seed" \
  --set gateway.listen=127.0.0.1:0 "$@" > "$log" 2>&1 &
train=$!
trap 'kill $env_server 2>/dev/null || true' EXIT
wait_for() { # file pattern pid
  local found=""
  until [ -n "$found" ]; do
    kill -0 "$3" 2>/dev/null || { cat "$1"; exit 1; }
    found=$(grep -o "$2" "$1" | head -1 || true)
    sleep 1
  done
  echo "$found"
}
env_url=$(wait_for "$out.env.log" 'http://[^ ]*' "$env_server")
url=$(wait_for "$log" 'gateway: http://[^ ]*/v1' "$train" | sed 's/gateway: //')
echo "gateway at $url, env at $env_url"
target/examples-venv/bin/python examples/openai_search_agent.py --base-url "$url" \
  --env-url "$env_url" --questions 1000000 --first-seed $((seed * 1000003)) | tee "$out.agent.log"
wait "$train"
grep -E "validation|warm start" "$log"
