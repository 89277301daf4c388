#!/usr/bin/env bash
# GEMM on the GPU machine: the GPU test suite, then the benchmark. Run from anywhere; logs, the
# CSV, the PNG, the headline table and the autotune winners (autotune.json) go to $OUT (default
# benchmarks/results/).
#   bash benchmarks/runners/gpu_gemm.sh [all|tests|bench|gated] [--quick] [--sweep|--only-sweep] [--autotune] ...
# (the first argument picks the part, default all; the rest go to the benchmark; ``gated``: the
# gated GEMM's GPU tests, then bench_gemm_gated.py, which takes the rest instead). The first run
# compiles every kernel (numba's disk cache keeps them for later runs on the same machine); the
# benchmark compiles its kernels in parallel child processes first (--workers).
#   bash benchmarks/runners/gpu_gemm.sh bench --only-sweep --quick   # picks gemm.LARGE_CONFIG / SIMT_CONFIG
#   bash benchmarks/runners/gpu_gemm.sh bench                        # the full benchmark of the issue
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=.
export OUT="${OUT:-benchmarks/results}"
# the library's cache (autotune winners, the kernel machine-code store) off $OUT: the store's
# files would all travel back; the winners are copied to $OUT at the end
export LLMSPEED_NUMBA_CACHE="${LLMSPEED_NUMBA_CACHE:-/tmp/llmspeed_cache}"
trap 'cp "$LLMSPEED_NUMBA_CACHE/autotune.json" "$OUT/" 2>/dev/null || true' EXIT
mkdir -p "$OUT"
part="${1:-all}"
case "$part" in all|tests|bench|gated) shift || true ;; *) part=all ;; esac
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gemm_gpu.txt"
start=$(date +%s)
tests_rc=0
bench_rc=0
if [ "$part" = gated ]; then
    python -m pytest -q -m gpu tests/test_gemm_gated.py -x --durations=20 -p no:cacheprovider \
        2>&1 | tee "$OUT/gemm_gated_tests.log"
    tests_rc=${PIPESTATUS[0]}
    python benchmarks/bench_gemm_gated.py "$@" 2>&1 | tee "$OUT/gemm_gated_bench.log"
    bench_rc=${PIPESTATUS[0]}
    echo "gated: tests rc=$tests_rc, benchmark rc=$bench_rc after $(( $(date +%s) - start )) s" \
        | tee -a "$OUT/gemm_gated_bench.log"
    exit $(( tests_rc != 0 || bench_rc != 0 ))
fi
if [ "$part" != bench ]; then
    python -m pytest -q -m gpu tests/test_gemm.py tests/test_gemm_gated.py -x --durations=20 \
        -p no:cacheprovider 2>&1 | tee "$OUT/gemm_tests.log"
    tests_rc=${PIPESTATUS[0]}
    echo "GPU tests: rc=$tests_rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/gemm_tests.log"
fi
if [ "$part" != tests ]; then
    python benchmarks/bench_gemm.py "$@" 2>&1 | tee "$OUT/gemm_bench.log"
    bench_rc=${PIPESTATUS[0]}
    echo "benchmark: rc=$bench_rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/gemm_bench.log"
fi
exit $(( tests_rc != 0 || bench_rc != 0 ))
