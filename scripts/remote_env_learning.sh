#!/usr/bin/env bash
# `stepppo train` learning through the env bridge: starts the gym env server
# (examples/gym_env_server.py, FrozenLake-v1, a 4x4 map per seed, distance shaping 0.1) on a free
# port, trains configs/frozenlake_remote.yaml (the embedded default's recipe, seed 42) for STEPS
# steps with the release build, then prints the validation success of every evaluation and the
# time per step with the share the rollouts spent in the env. With BUILTIN_STEPS > 0 it then runs
# the embedded default (built-in FrozenLake) for that many steps and prints the same times, for
# the env-time comparison.
#
#   bash scripts/remote_env_learning.sh [OUT_DIR]        # STEPS=40 BUILTIN_STEPS=5 by default
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${STEPS:-40}
builtin_steps=${BUILTIN_STEPS:-5}
out=${1:-runs/frozenlake_remote}
python=${STEPPPO_PYTHON:-target/examples-venv/bin/python}
[ -x "$python" ] || bash scripts/examples_venv.sh

cargo build --release
log=$(mktemp)
"$python" examples/gym_env_server.py FrozenLake-v1 --port 0 --random-maps --distance-reward 0.1 \
  >"$log" &
server=$!
trap 'kill $server 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 300); do
  grep -q ' at http://' "$log" && break
  kill -0 "$server" 2>/dev/null || { echo "the gym env server exited" >&2; exit 1; }
  sleep 0.1
done
url=$(sed -n 's/.* at \(http:.*\)$/\1/p' "$log")
echo "env server: $url"

target/release/stepppo train --config configs/frozenlake_remote.yaml --out "$out" --overwrite \
  --set seed=42 --set "max_steps=$steps" \
  --set "custom_envs.RemoteFrozenLake.env_config.url=$url"

summary() {
  "$python" - "$1" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for row in rows:
    for key, value in row.items():
        if key.startswith("val/") and key.endswith("/success"):
            print(f"  validation success at step {row['step']}: {value:.3f}")
steps = [r for r in rows if "time/step" in r]
total = sum(r["time/step"] for r in steps)
env = sum(r.get("time/rollout_env", 0.0) for r in steps)
rollout = sum(r["time/rollout"] for r in steps)
turns = sum(r["rollout/steps"] for r in steps)
print(f"  {len(steps)} steps: {total / len(steps):.2f} s/step, rollout {rollout / total:.1%} of it,"
      f" env {env / total:.2%} ({env / len(steps):.3f} s/step, {1000 * env / turns:.2f} ms/turn)")
errors = sum(r.get("rollout/env_errors", 0) for r in steps)
print(f"  env errors: {errors:.0f}")
EOF
}
echo "remote FrozenLake ($out):"
summary "$out/metrics.jsonl"

if [ "$builtin_steps" -gt 0 ]; then
  builtin_out="$out-builtin"
  target/release/stepppo train --out "$builtin_out" --overwrite \
    --set seed=42 --set "max_steps=$builtin_steps" --set "eval_steps=$builtin_steps"
  echo "built-in FrozenLake ($builtin_out):"
  summary "$builtin_out/metrics.jsonl"
fi
