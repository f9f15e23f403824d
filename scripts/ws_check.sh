#!/usr/bin/env bash
# One H200 call for trellis_ws (the warp-specialized 128-row linear): a quick bytes check against trellis_mma, the GPU
# tests of the linear's 65-128-row paths, then the probe over shapes and splits per block.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 EXL3MOE_FIXTURES="${EXL3MOE_FIXTURES:-$PWD/.fixtures}"
export EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
timeout 120 python3 scripts/ws_probe.py --shapes 4096x1408 --rows 100 --spb 0 3 || exit 1
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_linear_gpu.py \
  -k "warp_specialized or row_bytes or full_shape or graph" 2>&1 | tail -3
timeout 200 python3 scripts/ws_probe.py --rows 65 128 --spb 0 1 2 4
