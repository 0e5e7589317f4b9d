#!/usr/bin/env bash
# Install OLMo-core as an overlay on the project's environment, for benchmarks/olmo_core_compare.py.
#
# OLMo-core 3.0.0 pins torch<2.14; this project runs a newer torch. So that both import in one
# process on the project's torch, the overlay holds only what the project's environment lacks:
# every package already installed there (torch included) is excluded from the resolution, and
# the rest go to an ignored folder that the benchmark puts first on PYTHONPATH. The project's
# environment itself is not touched.
#
#   scripts/olmo_core_env.sh            # installs into .cache/olmo-core
#   PYTHONPATH=.cache/olmo-core uv run --no-sync python benchmarks/olmo_core_compare.py
set -euo pipefail

cd "$(dirname "$0")/.."
version="${OLMO_CORE_VERSION:-3.0.0}"
target="${OLMO_CORE_TARGET:-.cache/olmo-core}"
python=".venv/bin/python"

excludes="$(mktemp)"
trap 'rm -f "$excludes"' EXIT
uv pip list --python "$python" --format json \
    | "$python" -c 'import json, sys; print("\n".join(p["name"] for p in json.load(sys.stdin)))' \
    >"$excludes"

rm -rf "$target"
uv pip install --python "$python" --target "$target" --excludes "$excludes" \
    "ai2-olmo-core==$version"
echo "installed ai2-olmo-core==$version into $target (torch and the rest from $python)"
