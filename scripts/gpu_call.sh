#!/usr/bin/env bash
# One H200 call: the given GPU test files, the MoE probe at 1024 and 4096 tokens, and (BENCH=1) the MoE benchmark at
# those token counts into $OUT/moe_h200.json. Log in $OUT/gpu_call.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
export EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
{
timeout "${TEST_TIMEOUT:-360}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=12 "$@" 2>&1 | tail -20
timeout 120 python3 scripts/moe_probe.py --tokens 1024 4096 2>&1 | grep -E "T=|Error|error"
if [ "${BENCH:-0}" = 1 ]; then
  timeout 200 python3 bench/moe.py --tokens 1024 4096 --out "$OUT/moe_h200.json" 2>&1 | grep -v "^\s*$" | tail -30
fi
} > "$OUT/gpu_call.log" 2>&1
cut -c1-220 "$OUT/gpu_call.log"
