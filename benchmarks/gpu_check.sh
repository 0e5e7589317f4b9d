#!/usr/bin/env bash
# The GPU check, for a lent GPU machine (no uv, no downloads there): the gpu-marked tests, the
# GPU benchmarks and a training run of a ~1B-parameter MoE (benchmarks/gpu_train_check.py), from
# source on the machine's own torch. Prints one table at the end (check, result, figure) and
# writes bench_results/gpu_check.json; exits 1 if any part failed or ran out of time.
#   here:   bash scripts/gpu_wheels.sh              # pyyaml and nvshmem4py wheels -> gpu_wheels/
#   there:  bash benchmarks/gpu_check.sh            # device run with carry ["gpu_wheels"]
#   CI:     uv run bash benchmarks/gpu_check.sh --device cpu   # dry run, tiny sizes, < 1 min
# Each part runs under a time limit (LIMITS below); on the GPU they add up to 500 s, so the
# whole check fits in 9 minutes. Wheels in gpu_wheels/ are installed (offline, without their
# dependencies) into a folder of their own only where the machine lacks their module.
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda
case "${1:-}" in
  "") ;;
  --device) device=${2:-} ;;
  --device=*) device=${1#--device=} ;;
  *) device=invalid ;;
esac
if [[ $device != cuda && $device != cpu ]]; then
  echo "usage: bash benchmarks/gpu_check.sh [--device cuda|cpu]" >&2
  exit 2
fi
python=${PYTHON:-python3}
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)" PYTHONUNBUFFERED=1
mkdir -p bench_results/logs
status=0

# LIMITS, seconds: tests, gpu_dispatch, gpu_moe_layer, grouped_mm_backends, gpu_train_check
# (which starts no row after its --budget-s). Environment and installs take ~15 s more.
limit_tests=90 limit_dispatch=40 limit_moe_layer=75 limit_gemm=45 limit_train=250 budget_train=220

echo "== environment"
if [[ $device == cuda ]]; then
  site=/tmp/moe-stack-site
  if [[ -f gpu_wheels/wheels.txt ]]; then
    missing=()
    while read -r dist module version; do
      "$python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$module') is None)" \
        2>/dev/null || missing+=("$dist==$version")
    done <gpu_wheels/wheels.txt
    if ((${#missing[@]})); then
      echo "installing from gpu_wheels/ into $site: ${missing[*]}"
      PIP_ROOT_USER_ACTION=ignore "$python" -m pip install --quiet --no-index --no-deps \
        --find-links gpu_wheels --no-compile --no-cache-dir --upgrade --target "$site" \
        "${missing[@]}" || status=1
    fi
  else
    echo "no gpu_wheels/ (run scripts/gpu_wheels.sh here and carry gpu_wheels): moe-train" \
      "needs pyyaml, the nvshmem rows nvshmem4py"
  fi
  export PYTHONPATH="$PYTHONPATH:$site"
fi
"$python" - "$device" <<'PY'
import importlib.metadata as metadata
import sys

if sys.argv[1] == "cuda":
    import torch

    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
else:
    print("cpu: the dry run (tiny sizes; the CUDA-only checks are skipped)")
versions = []
for name in ("torch", "triton", "pyyaml", "nvshmem4py-cu13", "nvidia-nvshmem-cu13", "cuda-core",
             "cuda-bindings", "cuda-pathfinder"):
    try:
        versions.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        versions.append(f"{name} -")
print(", ".join(versions))
PY

parts=bench_results/gpu_check_parts.tsv
: >"$parts"
part() {  # part ID NAME LIMIT JSON COMMAND...: run with a time limit, log, add a row to $parts
  local id=$1 name=$2 limit=$3 json=$4
  shift 4
  local log=bench_results/logs/$id.log began=$SECONDS
  echo "== $name (limit $limit s)"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - began)) "$json" "$log" >>"$parts"
}
skipped_on_cpu() { printf '%s\tcpu\t0\t-\t-\n' "$1" >>"$parts"; }

if [[ $device == cuda ]]; then
  part tests "gpu-marked tests (moe_kernels, moe_dispatch)" $limit_tests - \
    "$python" -m pytest -q -m gpu tests/moe_kernels tests/moe_dispatch -p no:cacheprovider \
    -o addopts="-ra --strict-markers"  # in this process: the GPU machine has no pytest-xdist
  part dispatch "gpu_dispatch.py (rowwise sync-free, vs all_to_all)" $limit_dispatch \
    bench_results/gpu_dispatch.json \
    "$python" benchmarks/gpu_dispatch.py --out bench_results/gpu_dispatch.json
  part moe_layer "gpu_moe_layer.py (MoE layer sync-free, vs dense)" $limit_moe_layer \
    bench_results/gpu_moe_layer.json \
    "$python" benchmarks/gpu_moe_layer.py --out bench_results/gpu_moe_layer.json
  # One shape, to fit the 8 minutes; gpu_train_check times the trained model's.
  part gemm "grouped_mm_backends.py (16384,64,2048,1408)" $limit_gemm \
    bench_results/grouped_mm_backends.json \
    "$python" benchmarks/grouped_mm_backends.py --shapes 16384,64,2048,1408 --reps 5 \
    --warmup 2 --json bench_results/grouped_mm_backends.json
else
  # The gpu-marked tests all skip without CUDA; CI's own pytest run collects them.
  skipped_on_cpu "gpu-marked tests (moe_kernels, moe_dispatch)"
  part dispatch "gpu_dispatch.py (cpu dry run)" $limit_dispatch bench_results/gpu_dispatch.json \
    "$python" benchmarks/gpu_dispatch.py --device cpu --tokens 256 --dim 64 --experts 8 \
    --top-k 2 --steps 2 --out bench_results/gpu_dispatch.json
  part moe_layer "gpu_moe_layer.py (cpu dry run)" $limit_moe_layer \
    bench_results/gpu_moe_layer.json \
    "$python" benchmarks/gpu_moe_layer.py --cpu-smoke --out bench_results/gpu_moe_layer.json
  part gemm "grouped_mm_backends.py (cpu dry run)" $limit_gemm \
    bench_results/grouped_mm_backends.json \
    "$python" benchmarks/grouped_mm_backends.py --shapes 256,4,64,64 --dtypes float32 --reps 1 \
    --warmup 1 --json bench_results/grouped_mm_backends.json
fi

echo "== gpu_train_check.py: train ~1B MoE (bf16, fp8_rowwise), sync-free steps, grouped GEMMs" \
  "(bf16, fp8_rowwise), transports, nvshmem"
timeout --kill-after=5 $limit_train "$python" benchmarks/gpu_train_check.py --device "$device" \
  --budget-s $budget_train --parts "$parts" --out bench_results/gpu_check.json
rc=$?
if ! [[ bench_results/gpu_check.json -nt $parts ]]; then
  echo "gpu_train_check.py (exit $rc; 124: stopped at its $limit_train s) printed no table;" \
    "the other parts (check, exit status, seconds, JSON, log):"
  cat "$parts"
fi
((rc == 0)) || status=1
exit $status
