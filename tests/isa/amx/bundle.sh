#!/usr/bin/env bash
# Packs this machine's CPU test environment for a run on an AMX CPU reached through the workplace's
# device tool (its hosts are AMX Xeons with Python 3.12, no network, and 64 MiB per call): the
# Python 3.11 that `.nox/tests-cpu` was made from, the venv itself (less Triton, numba, OpenCV and
# vLLM's AVX2/AVX-512 kernel builds, which an AMX CPU never loads) and a redis-server with its
# libraries, cut into parts that each fit one call beside the checkout. Writes `.amx/p0..pN`
# (ignored) and prints the venv archive's sha256 for `device.sh setup`. See docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/../../.."
venv=.nox/tests-cpu
py=$(readlink -f "$venv/bin/python")
prefix=$(dirname "$(dirname "$py")")
[ -x "$venv/bin/python" ] || { echo "run 'python3 dev.py test' once first: $venv is missing"; exit 1; }
mkdir -p .git/info && { grep -qsx '/.amx/' .git/info/exclude || echo '/.amx/' >> .git/info/exclude; }
rm -rf .amx/p* .amx/work.* && mkdir -p .amx
# Beside .nox, on its filesystem: the venv's copy below is made of hard links.
work=$(mktemp -d "$PWD/.amx/work.XXXX")
trap 'rm -rf "$work"' EXIT

echo "python runtime from $prefix"
tar -C / -cf - --exclude="${prefix#/}/lib/python3.11/site-packages" \
  --exclude="${prefix#/}/lib/python3.11/test" --exclude="${prefix#/}/lib/python3.11/idlelib" \
  --exclude="${prefix#/}/lib/python3.11/config-3.11-x86_64-linux-gnu" \
  --exclude="${prefix#/}/lib/python3.11/tkinter" --exclude=__pycache__ "${prefix#/}" |
  xz -9 -T0 > "$work/py.tar.xz"

echo "redis-server, redis-cli, redis-benchmark and their libraries"
mkdir -p "$work/redis/bin" "$work/redis/lib"
for b in redis-server redis-cli redis-benchmark; do
  cp "$(readlink -f "$(command -v $b)")" "$work/redis/lib/$b.real"
  # redis-server's binary is redis-check-rdb under another name: argv[0] picks the mode.
  printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")/../lib\nLD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/%s.real" "$@"\n' $b > "$work/redis/bin/$b"
  chmod +x "$work/redis/bin/$b"
done
for l in liblzf.so.1 libjemalloc.so.2 libatomic.so.1; do cp -L "/usr/lib/x86_64-linux-gnu/$l" "$work/redis/lib/"; done
tar -C "$work" -cJf "$work/redis.tar.xz" redis

echo "the venv (a few minutes)"
cp -al "$venv" "$work/venv"
sp="$work/venv/lib/python3.11/site-packages"
rm -rf "$sp"/triton "$sp"/triton-*.dist-info "$sp"/numba "$sp"/numba-*.dist-info "$sp"/llvmlite \
  "$sp"/llvmlite-*.dist-info "$sp"/cv2 "$sp"/opencv_python_headless* "$sp"/vllm/_C_AVX2.abi3.so \
  "$sp"/vllm/_C_AVX512.abi3.so "$sp"/pip "$sp"/pip-*.dist-info
find "$work/venv" -name __pycache__ -type d -prune -exec rm -rf {} +
tar -C "$work" --transform "s,^venv,$venv," -cf - venv | xz -9 -T0 > "$work/venv.tar.xz"

# Part 0 carries the runtime and redis too; every part stays under 64 MiB with the checkout.
mkdir .amx/p0 && mv "$work/py.tar.xz" "$work/redis.tar.xz" .amx/p0/
head -c $((40 * 1024 * 1024)) "$work/venv.tar.xz" > .amx/p0/venv.tar.xz.00
tail -c +$((40 * 1024 * 1024 + 1)) "$work/venv.tar.xz" | split -b 58M -d - "$work/rest."
i=1
for f in "$work"/rest.*; do mkdir ".amx/p$i" && mv "$f" ".amx/p$i/venv.tar.xz.00"; i=$((i + 1)); done
du -sh .amx/p*
echo "sha256 $(sha256sum "$work/venv.tar.xz" | cut -d' ' -f1)"
