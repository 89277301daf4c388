#!/usr/bin/env bash
# Tensor parallelism on a machine of 2 GPUs or more (nvidia-h200-x2 / -x4), one device call,
# logs under $OUT:
#   1. the GPU tests of tests/test_distributed.py (NCCL: 2 ranks against 1; the engine at 2, 4
#      and 8 GPUs as the machine allows);
#   2. benchmarks/bench_tp.py (rows to $OUT/tp.csv): Llama-3-8B shapes at 1, 2 (4) GPUs,
#      Llama-3-70B shapes from 2 GPUs. TP_ARGS passes options (e.g. "--layers 4" for a quick run).
# NCCL_NVLS_ENABLE is left as the machine sets it. Set-up as gpu_model.sh (gpu_setup.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/runners/gpu_setup.sh || exit 1
start=$(date +%s)
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
timeout ${TEST_LIMIT:-300} python3 -m pytest -q -s -p no:cacheprovider -m gpu \
    tests/test_distributed.py > "$OUT/test_distributed.log" 2>&1
echo "== test_distributed ($(( $(date +%s) - start )) s)"; tail -6 "$OUT/test_distributed.log"
LLMSPEED_RESULTS_DIR=$OUT timeout ${BENCH_LIMIT:-280} python3 benchmarks/bench_tp.py \
    ${TP_ARGS:-} > "$OUT/bench_tp.log" 2>&1
echo "== bench_tp"; grep -v "^\[" "$OUT/bench_tp.log" | tail -12
tar czf "$OUT/numba_cache.tgz" -C /tmp numba_cache
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log topo.txt) && rm -f "$OUT"/*.log
echo "total: $(( $(date +%s) - start )) s"
