#!/usr/bin/env bash
# The GPU check, for a lent GPU machine (no uv, no downloads there): runs the gpu-marked tests
# and the GPU benchmarks from source on the machine's own torch, and prints one table.
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:)"
mkdir -p bench_results
status=0
echo "== environment"
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PY
echo "== gpu-marked tests"
# moe-train tests need pyyaml, absent there: the kernel and dispatch packages are checked here.
python -m pytest -q -m gpu tests/moe_kernels tests/moe_dispatch -p no:cacheprovider || status=1
echo "== rowwise dispatch on one GPU (sync-free check, latency vs all_to_all)"
timeout 120 python benchmarks/gpu_dispatch.py --out bench_results/gpu_dispatch.json || status=1
echo "== MoE layer fwd+bwd: no host sync (torch, triton, mxfp8 paths), time vs dense"
timeout 180 python benchmarks/gpu_moe_layer.py --out bench_results/gpu_moe_layer.json || status=1
echo "== grouped GEMM TFLOP/s: triton vs torch vs per-expert loop vs dense bf16 (autotunes first)"
timeout 240 python benchmarks/grouped_mm_backends.py --shapes 16384,64,2048,1408 32768,8,4096,2048 \
    --json bench_results/grouped_mm_backends.json || status=1
exit $status
