#!/usr/bin/env bash
# One H200 call for wip/dense-epilogue: the GPU tests of the > 128-row path, the probe of its pieces, the benchmark
# at 512 rows (JSON under $OUT, to merge into bench/results/linear_h200.json).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
export EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_linear_gpu.py -k "full_shape or graph or dense" \
  2>&1 | tail -2
python3 scripts/dense_probe.py --ktiles 4 2>&1 | tail -3
timeout 200 python3 bench/linear.py --rows 512 --out "$OUT/linear_h200.json" 2>&1 | grep -E "K4 (mcg|mul1)"
