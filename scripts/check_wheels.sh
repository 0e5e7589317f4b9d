#!/usr/bin/env bash
# Build every package's wheel and install each alone into a fresh venv with only its
# declared dependencies (pinned to the lock file), then import it there. Proves, for
# example, that moe-kernels and moe-checkpoint work without moe-train installed.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
uv export --frozen --no-dev --no-emit-workspace --no-hashes -o "$work/constraints.txt" >/dev/null
declare -A wheel_deps=(
  [moe-kernels]=""
  [moe-checkpoint]=""
  [moe-dispatch]="moe-kernels"
  [moe-parallel]="moe-kernels moe-dispatch"
  [moe-train]="moe-kernels moe-dispatch moe-parallel moe-checkpoint"
)
for package in moe-kernels moe-checkpoint moe-dispatch moe-parallel moe-train; do
  uv build --quiet --package "$package" --wheel --out-dir "$work/dist" 2>/dev/null
done
for package in moe-kernels moe-checkpoint moe-dispatch moe-parallel moe-train; do
  module=${package//-/_}
  venv="$work/venv-$package"
  uv venv --quiet --python 3.11 "$venv"
  wheels=()
  for name in $package ${wheel_deps[$package]}; do
    wheels+=("$work"/dist/${name//-/_}-*.whl)
  done
  uv pip install --quiet --python "$venv/bin/python" -c "$work/constraints.txt" "${wheels[@]}"
  "$venv/bin/python" - "$module" <<'PY'
import importlib
import importlib.util
import sys

module = sys.argv[1]
importlib.import_module(module)
others = {"moe_kernels", "moe_dispatch", "moe_parallel", "moe_checkpoint", "moe_train"} - {module}
present = [m for m in sorted(others) if importlib.util.find_spec(m) is not None]
print(f"{module}: imports alone; other moe packages present: {present or 'none'}")
PY
done
