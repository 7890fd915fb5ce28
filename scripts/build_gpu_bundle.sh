#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything the GPU check needs and packs it into .gpu/
# (git-ignored): the `stepppo` binary and the CUDA test binaries, built with `--features cuda`
# (add `flash-attn` through FEATURES), xz-compressed. Carry `.gpu` to the GPU machine and run
# `bash scripts/gpu_check.sh` there (see README, "CUDA").
set -euo pipefail
cd "$(dirname "$0")/.."
features=${FEATURES:-cuda}
source <(bash kernels/toolchain.sh)
mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
cargo build --release --features "$features"
tests=$(cargo test --release --features "$features" --no-run --message-format=json \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"].startswith("cuda_"):
        print(m["executable"])')
rm -f .gpu/*
cp target/release/stepppo .gpu/stepppo
for t in $tests; do cp "$t" ".gpu/$(basename "$t" | sed 's/-[0-9a-f]*$//')"; done
strip .gpu/* 2>/dev/null || true
xz -T2 -6 .gpu/*
ls -la .gpu
