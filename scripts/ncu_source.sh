#!/usr/bin/env bash
# Per-instruction stall samples (Nsight Compute source counters) of one linear kernel on the H200.
# Usage (device machine): bash scripts/ncu_source.sh ROWS KERNEL_REGEX [K N]  -> $OUT/source_<kernel>.csv, top lines printed
# Environment passes through (e.g. EXL3MOE_WS=0 for trellis_mma at 64-128 rows).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
ROWS="$1"; KERNEL="$2"; K="${3:-4096}"; N="${4:-14336}"
REP="$OUT/source_${KERNEL//[^a-z_]/}${TAG:-}"
ncu --clock-control none --kernel-name "regex:$KERNEL" --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --import-source no \
    -o "$REP" -f python3 scripts/ncu_linear_target.py "$ROWS" "$K" "$N" > "$REP.log" 2>&1 || { tail -20 "$REP.log"; exit 1; }
ncu --import "$REP.ncu-rep" --page details > "$REP.details.txt" 2>&1
grep -E "Duration|Warp Cycles Per Issued|Issued Ipc" "$REP.details.txt" | head -5
ncu --import "$REP.ncu-rep" --page source --csv --print-source sass > "$REP.csv" 2> "$REP.err" || cat "$REP.err"
python3 scripts/stall_table.py "$REP.csv" | tee "$REP.top.txt"
