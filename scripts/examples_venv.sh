#!/usr/bin/env bash
# Creates target/examples-venv with the Python packages of examples/requirements.txt (gymnasium,
# the official `openai` client, the Parquet readers). Tests that drive the examples use
# `$STEPPPO_PYTHON` when set, else this venv's python when it exists, and skip with a message
# otherwise (a failure under STEPPPO_REQUIRE_PYTHON=1, which .ci/run sets). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/examples-venv
stamp="$venv/.requirements"
if [ -x "$venv/bin/python" ] && cmp -s examples/requirements.txt "$stamp"; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check -r examples/requirements.txt
cp examples/requirements.txt "$stamp"
echo "examples venv ready: $venv/bin/python"
