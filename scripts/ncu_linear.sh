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
ncu --clock-control none --kernel-name "regex:$KERNEL" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section InstructionStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active" \
    python3 scripts/ncu_linear_target.py "$ROWS" > "$OUT/linear_ncu.txt" 2>&1
grep -E "Duration|Issued Ipc|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Throughput" "$OUT/linear_ncu.txt" | head -12
grep -E "issue_stalled|inst_executed_pipe" "$OUT/linear_ncu.txt" | awk '$NF > 0.05' | sort -k3 -rn | head -30
