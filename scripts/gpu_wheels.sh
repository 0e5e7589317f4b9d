#!/usr/bin/env bash
# Download, here, the wheels the lent GPU machine lacks into gpu_wheels/ (ignored by git), for
# CPython 3.11 and 3.12 on linux x86_64. That machine cannot download; pass `gpu_wheels` in the
# device run tool's `carry` and benchmarks/gpu_check.sh installs, offline, each one whose
# distribution the machine does not already have (never touching its torch).
#   bash scripts/gpu_wheels.sh            # then: carry ["gpu_wheels"], bash benchmarks/gpu_check.sh
#
# The GPU machine is known to have torch, triton, numpy, safetensors, pytest, cuda-bindings,
# cuda-core, cuda-pathfinder and nvidia-nvshmem-cu13 (see shared/DESIGN.md); those are not
# carried. Carried: pyyaml (moe-train's config; the machine may or may not have it) and
# nvshmem4py-cu13 (the nvshmem rowwise transport) with cuda-pathfinder as a fallback, at the
# versions uv.lock pins. Everything that travels to the device (working tree and carried paths)
# must stay under 64 MiB, so this script fails above LIMIT_MIB of wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=gpu_wheels
LIMIT_MIB=${LIMIT_MIB:-48}
PYTHONS=(3.11 3.12)
# distribution, the module the GPU check imports (to decide whether to install), fallback pin.
WHEELS=(
  "pyyaml yaml 6.0.4"
  "nvshmem4py-cu13 nvshmem 0.4.1"
  "cuda-pathfinder cuda.pathfinder 1.9.1"
)

locked_version() {  # the version uv.lock pins for distribution $1, or nothing
  awk -v name="$1" '
    $0 == "[[package]]" { in_pkg = 1; found = 0; next }
    in_pkg && $0 == "name = \"" name "\"" { found = 1; next }
    in_pkg && found && /^version = / { gsub(/"/, "", $3); print $3; exit }
  ' uv.lock
}

if python3 -m pip --version >/dev/null 2>&1; then
  pip=(python3 -m pip)
else
  pip=(uvx pip)
fi

rm -rf "$OUT"
mkdir -p "$OUT"
: >"$OUT/wheels.txt"
for entry in "${WHEELS[@]}"; do
  read -r dist module pin <<<"$entry"
  version=$(locked_version "$dist")
  version=${version:-$pin}
  for py in "${PYTHONS[@]}"; do
    # --no-deps: the machine has what these need (numpy, Cython, cuda-core, cuda-bindings and
    # the nvshmem library); a second copy of any of those would shadow its own.
    "${pip[@]}" download --quiet --no-deps --only-binary=:all: --implementation cp \
      --python-version "$py" --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --dest "$OUT" "$dist==$version"
  done
  echo "$dist $module $version" >>"$OUT/wheels.txt"
done

wheel_bytes=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
tree_bytes=$( (git ls-files -z; git ls-files -z --others --exclude-standard) \
  | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" { sum += $1 } END { print sum + 0 }')
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
ls -l "$OUT"
echo "wheels $(mib "$wheel_bytes"); working tree $(mib "$tree_bytes"); together" \
  "$(mib $((wheel_bytes + tree_bytes))) of the 64 MiB that may travel"
if ((wheel_bytes > LIMIT_MIB * 1048576)); then
  echo "error: $OUT holds $(mib "$wheel_bytes"), over LIMIT_MIB=$LIMIT_MIB" >&2
  exit 1
fi
