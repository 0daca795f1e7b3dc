#!/usr/bin/env bash
# One device-machine call for kvtier-cuda: the GPU test run, then `kvtier bench transfer`.
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

echo "== host stages of one call (small shape, no profiler)"
timeout 60 $PY benchmarks/transfer_host_timeline.py --shape small --chunks 16 2>&1 | tee "$OUT/host-timeline.log"

echo "== device timeline of one call per shape"
timeout 90 $PY benchmarks/transfer_trace.py "$OUT/trace-driver" 2>&1 | tee "$OUT/trace-driver.log"
# (KVTIER_CUDA_DRIVER_API=0 gives the same timeline for the torch path.)
timeout 90 $PY benchmarks/transfer_trace.py "$OUT/trace-driver" --shapes small --stream 4 2>&1 | tee "$OUT/trace-stream.log"
# A store and a load from two threads started together (an engine's saver and forward threads).
timeout 60 $PY benchmarks/transfer_trace.py "$OUT/trace-driver" --shapes small --only threads 2>&1 | tee "$OUT/trace-threads.log"
rm -rf "$OUT/trace-driver"  # the chrome traces are large; the logs keep the timelines

echo "== each call's recorded device work replayed without Python planning"
timeout 120 $PY benchmarks/transfer_replay.py small:16 small:64 8b:16 --rounds 12 --out "$OUT" 2>&1 | tee "$OUT/replay.log"

echo "== kvtier bench transfer"
timeout 240 $PY -m kvtier.core.cli bench transfer --out "$OUT" 2>&1 | tee "$OUT/bench.log"

echo "== kvtier bench transfer --shapes small --chunks 64 (a 16k-token prefix in one call)"
timeout 150 $PY -m kvtier.core.cli bench transfer --shapes small --chunks 64 \
  --suffix small-64chunks --out "$OUT" 2>&1 | tee "$OUT/bench-small-64chunks.log" | tail -n 20

echo "== store_and_load_async start-up orders, one call and a stream (A/B on one connector)"
timeout 150 $PY benchmarks/transfer_both_ab.py small:16 small:64 --rounds 20 --out "$OUT" 2>&1 | tee "$OUT/both-ab.log"

echo "== driver calls through the C op runner or ctypes, one call and a stream (A/B on one connector)"
timeout 150 $PY benchmarks/transfer_ops_ab.py small:16 small:64 --rounds 16 --out "$OUT" 2>&1 | tee "$OUT/ops-ab.log"
