#!/usr/bin/env bash
# Device side of the AMX run (bundle.sh packs what it needs). One device call each, in order,
# with no pause between calls (an idle machine goes back after 30 s, and a fresh one is bare):
#   bash tests/isa/amx/device.sh info && bash tests/isa/amx/device.sh part 0   (carry .amx/p0)
#   bash tests/isa/amx/device.sh part N                                        (carry .amx/pN)
#   bash tests/isa/amx/device.sh setup SHA256 && bash tests/isa/amx/device.sh start &&
#     bash tests/isa/amx/device.sh wait 480                                    (last part too)
#   bash tests/isa/amx/device.sh wait 540                                      (until done)
# or, after setup, a rerun of chosen tests: bash tests/isa/amx/device.sh some SECONDS TARGET...
# The CPU suite runs as eight pytest processes on two cores each (see `suite`), in a new session
# so it outlives a call; every `wait` writes a summary and the logs (one line per test) and the
# demo's results, packed, to $OUT/amx.
set -uo pipefail
ROOT=$(pwd)
A=/tmp/amx
mkdir -p $A
# What every test run here needs: offline, CPU only, the unpacked venv and redis first on PATH,
# from the checkout the venv's editables name.
test_env() {
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_INTERPRET=1 KVTIER_TEST_DEVICE=cpu
  export PATH=/work/main/.nox/tests-cpu/bin:/opt/redis/bin:$PATH
  cd /work/main || exit 1
}
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
  test_env
  run() { # group cores pytest-args...
    local n=$1 c=$2; shift 2
    VLLM_CPU_OMP_THREADS_BIND=$c OMP_NUM_THREADS=2 VLLM_CACHE_ROOT=$A/vllm-cache-$n \
      python -m pytest -v -ra -p no:cacheprovider --basetemp="$A/tmp-$n" "$@" < /dev/null >> $A/$n.log 2>&1
    echo "$n $* rc=$?" >> $A/status
  }
  # vLLM's tests in 7 groups of 2 cores (the CPU suite's own machine has 2), balanced by the
  # seconds each file took there (durations.txt); everything else, then the demo, on the last 2.
  python3 - 7 tests/isa/amx/durations.txt > $A/groups.txt <<'PY'
import pathlib, sys
n, weights = int(sys.argv[1]), {}
for line in open(sys.argv[2]):
    if not line.startswith("#"):
        secs, path = line.split()
        weights[path] = float(secs)
files = [str(p) for p in sorted(pathlib.Path("tests/vllm_integration").glob("test_*.py"))]
loads, groups = [0.0] * n, [[] for _ in range(n)]
for f in sorted(files, key=lambda f: -weights.get(f, 30.0)):
    i = loads.index(min(loads))
    loads[i] += weights.get(f, 30.0)
    groups[i].append(f)
for g in groups:
    print(" ".join(g))
PY
  i=0
  while read -r files; do
    # shellcheck disable=SC2086
    run v$i $((2 * i))-$((2 * i + 1)) $files &
    i=$((i + 1))
  done < $A/groups.txt
  # tests/test_install.py is left out: it resolves installs with pip against this machine's wheels.
  ( for d in tests/conformance tests/core tests/storage tests/xpu tests/cuda; do run other 14-15 "$d"; done
    VLLM_CPU_OMP_THREADS_BIND=14-15 kvtier demo --out $A/demo >> $A/demo.log 2>&1
    echo "demo rc=$?" >> $A/status ) &
  wait
  touch $A/all.done
  ;;
wait)
  end=$((SECONDS + $2))
  while [ $SECONDS -lt $end ] && [ ! -f $A/all.done ]; do sleep 15; done
  mkdir -p "$OUT/amx"
  { date; [ -f $A/all.done ] && echo "all done" || echo "still running"; cat $A/status 2>/dev/null
    for f in $A/v?.log $A/other.log; do
      [ -f "$f" ] && echo "$(basename "$f"): $(grep -c ' PASSED' "$f") passed, $(grep -c ' FAILED\| ERROR' "$f") failed or errors"
    done
    grep -h ' FAILED\| ERROR' $A/v?.log $A/other.log 2>/dev/null | head -40; } | tee "$OUT/amx/summary.txt"
  (cd $A && tar -czf "$OUT/amx/logs.tar.gz" ./*.log status groups.txt demo 2>/dev/null)
  ;;
some)
  # A rerun of chosen tests after setup: `some SECONDS TARGET...`, each target (a pytest
  # argument; quote several as one) in its own group of two cores, for at most SECONDS.
  limit=$2; shift 2
  test_env
  mkdir -p "$OUT/amx" && i=0
  for t in "$@"; do
    # shellcheck disable=SC2086
    VLLM_CPU_OMP_THREADS_BIND=$((2 * i))-$((2 * i + 1)) OMP_NUM_THREADS=2 VLLM_CACHE_ROOT=$A/vc-s$i \
      timeout "$limit" python -m pytest -q -ra -p no:cacheprovider --basetemp="$A/s$i" $t \
      < /dev/null > "$A/s$i.log" 2>&1 &
    i=$((i + 1))
  done
  wait
  for f in $A/s[0-9]*.log; do echo "== $f"; tail -n 6 "$f"; done | tee "$OUT/amx/some.txt"
  ;;
*) echo "usage: device.sh info|part N|setup SHA256|start|wait SECONDS|some SECONDS TARGET..."; exit 2 ;;
esac
