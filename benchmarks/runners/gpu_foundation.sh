#!/usr/bin/env bash
# Foundation checks on the GPU machine: info, PTX-layer and runtime tests, demo, launch and
# cold-start benchmarks. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m llmspeed_numba info 2>&1 | tee "$OUT/info.log"
python -m pytest -q tests/test_ptx.py tests/test_warp_tile.py tests/test_arrays.py \
    tests/test_gpu_runtime.py 2>&1 | tee "$OUT/foundation_tests.log" | tail -25
python benchmarks/bench_launch.py 2>&1 | tee "$OUT/bench_launch.log" | tail -12
python benchmarks/bench_cold_start.py 2>&1 | tee "$OUT/bench_cold_start.log" | tail -5
