#!/usr/bin/env bash
# FlashAttention on the GPU machine: the GPU test suite, then the benchmark. Run from anywhere;
# logs, the CSV and the PNG go to $OUT (default benchmarks/results/).
#   bash benchmarks/runners/gpu_flash_attn.sh [--quick] [--sweep]     (arguments go to the benchmark)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
export OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/flash_attn_gpu.txt"
start=$(date +%s)
python -m pytest -q -m gpu tests/test_flash_attn.py -x --durations=15 -p no:cacheprovider 2>&1 \
    | tee "$OUT/flash_attn_tests.log"
tests_rc=${PIPESTATUS[0]}
echo "GPU tests: rc=$tests_rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/flash_attn_tests.log"
python benchmarks/bench_flash_attn.py "$@" 2>&1 | tee "$OUT/flash_attn_bench.log"
bench_rc=${PIPESTATUS[0]}
echo "benchmark: rc=$bench_rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/flash_attn_bench.log"
exit $(( tests_rc != 0 || bench_rc != 0 ))
