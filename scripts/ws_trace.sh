#!/usr/bin/env bash
# One H200 call: ring timelines of trellis_ws block 0 (WS_TRACE builds, scripts/ws_trace.py) for each define set in
# $TRACES (4096x14336 K4 MCG, 128 rows); timings of the same sets come from scripts/ws_diag.sh (DIAGS). Note the
# variants first (scripts/note_ws_diag.py with the same sets) and warm the cache.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
for defs in ${TRACES:-WS_TRACE=1 WS_TRACE=1,WS_DIAG=63}; do
  echo "== trace $defs"
  EXL3MOE_NVRTC_DEFINES=$defs timeout 60 python3 scripts/ncu_linear_target.py 128 > "$OUT/trace_${defs//[,=]/_}.txt"
  python3 scripts/ws_trace.py "$OUT/trace_${defs//[,=]/_}.txt"
done
