#!/usr/bin/env bash
# Export and import of the 1M-record FrozenLake dataset: rows/s, file size and peak memory of
# `stepppo dataset export` (zstd, snappy) and `dataset import`, next to the segment store's size
# and `stepppo replay --format jsonl` (the JSONL export); with the examples venv, pyarrow's and
# pandas' read of the Parquet file against pandas' read of the JSONL. Figures: BENCHMARKS.md,
# "Dataset interchange".
#
#   bash scripts/dataset_interchange_bench.sh [WORKDIR]   # default /tmp/interchange-bench
#
# STEPPPO_BIN picks the binary (default target/release/stepppo, built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/interchange-bench}
bin=${STEPPPO_BIN:-target/release/stepppo}
[ -x "$bin" ] || cargo build --release
mkdir -p "$work"
data="$work/fl-1m"
if [ ! -d "$data" ]; then
  "$bin" collect --env frozen_lake --agent random --episodes 180000 --group-size 8 --out "$data"
fi
records=$("$bin" replay "$data" --stats --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["steps"])')
echo "dataset: $records records, $(du -sb "$data" | cut -f1) bytes in the segment store"

# Runs a command under /usr/bin/time; prints wall seconds, rows/s and peak RSS.
timed() {
  local label=$1
  shift
  /usr/bin/time -f "%e %M" -o "$work/time" "$@" > "$work/out" 2> "$work/err" || {
    cat "$work/err" >&2
    exit 1
  }
  read -r secs rss < "$work/time"
  awk -v l="$label" -v s="$secs" -v n="$records" -v r="$rss" \
    'BEGIN { printf "%s: %.1f s, %.0f rows/s, peak RSS %.0f MiB\n", l, s, n / s, r / 1024 }'
}

rm -rf "$work/back" "$work"/*.parquet
timed "export parquet (zstd)" "$bin" dataset export "$data" --out "$work/zstd.parquet"
timed "export parquet (snappy)" "$bin" dataset export "$data" --out "$work/snappy.parquet" --compression snappy
timed "import parquet (zstd)" "$bin" dataset import "$work/zstd.parquet" --out "$work/back"
timed "replay jsonl" sh -c "'$bin' replay '$data' --format jsonl > '$work/steps.jsonl'"
for f in zstd.parquet snappy.parquet steps.jsonl; do
  echo "size $f: $(stat -c %s "$work/$f") bytes"
done
echo "size re-imported store: $(du -sb "$work/back" | cut -f1) bytes"
"$bin" dataset verify "$work/back"
cmp <("$bin" replay "$data" --format jsonl) <("$bin" replay "$work/back" --format jsonl) \
  && echo "round trip: identical JSONL replay"

python=target/examples-venv/bin/python
if [ -x "$python" ]; then
  "$python" - "$work" <<'EOF'
import sys, time
import pandas as pd, pyarrow.parquet as pq
work = sys.argv[1]
for label, read in [
    ("pyarrow read_table (zstd)", lambda: pq.read_table(f"{work}/zstd.parquet")),
    ("pandas read_parquet (zstd)", lambda: pd.read_parquet(f"{work}/zstd.parquet")),
    ("pandas read_json (JSONL)", lambda: pd.read_json(f"{work}/steps.jsonl", lines=True)),
]:
    start = time.perf_counter()
    n = len(read())
    print(f"{label}: {n} rows in {time.perf_counter() - start:.1f} s")
EOF
fi
