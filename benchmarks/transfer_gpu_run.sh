#!/usr/bin/env bash
# One device-machine call for kvtier-cuda: the GPU tests, then `kvtier bench transfer`.
# Run from the repository root on a machine with an NVIDIA GPU, torch and triton:
#   bash benchmarks/transfer_gpu_run.sh OUTDIR
# No pip install is needed: the packages run from their src/ folders, and their entry points are
# declared through a generated .dist-info so plugin discovery and the `kvtier` CLI work as installed.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/kvtier-gpu}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="bash benchmarks/gpu_python.sh"
{
  nvidia-smi -L
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"

echo "== KVTIER_TEST_DEVICE=cuda python3 -m pytest tests/cuda"
KVTIER_TEST_DEVICE=cuda timeout 300 $PY -m pytest tests/cuda -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest-cuda.log" | tail -n 15

echo "== kvtier bench transfer"
timeout 240 $PY -m kvtier.core.cli bench transfer --out "$OUT" 2>&1 | tee "$OUT/bench.log"
