#!/usr/bin/env bash
# Browser test of `stepppo view`: trains a tiny real run (or takes RUN_DIR), serves it on
# loopback, opens the run page, the trajectory list and a trajectory page in headless Chromium
# (Debian's package, installed when missing), checks the expected elements are in the DOM, that
# the page script ran (`data-ready="1"`) and reported no error, and saves screenshots.
#
#   scripts/browser_test.sh [SCREENSHOT.png]     # default: a temporary file
#   RUN_DIR=runs/x scripts/browser_test.sh docs/viewer.png
#
# Chromium runs with background networking off and every host name but 127.0.0.1 unresolvable,
# so nothing leaves the machine.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "browser test FAILED: $*" >&2; exit 1; }

if ! command -v chromium >/dev/null 2>&1; then
    echo "installing chromium (Debian package)"
    apt-get update >/dev/null && apt-get install -y chromium >/dev/null || fail "cannot install chromium"
fi

cargo build --quiet --bin stepppo
BIN="${CARGO_TARGET_DIR:-target}/debug/stepppo"
WORK="$(mktemp -d)"
VIEW_PID=""
cleanup() {
    if [ -n "$VIEW_PID" ]; then kill "$VIEW_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
SHOT="${1:-$WORK/run.png}"
KEPT="${1:+kept}"

RUN="${RUN_DIR:-}"
if [ -z "$RUN" ]; then
    RUN="$WORK/run"
    TINY=(builtin_size=tiny max_steps=2 eval_steps=1 sft.steps=2 sft.episodes=2 sft.batch_size=2
          ppo_mini_batch_size=2 train_env_manager.group_size=2
          "train_env_manager.num_groups_partition=[1]"
          "val_env_manager.num_groups_partition=[2]" generating_args.max_new_tokens=6
          val_generating_args.max_new_tokens=6 custom_envs.SimpleFrozenLake.env_config.max_turns=2
          cache.kv_slots=4096)
    SETS=()
    for s in "${TINY[@]}"; do SETS+=(--set "$s"); done
    "$BIN" train --out "$RUN" "${SETS[@]}" >"$WORK/train.log" 2>&1 || { cat "$WORK/train.log"; fail "tiny training run"; }
fi

"$BIN" view "$RUN" --port 0 >"$WORK/view.log" 2>&1 &
VIEW_PID=$!
URL=""
for _ in $(seq 1 600); do
    URL="$(grep -o 'http://127.0.0.1:[0-9]*/' "$WORK/view.log" || true)"
    [ -n "$URL" ] && break
    kill -0 "$VIEW_PID" 2>/dev/null || { cat "$WORK/view.log"; fail "stepppo view exited"; }
    sleep 0.1
done
[ -n "$URL" ] || fail "stepppo view printed no address"
echo "serving $RUN at $URL"

chrome() {
    chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
        --disable-component-update --disable-sync --no-first-run --disable-extensions \
        --host-resolver-rules="MAP * ~NOTFOUND, EXCLUDE 127.0.0.1" \
        --user-data-dir="$(mktemp -d "$WORK/profile.XXXX")" --enable-logging=stderr --v=0 \
        --virtual-time-budget=8000 "$@"
}

# dump NAME URL: the DOM after the script ran, checked for readiness and errors.
dump() {
    local name="$1" url="$2"
    chrome --dump-dom "$url" >"$WORK/$name.html" 2>"$WORK/$name.log" || { cat "$WORK/$name.log"; fail "$name: chromium failed"; }
    grep -q 'data-ready="1"' "$WORK/$name.html" || { cat "$WORK/$name.html"; fail "$name: the page script did not finish"; }
    if grep -q 'js-error' "$WORK/$name.html"; then grep -o '<pre class="js-error">[^<]*' "$WORK/$name.html"; fail "$name: script error"; fi
    if grep -E 'CONSOLE.*(Uncaught|Error)' "$WORK/$name.log"; then fail "$name: JavaScript error in the console"; fi
}

expect() {
    local name="$1" pattern="$2"
    grep -q -- "$pattern" "$WORK/$name.html" || fail "$name: no $pattern in the DOM"
}

dump run "$URL"
expect run 'class="chart"'
expect run 'data-metric="actor/entropy"'
expect run 'data-metric="val/SimpleFrozenLake/success"'
expect run 'href="/trajectories?step=1"'

dump list "${URL}trajectories?step=1"
expect list 'id="traj-table"'
TRAJ="$(grep -o 'href="/trajectory/[0-9]*"' "$WORK/list.html" | head -n 1 | grep -o '[0-9]*' || true)"
[ -n "$TRAJ" ] || fail "list: no trajectory of step 1"

dump traj "${URL}trajectory/$TRAJ?estimator=grpo&color=advantage"
expect traj 'class="tok"'
expect traj 'id="group"'
expect traj 'id="step-0"'
expect traj 'class="on" id="color-advantage"\|id="color-advantage" class="on"'

chrome --screenshot="$SHOT" --window-size=1280,860 "$URL" 2>"$WORK/shot.log" || { cat "$WORK/shot.log"; fail "screenshot"; }
[ -s "$SHOT" ] || fail "no screenshot at $SHOT"
chrome --screenshot="${SHOT%.png}-trajectory.png" --window-size=1280,860 "${URL}trajectory/$TRAJ" 2>>"$WORK/shot.log" || fail "trajectory screenshot"
echo "browser test passed: run page, list, trajectory $TRAJ; screenshots ${KEPT:-taken (pass a path to keep them)} ${KEPT:+$SHOT, ${SHOT%.png}-trajectory.png}"
