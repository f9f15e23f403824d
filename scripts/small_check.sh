#!/usr/bin/env bash
# One H200 call for the small calls: per-block timelines (block_trace.py), the linear's small shapes at 1 and 8 rows
# (mma_probe.py: the planned call against prefetch variants), and the Qwen3 K4 MoE at 1 and 4 tokens (bench/moe.py
# into $OUT/moe_small.json). Log in $OUT/small_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
{
timeout 120 python3 scripts/block_trace.py
P="--rows 1 8 --targets 4096 --prefetch 4 8 --nt 2"
timeout 150 python3 scripts/mma_probe.py --shapes 768x2048 2048x768 --codebook mcg $P
timeout 150 python3 scripts/mma_probe.py --shapes 1408x4096 4096x1408 --codebook mul1 $P
timeout 100 python3 scripts/mma_probe.py --shapes 4096x14336 --codebook mcg --rows 1 --targets 4096 --prefetch 4
timeout 150 python3 bench/moe.py --shapes qwen3-30b-a3b --layers 4 --tokens 1 4 --out "$OUT/moe_small.json"
} > "$OUT/small_check.log" 2>&1
cut -c1-400 "$OUT/small_check.log"
