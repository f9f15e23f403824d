#!/usr/bin/env bash
# One H200 call for the persistent warp-specialized gate/up and down (moe_gate_up_ws, moe_down_ws): the ws-against-
# mma.sync and determinism MoE GPU tests first, the MoE probe at 1024 and 4096 tokens with each of PROBE_ENVS, the MoE
# benchmark at those token counts (if BENCH=1), then the rest of the MoE GPU tests. Log in $OUT/moe_persistent.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
export EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
FIRST="warp_specialized or deterministic"
{
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_gpu.py -k "$FIRST" 2>&1 | tail -4
for cfg in ${PROBE_ENVS:-EXL3MOE_MOE_WS_GATE_UP=0 EXL3MOE_MOE_WS_GATE_UP=1}; do
  env "$cfg" timeout 120 python3 scripts/moe_probe.py --tokens 1024 4096 2>&1 | grep -E "T=|Error|error" \
    | sed "s/^/[$cfg] /"
done
if [ "${BENCH:-0}" = 1 ]; then
  timeout 200 python3 bench/moe.py --tokens 1024 4096 --out "$OUT/moe_h200.json" 2>&1 | grep -v "^\s*$" | tail -30
fi
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_gpu.py -k "not ($FIRST)" 2>&1 | tail -4
} > "$OUT/moe_persistent.log" 2>&1
cut -c1-220 "$OUT/moe_persistent.log"
