#!/usr/bin/env bash
# One call on the H200: GPU tests, then the named benchmarks ("linear.py --args", "moe.py"); JSON and logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
# pytest-xdist where the image lacks it: unpack its wheel and execnet's into .pydeps here and carry that folder.
[ -d .pydeps ] && export PYTHONPATH=src:$PWD/.pydeps
WORKERS=${WORKERS:+-n $WORKERS --dist load}   # WORKERS=6: GPU tests in six processes (compiles run in parallel)
export EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"  # compiled CUDA kernels, kept between calls
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR-$PWD/.triton_cache}"     # compiled Triton kernels, the same way
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=12 $WORKERS ${GPU_TESTS:-tests} \
    2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error|^[0-9.]+s (call|setup)" | tail -30
fi
for b in "$@"; do
  script=${b%% *}
  name=${script%.py}
  timeout "${BENCH_TIMEOUT:-400}" python3 bench/$b --out "$OUT/${name}_h200.json" 2>&1 | tee "$OUT/$name.log" \
    | grep -v "^\s*$" | tail -40
done
# The cache and its noted variants, for scripts/warm_cache.py: a cold machine then skips the compiles.
[ -n "$EXL3MOE_CACHE_DIR" ] && [ -d "$EXL3MOE_CACHE_DIR" ] && tar czf "$OUT/kernel_cache.tgz" -C "$EXL3MOE_CACHE_DIR" .
[ -d "$TRITON_CACHE_DIR" ] && tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" .
