#!/usr/bin/env bash
# One call on the two-H200 machine (nvidia-h200-x2): `exl3moe verify` of the tiny fixture with --ep 2 and --tp 2 (and of
# a synthetic one with 256-wide experts at --tp 2: the fixture's are too narrow to split), the parallel GPU tests, then
# bench/parallel.py over NCCL into $OUT/parallel_h200x2.{json,png} with --check; logs under $OUT, the benchmark's
# table last. Exit 0 when every step passed. The steps share BUDGET seconds (the device's per-call limit is 600); the
# benchmark gets what the others leave. BENCH_ARGS: more bench/parallel.py options (--eager, --tokens ...).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # NVLink multicast stays off
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export EXL3MOE_CACHE_DIR="${EXL3MOE_CACHE_DIR-$PWD/.kernel_cache}"  # compiled CUDA kernels, kept between calls
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR-$PWD/.triton_cache}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
deadline=$((SECONDS + ${BUDGET:-570}))
left() { local n=$((deadline - SECONDS - $1)); [ "$n" -gt "$2" ] && n=$2; [ "$n" -lt 10 ] && n=10; echo "$n"; }
failed=()

nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'nccl', \
torch.cuda.nccl.version(), 'peer', torch.cuda.can_device_access_peer(0, 1))"

# verify CHECKPOINT --tp|--ep LOG: `exl3moe verify` at degree 2, its table printed; its exit status.
verify() {
  timeout "$(left 300 90)" python3 -m exl3moe.cli verify "$1" "$2" 2 --width 150 > "$OUT/$3" 2>&1
  local rc=$?
  tail -n 22 "$OUT/$3"; echo "verify $1 $2 2: exit $rc"
  return $rc
}
FIXTURE=tests/fixtures/tiny_qwen3_moe_exl3
verify $FIXTURE --ep verify_ep2.log || failed+=("verify --ep 2 (exit $?)")
# The fixture's experts are one 128-wide block: TP2 refuses its MoE layers (exit 2, the CPU tests expect it); its
# linears must pass, and a synthetic checkpoint of the same architecture with 256-wide experts must pass whole.
verify $FIXTURE --tp verify_tp2.log; rc=$?
{ [ "$rc" = 0 ] || { [ "$rc" = 2 ] && ! grep -q FAIL "$OUT/verify_tp2.log"; }; } || failed+=("verify --tp 2 (exit $rc)")
WIDE=$(mktemp -d)/tiny_wide_experts
python3 scripts/tiny_tp_checkpoint.py "$WIDE" > "$OUT/tiny_wide_experts.log" 2>&1 || failed+=("tiny_tp_checkpoint.py")
verify "$WIDE" --tp verify_tp2_wide_experts.log || failed+=("verify --tp 2 of 256-wide experts (exit $?)")

timeout "$(left 240 150)" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 tests/test_parallel_gpu.py \
  > "$OUT/parallel_gpu_tests.log" 2>&1
rc=$?
tail -n 12 "$OUT/parallel_gpu_tests.log"; [ "$rc" = 0 ] || failed+=("test_parallel_gpu.py (exit $rc)")

bench=(python3 -m torch.distributed.run --nproc_per_node 2 bench/parallel.py --plot "$OUT/parallel_h200x2.png")
timeout "$(left 20 600)" "${bench[@]}" --out "$OUT/parallel_h200x2.json" --check ${BENCH_ARGS:-} \
  > "$OUT/parallel_bench.log" 2>&1
rc=$?
grep -E "<-|Error|error" "$OUT/parallel_bench.log" | tail -n 30
[ "$rc" = 0 ] || failed+=("bench/parallel.py (exit $rc; points measured before it stopped are in the JSON)")

[ -d "$EXL3MOE_CACHE_DIR" ] && tar czf "$OUT/kernel_cache.tgz" -C "$EXL3MOE_CACHE_DIR" .
echo
[ -s "$OUT/parallel_h200x2.json" ] && python3 bench/parallel.py --from-json "$OUT/parallel_h200x2.json"
if [ ${#failed[@]} -gt 0 ]; then printf 'FAILED: %s\n' "${failed[@]}"; exit 1; fi
echo "all steps passed"
