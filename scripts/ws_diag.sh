#!/usr/bin/env bash
# One H200 call: where the warp-specialized kernels' time goes. For each WS_DIAG value in $DIAGS (trellis_ws.cuh:
# timing-only builds that leave parts out, 0 the real kernel; "A=1,B=2" a define set as it is), the linear
# 4096x14336 and 14336x4096 K4 MCG at 128 rows and the MoE probe (Qwen3 K4, 1024 tokens). Build the variants first:
# scripts/note_ws_diag.py $DIAGS, then scripts/warm_cache.py (same EXL3MOE_CACHE_DIR).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
for diag in ${DIAGS:-0 1 2 4 15 31 47}; do
  defines=$(case "$diag" in 0) echo "";; *=*) echo "$diag";; *) echo "WS_DIAG=$diag";; esac)
  echo "== WS_DIAG=$diag"
  EXL3MOE_NVRTC_DEFINES=$defines timeout 60 python3 bench/linear.py --shapes 4096x14336 14336x4096 --bits 4 \
    --codebooks mcg --rows 128 --out "$OUT/ws_diag_linear.json" 2>&1 | grep rows
  EXL3MOE_NVRTC_DEFINES=$defines timeout 60 python3 scripts/moe_probe.py --tokens 1024 2>&1 | grep "T=" | cut -c1-160
done
