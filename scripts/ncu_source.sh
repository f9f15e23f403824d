#!/usr/bin/env bash
# Per-instruction stall samples (Nsight Compute source counters) of one linear kernel on the H200.
# Usage (device machine): bash scripts/ncu_source.sh ROWS KERNEL_REGEX [K N]  -> $OUT/source_<kernel>.csv, top lines printed
# Environment passes through (e.g. EXL3MOE_WS=0 for trellis_mma at 64-128 rows).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
ROWS="$1"; KERNEL="$2"; K="${3:-4096}"; N="${4:-14336}"
cat > /tmp/ncu_source_target.py <<PY
import torch
from exl3moe import EXL3Weight
from exl3moe.ops.linear import LinearPlan
k, n = $K, $N
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
REP="$OUT/source_${KERNEL//[^a-z_]/}${TAG:-}"
ncu --clock-control none --kernel-name "regex:$KERNEL" --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source no \
    -o "$REP" -f python3 /tmp/ncu_source_target.py > "$REP.log" 2>&1 || { tail -20 "$REP.log"; exit 1; }
ncu --import "$REP.ncu-rep" --page details > "$REP.details.txt" 2>&1
grep -E "Duration|Warp Cycles Per Issued|Issued Ipc" "$REP.details.txt" | head -5
ncu --import "$REP.ncu-rep" --page source --csv --print-source sass > "$REP.csv" 2> "$REP.err" || cat "$REP.err"
python3 scripts/stall_table.py "$REP.csv" | tee "$REP.top.txt"
