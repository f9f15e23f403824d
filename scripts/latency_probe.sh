#!/usr/bin/env bash
# One H200 call on the latency-bound calls: the k-split target of the small linear shapes at 1 and 8 rows, then
# Nsight Compute on the MoE's gate/up and down at 1 and 16 tokens. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
python3 scripts/mma_probe.py --shapes 768x2048 2048x768 1408x4096 4096x1408 --rows 1 8 \
  --targets 1024 2048 4096 8192 2>&1 | tee "$OUT/small_split_sweep.log" | grep rows
for T in 1 16; do
  bash scripts/ncu_moe.sh "$T"
done
