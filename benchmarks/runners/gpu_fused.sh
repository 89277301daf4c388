#!/usr/bin/env bash
# Fused ops (norms, rotary, activations, softmax / argmax) on the GPU machine: the GPU tests, then
# the benchmark. Run from anywhere; logs, the CSV, the PNG and the headline table go to $OUT
# (default benchmarks/results/).
#   bash benchmarks/runners/gpu_fused.sh [all|tests|bench] [--quick] [--eager] [--dtypes ...]
# (the first argument picks the part, default all; the rest go to the benchmark). The first run
# compiles every kernel variant (numba's disk cache keeps them for later runs on the machine).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
export OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
part="${1:-all}"
case "$part" in all|tests|bench) shift || true ;; *) part=all ;; esac
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv \
    2>&1 | tee "$OUT/fused_gpu.txt"
start=$(date +%s)
tests_rc=0
bench_rc=0
if [ "$part" != bench ]; then
    python -m pytest -q -m gpu tests/test_norms.py tests/test_rotary.py tests/test_activations.py \
        tests/test_softmax.py -x --durations=15 -p no:cacheprovider 2>&1 | tee "$OUT/fused_tests.log"
    tests_rc=${PIPESTATUS[0]}
    echo "GPU tests: rc=$tests_rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/fused_tests.log"
fi
if [ "$part" != tests ]; then
    python benchmarks/bench_fused.py "$@" 2>&1 | tee "$OUT/fused_bench.log"
    bench_rc=${PIPESTATUS[0]}
    echo "benchmark: rc=$bench_rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/fused_bench.log"
fi
exit $(( tests_rc != 0 || bench_rc != 0 ))
