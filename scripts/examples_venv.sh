#!/usr/bin/env bash
# Creates target/examples-venv with the Python packages of examples/requirements.txt (gymnasium,
# the official `openai` client, the Parquet readers) and examples/requirements-hubs.txt (the env
# hubs served by examples/gem_env_server.py, textarena_env_server.py and textworld_env_server.py:
# about 700 MB and 1.5 min more, so only with STEPPPO_EXAMPLES_HUBS=1, which .ci/run sets for
# tests/env_hubs.rs). Tests that drive the
# examples use `$STEPPPO_PYTHON` when set, else this venv's python when it exists, and skip with a
# message otherwise (a failure under STEPPPO_REQUIRE_PYTHON=1, which .ci/run sets). Idempotent:
# the venv is rebuilt only when the requirement files it was made from change.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/examples-venv
stamp="$venv/.requirements"
reqs=(examples/requirements.txt)
if [ "${STEPPPO_EXAMPLES_HUBS:-0}" = 1 ]; then
  reqs+=(examples/requirements-hubs.txt)
fi
if [ -x "$venv/bin/python" ] && cat "${reqs[@]}" | cmp -s - "$stamp"; then
  exit 0
fi
python3 -m venv "$venv"
pip_args=()
for req in "${reqs[@]}"; do
  pip_args+=(-r "$req")
done
"$venv/bin/pip" install --quiet --disable-pip-version-check "${pip_args[@]}"
cat "${reqs[@]}" >"$stamp"
echo "examples venv ready: $venv/bin/python"
