#!/usr/bin/env bash
# Build every package's wheel and check, in fresh venvs, that it installs and imports:
#  1. alone: the wheel with only the sibling wheels it needs, given as files (third-party
#     dependencies pinned to the lock file). Proves, for example, that moestack-kernels and
#     moestack-checkpoint work without moestack-train installed.
#  2. as a user installs it: only the wheel is named; its siblings are resolved from its
#     declared dependencies, found only among our built wheels (--find-links), with the public
#     index reachable for everything. A distribution name taken on the index by another project
#     (as `moe-kernels` is) or a missing or stray sibling dependency fails here: the check
#     compares the installed moestack-* distributions with the expected set and checks that each
#     one holds our module.
#  3. the planner without torch: a fresh venv holding only the moestack-plan wheel and its
#     dependencies plans a shipped config with `moe-plan`, serves the page with
#     `moe-plan --serve`, and cannot import torch.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Third-party pins from the lock file (our own packages are not in it), so torch resolves to
# the locked (cached) wheel instead of a fresh download.
uv export --frozen --no-dev --no-emit-workspace --no-hashes -o "$work/constraints.txt" >/dev/null
source scripts/packages.sh  # packages, module_of, wheel_deps
for package in "${packages[@]}"; do
  uv build --quiet --package "$package" --wheel --out-dir "$work/dist" 2>/dev/null
done
wheel_of() { local files=("$work"/dist/"${1//-/_}"-*.whl); echo "${files[0]}"; }

check_venv() {  # venv package mode: import the package; the moestack-* set must be as expected
  local venv=$1 package=$2 mode=$3 expected=("$2" ${wheel_deps[$2]})
  local pairs=()
  for name in "${expected[@]}"; do pairs+=("$name=${module_of[$name]}"); done
  "$venv/bin/python" -W "ignore:Failed to initialize NumPy:UserWarning" - "$package" "$mode" "${pairs[@]}" <<'PY'
import importlib
import importlib.metadata as md
import importlib.util
import sys

package, mode, *pairs = sys.argv[1:]
expected = dict(pair.split("=") for pair in pairs)
module = expected[package]
importlib.import_module(module)
installed = {
    d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].startswith("moestack-")
}
if installed != set(expected):
    sys.exit(f"{package} ({mode}): moestack distributions {sorted(installed)}, expected {sorted(expected)}")
for dist, mod in expected.items():
    files = {str(f) for f in md.distribution(dist).files or ()}
    if f"{mod}/__init__.py" not in files:
        sys.exit(f"{package} ({mode}): distribution {dist} does not hold {mod}: not our wheel")
    version = importlib.import_module(mod).__version__
    if version != md.version(dist):
        sys.exit(f"{package} ({mode}): {mod}.__version__={version}, metadata {md.version(dist)}")
others = {"moe_devices", "moe_kernels", "moe_dispatch", "moe_parallel", "moe_checkpoint", "moe_data",
          "moe_plan", "moe_train"}
others -= set(expected.values())
present = [m for m in sorted(others) if importlib.util.find_spec(m) is not None]
if present:
    sys.exit(f"{package} ({mode}): unexpected moe packages present: {present}")
deps = ", ".join(f"{d} {md.version(d)}" for d in sorted(expected) if d != package) or "none"
print(f"{module} {md.version(package)}: imports ({mode}); moestack siblings: {deps}")
PY
}

for package in "${packages[@]}"; do
  # 1. alone, siblings given as files.
  venv="$work/venv-alone-$package"
  uv venv --quiet --python 3.11 "$venv"
  wheels=()
  for name in $package ${wheel_deps[$package]}; do wheels+=("$(wheel_of "$name")"); done
  uv pip install --quiet --python "$venv/bin/python" -c "$work/constraints.txt" "${wheels[@]}"
  check_venv "$venv" "$package" "alone"
  # 2. the wheel alone, siblings resolved from our wheels only, public index reachable.
  venv="$work/venv-index-$package"
  uv venv --quiet --python 3.11 "$venv"
  start=$SECONDS
  # uv's default index, as set up on this machine (the public one), and our wheels as links.
  uv pip install --quiet --python "$venv/bin/python" --index-strategy first-index \
    --find-links "$work/dist" -c "$work/constraints.txt" "$(wheel_of "$package")"
  check_venv "$venv" "$package" "resolved with the package index, $((SECONDS - start)) s"
done

# 3. The planner without torch: only the moestack-plan wheel and its dependencies.
venv="$work/venv-plan"
uv venv --quiet --python 3.11 "$venv"
wheels=()
for name in moestack-plan ${wheel_deps[moestack-plan]}; do wheels+=("$(wheel_of "$name")"); done
uv pip install --quiet --python "$venv/bin/python" -c "$work/constraints.txt" "${wheels[@]}"
if "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "moestack-plan: torch is importable in a venv of the moe-plan wheel alone" >&2
  exit 1
fi
"$venv/bin/moe-plan" configs/published-47b-a3b.yaml --gpus 8 --gpu b300 >"$work/plan.txt"
grep -q "^this config: " "$work/plan.txt" ||
  { cat "$work/plan.txt" >&2; echo "moestack-plan: moe-plan printed no plan" >&2; exit 1; }
port=$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$venv/bin/moe-plan" --serve --port "$port" >"$work/serve.log" 2>&1 &
server=$!
"$venv/bin/python" - "$port" <<'PY' || { kill "$server"; cat "$work/serve.log" >&2; exit 1; }
import json
import sys
import time
import urllib.request

url = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(300):  # until it listens
    try:
        page = urllib.request.urlopen(f"{url}/", timeout=10).read()
        break
    except OSError:
        time.sleep(0.2)
else:
    sys.exit(f"moestack-plan: moe-plan --serve did not answer at {url}/")
script = urllib.request.urlopen(f"{url}/page.js", timeout=10).read()
request = urllib.request.Request(
    f"{url}/api/plan",
    data=json.dumps({"config": "published-47b-a3b.yaml", "gpu": "b300", "gpus": "8"}).encode(),
    method="POST",
)
answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
if b"<title>moe-plan</title>" not in page or not script or not answer["plan"]["fitting"]:
    sys.exit("moestack-plan: the page of moe-plan --serve is not as expected")
print(f"moe_plan: plans and serves its page without torch ({len(page)} bytes of page)")
PY
kill "$server"
wait "$server" 2>/dev/null || true
