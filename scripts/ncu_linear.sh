#!/usr/bin/env bash
# Profile the linear matmul kernel with Nsight Compute on the H200: stall reasons, issue rate, shared-memory traffic.
# Usage (device machine): bash scripts/ncu_linear.sh [rows] [kernel regex]   -> $OUT/linear_ncu.txt
# The default regex matches the CUDA C++ kernel (trellis_mma) and the Triton one (EXL3MOE_CUDA_KERNELS=0).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
ROWS="${1:-1}"
KERNEL="${2:-trellis_mma\$|_trellis_matmul_kernel}"
cat > /tmp/ncu_target.py <<PY
import torch
from exl3moe import EXL3Weight
from exl3moe.ops.linear import LinearPlan
k, n = 4096, 14336
g = torch.Generator(device="cuda").manual_seed(0)
w = EXL3Weight(torch.randint(-32768, 32767, (k // 16, n // 16, 64), dtype=torch.int16, device="cuda", generator=g),
               torch.ones(k, device="cuda").half(), torch.ones(n, device="cuda").half(), "mcg")
plan = LinearPlan(w, $ROWS)
runner = plan.bind(plan.allocate())
x = torch.randn($ROWS, k, device="cuda").half()
out = torch.empty($ROWS, n, device="cuda", dtype=torch.float16)
for _ in range(3):
    runner.run(x, out)
torch.cuda.synchronize()
PY
ncu --clock-control none --kernel-name "regex:$KERNEL" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section InstructionStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active" \
    python3 /tmp/ncu_target.py > "$OUT/linear_ncu.txt" 2>&1
grep -E "Duration|Issued Ipc|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Throughput" "$OUT/linear_ncu.txt" | head -12
grep -E "issue_stalled|inst_executed_pipe" "$OUT/linear_ncu.txt" | awk '$NF > 0.05' | sort -k3 -rn | head -30
