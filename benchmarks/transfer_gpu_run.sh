#!/usr/bin/env bash
# One device-machine call for kvtier-cuda: the GPU tests (tests/cuda, and the page mover
# conformance suite's CUDA subjects), then `kvtier bench transfer` (extra arguments go to it).
# Run from the repository root on a machine with an NVIDIA GPU, torch and triton:
#   bash benchmarks/transfer_gpu_run.sh OUTDIR [BENCH ARGS...]
# No pip install is needed: the packages run from their src/ folders, and their entry points are
# declared through a generated .dist-info so plugin discovery and the `kvtier` CLI work as installed.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/kvtier-gpu}}
shift || true
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVTIER_TEST_DEVICE=cuda
PY="bash benchmarks/gpu_python.sh"
{
  nvidia-smi -L
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"

echo "== pytest tests/cuda"
timeout 90 $PY -m pytest tests/cuda -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest-cuda.log" | tail -n 15

# One pinned arena serves the whole session: the CUDA subjects take 1.5-2 minutes on an H100.
echo "== pytest tests/conformance/test_page_mover.py -k cuda"
timeout 420 $PY -m pytest tests/conformance/test_page_mover.py -k cuda -q -p no:cacheprovider 2>&1 \
  | tee "$OUT/pytest-conformance.log" | tail -n 15

echo "== kvtier bench transfer"
timeout 150 $PY -m kvtier.core.cli bench transfer --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
