#!/usr/bin/env bash
# One H200 call: the linear at 1 and 8 rows and the one-token MoE under each define set of $SETS (EXL3MOE_NVRTC_DEFINES;
# "0" = none), so variants of the arrival (ARRIVAL=0/1/2) and the epilogue prefetch (EPILOGUE_PREFETCH=0) are timed
# on one machine. Note and warm first: python3 scripts/ab_arrival.py "$SETS" && python3 scripts/warm_cache.py.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
for set in ${SETS:-0 ARRIVAL=0 ARRIVAL=1}; do
  export EXL3MOE_NVRTC_DEFINES="$([ "$set" = 0 ] || echo "$set")"
  echo "== $set"
  timeout 120 python3 bench/linear.py --shapes 4096x14336 768x2048 1408x4096 --bits 3 4 6 8 --codebooks mcg mul1 \
    --rows 1 8 --out "$OUT/linear_$set.json" 2>&1 | grep -E "^[0-9]" | cut -c1-60
  timeout 60 python3 bench/moe.py --shapes qwen3-30b-a3b --layers 4 --tokens 1 --out "$OUT/moe_$set.json" 2>&1 \
    | grep "T=" | cut -c1-60
done
