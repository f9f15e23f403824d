#!/usr/bin/env bash
# One H200 call for the persistent warp-specialized down (moe_down_ws): the MoE GPU tests, then the MoE probe at 1024
# and 4096 tokens with EXL3MOE_MOE_WS_DOWN=0 and 1. Log in $OUT/moe_down_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 EXL3MOE_FIXTURES="${EXL3MOE_FIXTURES:-$PWD/.fixtures}"
export EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
{
for ws in ${DOWN_WS_VALUES:-0 1}; do
  EXL3MOE_MOE_WS_DOWN=$ws timeout 120 python3 scripts/moe_probe.py --tokens 1024 4096 2>&1 | grep -E "T=|Error|error" | sed "s/^/[down ws=$ws] /"
done
timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_gpu.py 2>&1 | tail -4
} > "$OUT/moe_down_check.log" 2>&1
cut -c1-220 "$OUT/moe_down_check.log"
