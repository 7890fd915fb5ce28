#!/usr/bin/env bash
# Training from an outside agent: `stepppo train` with configs/frozenlake_gateway.yaml serves the
# gateway; examples/openai_frozenlake_agent.py (the official openai client, gymnasium's FrozenLake)
# plays through it until the run ends. Prints the trainer's log and the agent's success per 64
# episodes. Usage: scripts/gateway_learning.sh [OUT_DIR] [STEPS] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gateway-learning}
steps=${2:-40}
seed=${3:-42}
bash scripts/examples_venv.sh
cargo build --release --quiet
rm -rf "$out"
mkdir -p "$(dirname "$out")"
log="$out.train.log"
target/release/stepppo train --config configs/frozenlake_gateway.yaml --out "$out" \
  --set max_steps="$steps" --set save_steps=0 --set seed="$seed" \
  --set gateway.listen=127.0.0.1:0 > "$log" 2>&1 &
train=$!
url=""
until [ -n "$url" ]; do
  kill -0 "$train" 2>/dev/null || { cat "$log"; exit 1; }
  url=$(grep -o 'gateway: http://[^ ]*/v1' "$log" | sed 's/gateway: //' || true)
  sleep 1
done
echo "gateway at $url"
target/examples-venv/bin/python examples/openai_frozenlake_agent.py --base-url "$url" \
  --maps 100000 | tee "$out.agent.log"
wait "$train"
grep -E "validation|warm start" "$log"
