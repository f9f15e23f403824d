#!/usr/bin/env bash
# Linear probe (4096x14336) for each codebook with and without a compile-time decode variant.
# Usage (device machine): bash scripts/decode_variants.sh DEFINE [rows...]   e.g. WINDOW_FMA 1 8 32 128
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src
DEFINE="$1"; shift
for cb in mcg mul1 3inst; do
  for value in 0 1; do
    EXL3MOE_NVRTC_DEFINES="$DEFINE=$value" python3 scripts/mma_probe.py --codebook "$cb" --rows "$@" --targets 4096 \
      2>&1 | grep "rows" | sed "s/^/$cb $DEFINE=$value /"
  done
done
