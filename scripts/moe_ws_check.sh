#!/usr/bin/env bash
# One H200 call for the MoE's warp-specialized gate/up (wip/moe-ws): the linear and MoE GPU tests in full, then the
# MoE probe at 1024 and 4096 tokens with EXL3MOE_MOE_WS=0 and 1. Log in $OUT/moe_ws_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
export EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
{
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_linear_gpu.py 2>&1 | tail -2
timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_gpu.py 2>&1 | tail -2
timeout 150 python3 scripts/ws_probe.py --rows 128 --spb 0 2>&1 | grep -v "^$" | tail -12
for ws in 0 1; do
  EXL3MOE_MOE_WS=$ws timeout 120 python3 scripts/moe_probe.py --tokens 1024 4096 2>&1 | grep "T=" | sed "s/^/[ws=$ws] /"
done
} > "$OUT/moe_ws_check.log" 2>&1
cut -c1-220 "$OUT/moe_ws_check.log"
