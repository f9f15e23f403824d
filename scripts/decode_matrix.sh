#!/usr/bin/env bash
# Decode-variant matrix on the H200: linear probe (4096x14336 K4, MCG and 3INST) and the Qwen3 K4 MoE probe per knob set.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
variants=(PAIR_SCALAR=0 PAIR_SCALAR=1 PAIR_SCALAR=2)
[ -n "${DECODE_DEFINES:-}" ] && read -ra variants <<< "$DECODE_DEFINES"
for variant in "${variants[@]}"; do
  defines=$variant
  for cb in mcg 3inst; do
    EXL3MOE_NVRTC_DEFINES="$defines" python3 scripts/mma_probe.py --codebook "$cb" --rows 1 8 32 128 --targets 4096 \
      2>&1 | grep "rows" | sed "s/^/$cb [$variant] /"
  done
  EXL3MOE_NVRTC_DEFINES="$defines" python3 scripts/moe_probe.py --tokens ${MOE_TOKENS:-1 16 64 1024} 2>&1 \
    | grep "whole" | sed "s/^/moe [$variant] /"
done
