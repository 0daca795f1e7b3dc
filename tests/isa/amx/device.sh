#!/usr/bin/env bash
# Device side of the AMX run (bundle.sh packs what it needs). One device call each, in order,
# with no pause between calls (an idle machine goes back after 30 s, and a fresh one is bare):
#   bash tests/isa/amx/device.sh info && bash tests/isa/amx/device.sh part 0   (carry .amx/p0)
#   bash tests/isa/amx/device.sh part N                                        (carry .amx/pN)
#   bash tests/isa/amx/device.sh setup SHA256 && bash tests/isa/amx/device.sh start &&
#     bash tests/isa/amx/device.sh wait 480                                    (last part too)
#   bash tests/isa/amx/device.sh wait 540                                      (until done)
# The CPU suite runs as four pytest processes on four cores each (vLLM's tests in three,
# everything else and then `kvtier demo` in the fourth), in a new session so it outlives a call;
# every `wait` copies the logs (one line per test) and the demo's results to $OUT/amx.
set -uo pipefail
ROOT=$(pwd)
A=/tmp/amx
mkdir -p $A
case "${1:-}" in
info)
  echo "checkout at $ROOT"; nproc; python3 --version
  grep -o -w 'amx_tile\|amx_bf16\|avx512_bf16\|avx512f\|avx2' /proc/cpuinfo | sort | uniq -c
  tar -C / -xJf .amx/p0/py.tar.xz && mkdir -p /opt && tar -C /opt -xJf .amx/p0/redis.tar.xz
  /opt/redis/bin/redis-server --version
  ;;
part)
  cat ".amx/p$2"/venv.tar.xz.* >> $A/venv.tar.xz && ls -l $A/venv.tar.xz
  ;;
setup)
  echo "$2  $A/venv.tar.xz" | sha256sum -c - || exit 3
  rm -rf .nox/tests-cpu && tar -C "$ROOT" -xJf $A/venv.tar.xz && rm -f $A/venv.tar.xz
  # The venv's editable installs name /work/main/packages/...: the checkout must answer there.
  if [ "$ROOT" != /work/main ]; then mkdir -p /work && ln -sfn "$ROOT" /work/main; fi
  .nox/tests-cpu/bin/python -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__, "amx", torch.cpu._is_amx_tile_supported())'
  ;;
start)
  setsid nohup bash "$0" suite > $A/suite.log 2>&1 < /dev/null &
  sleep 1; echo started
  ;;
suite)
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_INTERPRET=1 KVTIER_TEST_DEVICE=cpu
  export PATH=/work/main/.nox/tests-cpu/bin:/opt/redis/bin:$PATH
  cd /work/main
  mapfile -t F < <(ls tests/vllm_integration/test_*.py | sort)
  g0=() g1=() g2=()
  for i in "${!F[@]}"; do case $((i % 3)) in 0) g0+=("${F[$i]}") ;; 1) g1+=("${F[$i]}") ;; 2) g2+=("${F[$i]}") ;; esac; done
  run() { # group cores pytest-args...
    local n=$1 c=$2; shift 2
    VLLM_CPU_OMP_THREADS_BIND=$c OMP_NUM_THREADS=4 VLLM_CACHE_ROOT=$A/vllm-cache-$n \
      python -m pytest -v -ra -p no:cacheprovider --basetemp="$A/tmp-$n-$RANDOM" "$@" >> $A/$n.log 2>&1
    echo "$n $* rc=$?" >> $A/status
  }
  run v0 0-3 "${g0[@]}" &
  run v1 4-7 "${g1[@]}" &
  run v2 8-11 "${g2[@]}" &
  # tests/test_install.py is left out: it resolves installs with pip against this machine's wheels.
  ( for d in tests/conformance tests/core tests/storage tests/xpu tests/cuda; do run other 12-15 "$d"; done
    VLLM_CPU_OMP_THREADS_BIND=12-15 kvtier demo --out $A/demo >> $A/demo.log 2>&1
    echo "demo rc=$?" >> $A/status ) &
  wait
  touch $A/all.done
  ;;
wait)
  end=$((SECONDS + $2))
  while [ $SECONDS -lt $end ] && [ ! -f $A/all.done ]; do sleep 15; done
  date; cat $A/status 2>/dev/null
  for f in $A/v?.log $A/other.log; do [ -f "$f" ] && echo "$f: $(grep -c ' PASSED' "$f") passed, $(grep -c ' FAILED\| ERROR' "$f") failed"; done
  mkdir -p "$OUT/amx"
  cp $A/v?.log $A/other.log $A/status $A/demo.log "$OUT/amx/" 2>/dev/null
  cp $A/demo/demo.json $A/demo/demo.png "$OUT/amx/" 2>/dev/null
  ;;
*) echo "usage: device.sh info|part N|setup SHA256|start|wait SECONDS"; exit 2 ;;
esac
