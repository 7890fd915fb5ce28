#!/usr/bin/env bash
# Generates a seeded pool of TextWorld games for examples/textworld_env_server.py
# (docs/guides/env-hubs.md):
#
#   bash scripts/make_textworld_pool.sh DIR [COUNT] [tw-make arguments...]
#
# Game i (0 <= i < COUNT, default 100) is `tw-make ARGS --seed $((FIRST_SEED + i))`, written as
# DIR/game_NNNNN.z8 with its .json (the server needs both; tw-make's .ni source is removed).
# ARGS default to a 5-room world with a 5-step quest:
#   custom --world-size 5 --quest-length 5 --nb-objects 10
# e.g. `bash scripts/make_textworld_pool.sh pools/simple 50 tw-simple --rewards dense --goal detailed`.
# The server serves game i to the episodes reset with seed i (seed_max = COUNT - 1), so a pool made
# with the same arguments and FIRST_SEED (default 0) gives every seed the same game on any machine.
# Games already in DIR are kept (the script resumes); DIR/pool.txt records the command.
# tw-make comes from target/examples-venv (`STEPPPO_EXAMPLES_HUBS=1 bash scripts/examples_venv.sh`) unless TW_MAKE names
# another. Each game takes about 3 s of one core; the script runs at nice 19.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
dir=$1
count=${2:-100}
shift $(($# < 2 ? $# : 2))
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  args=(custom --world-size 5 --quest-length 5 --nb-objects 10)
fi
first=${FIRST_SEED:-0}
tw_make=${TW_MAKE:-target/examples-venv/bin/tw-make}
if [ ! -x "$tw_make" ] && ! command -v "$tw_make" >/dev/null; then
  echo "no tw-make at $tw_make: run STEPPPO_EXAMPLES_HUBS=1 bash scripts/examples_venv.sh (or set TW_MAKE)" >&2
  exit 1
fi
mkdir -p "$dir"
echo "tw-make ${args[*]} --seed \$((${first} + i)) for i in 0..$((count - 1))" >"$dir/pool.txt"
start=$(date +%s)
for ((i = 0; i < count; i++)); do
  name=$(printf 'game_%05d' "$i")
  if [ -f "$dir/$name.z8" ] && [ -f "$dir/$name.json" ]; then
    continue
  fi
  nice -n 19 "$tw_make" "${args[@]}" --seed $((first + i)) --output "$dir/$name.z8" -f --silent
  rm -f "$dir/$name.ni"
done
echo "pool ready: $dir ($count games, $(($(date +%s) - start)) s)"
