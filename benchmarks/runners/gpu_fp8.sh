#!/usr/bin/env bash
# First GPU run of the W8A8 FP8 path (issue 21), in about 3 minutes, after gpu_setup.sh:
#   1. compile: the FP8 GEMM's epilogue variants the tests and the benchmark use, and the
#      activation kernels of their K, in parallel processes (the kernel store keeps them);
#   2. the e4m3 wgmma op on one warpgroup (tests/test_wgmma.py -k e4m3);
#   3. tests/test_quant_fp8.py: the codec against torch, the activation codes bit for bit, and
#      quant_gemm against the float64 reference (hypothesis: M 1..300, odd N; the issue's sizes);
#   4. bench_quant.py --formats fp8_e4m3: 4096^3 and 8192^3 against torch._scaled_mm (rowwise
#      and cuBLASLt tensorwise) and bf16 cuBLAS (TFLOP/s, quant.csv).
# Each step has its own time limit and log under $OUT; summary.txt collects the last lines.
#   bash benchmarks/runners/gpu_fp8.sh [extra bench_quant.py arguments, e.g. --fp8-tiles 128x128s5]
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
. benchmarks/runners/_steps.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/summary.txt" 2>&1
step compile 100 python - <<'EOF'
import concurrent.futures as cf
import multiprocessing as mp
import time

# what tests/test_quant_fp8.py and bench_quant.py launch: (out, bias, activation), and the K
# of x (the row kernel's plan follows K) for both dtypes and both load widths
GEMM = [("bfloat16", None, None), ("float16", None, None), ("float32", None, None),
        ("float32", "float32", "silu"), ("bfloat16", "bfloat16", "gelu"),
        ("float16", "bfloat16", "gelu")]
ROWS = [(d, v, k) for d in ("bfloat16", "float16") for v in (0, 1)
        for k in (32, 64, 96, 160, 256, 592, 1024, 4096, 8192)]


def gemm(args):
    from llmspeed_numba.ops import _fp8_gemm
    t0 = time.perf_counter()
    k = _fp8_gemm.gemm_kernel(_fp8_gemm.TUNING.tile, *args)
    k.compiled()
    r = k.resources()
    return f"gemm {args}: {time.perf_counter() - t0:.0f} s, {r}"


def rows(chunk):
    from llmspeed_numba.ops import _fp8_quant
    t0 = time.perf_counter()
    seen = set()
    for d, v, K in chunk:
        plan = _fp8_quant.row_launch_plan(K, v)
        if (d, v, plan) not in seen:
            seen.add((d, v, plan))
            _fp8_quant.row_kernel(d, v, *plan).compiled()
    return f"row kernels {len(seen)}: {time.perf_counter() - t0:.0f} s"


# fork: this parent never touches CUDA (each child makes its own context); spawn could not
# find these functions again in a script read from stdin
with cf.ProcessPoolExecutor(8, mp_context=mp.get_context("fork")) as pool:
    jobs = [pool.submit(gemm, g) for g in GEMM]
    jobs += [pool.submit(rows, ROWS[i::2]) for i in range(2)]
    for j in jobs:
        print(j.result(), flush=True)
EOF
step op 40 python -m pytest -q -p no:cacheprovider tests/test_wgmma.py -k e4m3
TAIL=8 step tests 150 python -m pytest -q -p no:cacheprovider tests/test_quant_fp8.py \
    --durations=5
TAIL=14 step bench 120 python benchmarks/bench_quant.py --formats fp8_e4m3 "$@"
