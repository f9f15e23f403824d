#!/usr/bin/env bash
# Profile the fused MoE's CUDA kernels with Nsight Compute on the H200: stall reasons, issue rate, occupancy.
# Usage (device machine): [KS="2 3 4"] [STAGE=zero-stage] bash scripts/ncu_moe.sh [tokens] [kernel regex] -> $OUT/moe_ncu_T<t>_K<KS>.txt
# Qwen3-30B-A3B shape, MCG experts of widths KS round robin (default 4); the default regex takes gate/up and down of
# the third call. STAGE: a Qwen3 K4 stage layer of bench/moe.py stage_layers instead.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:bench
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
TOKENS="${1:-1}"
KERNEL="${2:-moe_gate_up_mma|moe_down_mma}"
KS="${KS:-4}"
STAGE="${STAGE:-}"
REPORT="$OUT/moe_ncu_T${TOKENS}_K${KS// /}${STAGE:+_$STAGE}.txt"
cat > /tmp/ncu_moe_target.py <<PY
import torch
from moe import SHAPES, random_layer, routings, stage_layers
from exl3moe.ops.moe import moe_plan
hidden, inter, E, top_k = SHAPES["qwen3-30b-a3b"]
g = torch.Generator(device="cuda").manual_seed(0)
layer = (stage_layers("mcg", g)["$STAGE"] if "$STAGE" else
         random_layer(hidden, inter, E, [int(k) for k in "$KS".split()], "mcg", g))
plan = moe_plan(layer, $TOKENS, top_k)
runner = plan.bind(plan.allocate())
x = (torch.randn($TOKENS, hidden, device="cuda", generator=g) * 0.03).half()
ids, weights = routings($TOKENS, E, top_k, g)[0]
out = torch.empty($TOKENS, hidden, device="cuda", dtype=torch.float16)
for _ in range(3):
    runner.run(x, ids, weights, out)
torch.cuda.synchronize()
PY
ncu --clock-control none --kernel-name "regex:$KERNEL" --launch-skip 4 --launch-count 2 \
    --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy \
    --section LaunchStats --section InstructionStats \
    --metrics "dram__bytes_read.sum,lts__t_requests_srcunit_tex.sum,smsp__inst_executed.sum,sm__cycles_elapsed.max,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active" \
    python3 /tmp/ncu_moe_target.py > "$REPORT" 2>&1
grep -E "^  [a-z_]+mma|Duration|dram__bytes_read|lts__t_requests|smsp__inst_executed.sum|sm__cycles_elapsed|Issued Ipc|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Grid Size" \
    "$REPORT" | head -30
grep -E "issue_stalled|inst_executed_pipe" "$REPORT" | awk '$NF > 0.1' | sort -k3 -rn | head -24
