#!/usr/bin/env bash
# One H200 call for trellis_ws (the warp-specialized 128-row linear): a quick bytes check against trellis_mma, the GPU
# tests of the linear's 65-128-row paths, the probe over shapes and splits per block; EXTRA_DEFINES="A=1,B=2" times a
# variant beside it, NCU=1 adds the per-instruction stall table of the large shape. Log in $OUT/ws_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
export EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
{
timeout 120 python3 scripts/ws_probe.py --shapes 4096x1408 --rows 100 --spb 0 3 || exit 1
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_linear_gpu.py \
  -k "warp_specialized or row_bytes or full_shape or graph" 2>&1 | tail -3
timeout 200 python3 scripts/ws_probe.py --rows 65 128 --spb ${SPB:-0 1}
if [ -n "${EXTRA_DEFINES:-}" ]; then
  EXL3MOE_NVRTC_DEFINES="$EXTRA_DEFINES" timeout 120 python3 scripts/ws_probe.py --shapes 4096x14336 2048x768 \
    --rows 128 --spb 0 --skip-mma | sed "s/^/[$EXTRA_DEFINES] /"
fi
if [ -n "${NCU:-}" ]; then bash scripts/ncu_source.sh 128 'trellis_ws$' 2>&1; fi
} > "$OUT/ws_check.log" 2>&1
grep -E "passed|failed|error|rows|Duration" "$OUT/ws_check.log"
