#!/usr/bin/env bash
# Paged-KV decode on the GPU machine: the GPU tests of the op and the allocator, the demo, the
# benchmark (CSV + PNG), a configuration / split-count sweep on the target shapes, then the
# simulator-sized tests on the hardware. Logs, CSV and PNG under $OUT. Run from anywhere.
# QUICK=1: only the op's GPU tests and the quick benchmark (target shapes + a few variants).
# (The SASS check needs no GPU: python -m llmspeed_numba compile-check, offline.)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LLMSPEED_RESULTS_DIR=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv 2>&1 | tee "$OUT/gpu.log"
if [ "${QUICK:-0}" = 1 ]; then
    python -m pytest -q -m gpu tests/test_paged_decode.py -x 2>&1 \
        | tee "$OUT/decode_tests.log" | tail -8
    python benchmarks/bench_decode.py --quick 2>&1 | grep -v "UserWarning\|return F.scaled" \
        | tee "$OUT/bench_decode_quick.log" | tail -45
    exit 0
fi
python -m pytest -q -m gpu tests/test_paged_decode.py tests/test_paged_cache.py -x \
    2>&1 | tee "$OUT/decode_tests.log" | tail -25
python -m llmspeed_numba demo paged_decode 2>&1 | tee "$OUT/decode_demo.log" | tail -8
python benchmarks/bench_decode.py 2>&1 | tee "$OUT/bench_decode.log" | tail -45
python benchmarks/bench_decode.py --sweep --no-main --quick 2>&1 \
    | tee "$OUT/bench_decode_sweep.log" | tail -60
# the simulator-sized tests, on the hardware (small head dims, every code path)
python -m pytest -q -m "not gpu" tests/test_paged_decode.py tests/test_paged_cache.py -x \
    2>&1 | tee "$OUT/decode_tests_small.log" | tail -5
