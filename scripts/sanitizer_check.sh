#!/usr/bin/env bash
# compute-sanitizer over every kernel family (scripts/sanitize.py's cases) on one GPU: each case first runs once plain
# (compiles its kernels into the cache, checks its output against float64), then under memcheck, racecheck (hazard
# reports; warp-specialized cases in the default build and in the RACECHECK_ORDER build), synccheck and initcheck,
# JOBS runs at a time, each within CASE_TIMEOUT seconds. Reports of the CUDA bindings' symbol probing are dropped by
# name (scripts/sanitize_report.py). Writes $OUT/sanitizers_h200.json and the logs under $OUT/sanitizer_logs, prints a
# table last; exits 1 when a run that decides the stage is not clean. The sanitizer runs stop starting after
# SWEEP_BUDGET seconds (the rest are recorded as skipped), and none runs past that budget.
# Subsets: TOOLS="memcheck racecheck" CASES="linear_ws16 moe_ws" bash scripts/sanitizer_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
[ -d .kernel_cache ] && export EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"
OUT="${OUT:-/tmp/out}"
export LOGS="$OUT/sanitizer_logs" SANITIZE_REF_DIR="$OUT/sanitizer_logs/refs"
mkdir -p "$LOGS"
rm -f "$LOGS"/*.run.json
TOOLS="${TOOLS:-memcheck racecheck synccheck initcheck}"
JOBS="${JOBS:-12}"
export CASE_TIMEOUT="${CASE_TIMEOUT:-120}" PLAIN_TIMEOUT="${PLAIN_TIMEOUT:-240}" DEADLINE=""
SWEEP_BUDGET="${SWEEP_BUDGET:-300}"
export SANITIZER="${SANITIZER:-$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | tail -1)}"
if [ -z "$SANITIZER" ]; then echo "compute-sanitizer not found (set SANITIZER)"; exit 2; fi
# name family ws|- env... per case
LISTING="$(python3 scripts/sanitize.py --list)" || exit 2
CASES="$(echo ${CASES:-$(awk '{print $1}' <<<"$LISTING")})"   # one line, names apart by spaces

# One run: case, family, tool ("plain" = no sanitizer), build ("default" or "racecheck_order").
run_one() {
  local case=$1 family=$2 tool=$3 build=$4
  local id="$case.$tool.$build" defines="" cmd=()
  local log="$LOGS/$id.log" result="$LOGS/$id.result.json"
  rm -f "$log" "$result"
  [ "$build" = racecheck_order ] && defines="RACECHECK_ORDER=1"
  if [ "$tool" != plain ]; then
    cmd=("$SANITIZER" --tool "$tool" --error-exitcode 86 --print-limit 1000 --log-file "$log")
    [ "$tool" = racecheck ] && cmd+=(--racecheck-report hazard)
  fi
  local start end rc limit=$CASE_TIMEOUT skipped=false
  [ "$tool" = plain ] && limit=$PLAIN_TIMEOUT
  if [ -n "$DEADLINE" ]; then
    local left=$(( DEADLINE - $(date +%s) ))
    [ $left -lt $limit ] && limit=$left
  fi
  start=$(date +%s%N)
  if [ $limit -lt 5 ]; then
    skipped=true rc=-1
  else
    EXL3MOE_NVRTC_DEFINES="$defines" timeout -k 10 "$limit" "${cmd[@]}" python3 scripts/sanitize.py "$case" \
      --result "$result" >"$LOGS/$id.out" 2>&1
    rc=$?
  fi
  end=$(date +%s%N)
  local ms=$(( (end - start) / 1000000 )) timed_out=false
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && timed_out=true
  printf '{"case": "%s", "family": "%s", "tool": "%s", "build": "%s", "exit_code": %d, "seconds": %d.%03d, ' \
    "$case" "$family" "$tool" "$build" "$rc" $((ms / 1000)) $((ms % 1000)) >"$LOGS/$id.run.json"
  printf '"timed_out": %s, "skipped": %s, "log": "%s", "result": "%s"}\n' "$timed_out" "$skipped" "$log" "$result" \
    >>"$LOGS/$id.run.json"
  printf '%-28s %-10s %-16s rc %3d %6ds\n' "$case" "$tool" "$build" "$rc" $((ms / 1000))
}
export -f run_one

jobs_for() {   # the runs of one tool ("plain" too), "case family tool build" per line
  local tool=$1 name family ws rest
  while read -r name family ws rest; do
    [[ " $CASES " == *" $name "* ]] || continue
    echo "$name $family $tool default"
    if [ "$ws" = ws ] && { [ "$tool" = racecheck ] || { [ "$tool" = plain ] && [[ " $TOOLS " == *" racecheck "* ]]; }; }
    then
      echo "$name $family $tool racecheck_order"
    fi
  done <<<"$LISTING"
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$SANITIZER" --version | tail -1
echo "plain runs (compile, check against float64)"
jobs_for plain | xargs -r -P "$JOBS" -L 1 bash -c 'run_one "$@"' _
echo "sanitizer runs: $TOOLS (within ${SWEEP_BUDGET}s)"
export DEADLINE=$(( $(date +%s) + SWEEP_BUDGET ))
for tool in racecheck memcheck initcheck synccheck; do   # the slowest tool first
  [[ " $TOOLS " == *" $tool "* ]] && jobs_for "$tool"
done | xargs -r -P "$JOBS" -L 1 bash -c 'run_one "$@"' _
python3 scripts/sanitize.py --summarize "$LOGS" --out "$OUT/sanitizers_h200.json"
