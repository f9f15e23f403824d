export PYTHONPATH=src PYTHONUNBUFFERED=1 EXL3MOE_FIXTURES=$PWD/.fixtures EXL3MOE_CACHE_DIR=$PWD/.kernel_cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
ncu --version | tail -1
EXL3MOE_WS=all bash scripts/ncu_source.sh 128 'trellis_ws$'
TAG=_whole EXL3MOE_WS=all EXL3MOE_WS_SPB=99 bash scripts/ncu_source.sh 128 'trellis_ws$' 2>&1 | head -20
