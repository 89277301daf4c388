#!/usr/bin/env bash
# compute-sanitizer over every kernel test file on the GPU machine: memcheck (out-of-bounds and
# misaligned accesses), then racecheck (shared-memory hazards), each file in its own process, the
# files in parallel. Not yet run on a GPU (written in session 11). The tests run are the small-shape ones (not marked gpu, not hypothesis): every op's
# kernels at odd shapes, fast enough under the sanitizer's slowdown.
#   bash benchmarks/runners/gpu_sanitize.sh            logs under $OUT/sanitize, one line a run
#   FILES="tests/test_quant.py" TOOLS=memcheck LIMIT=300 to narrow it.
# --report-api-errors no: numba's driver bindings probe entry points with cuGetProcAddress, which
# the sanitizer counts as errors (34 a process at 16b9e95) though no kernel misbehaved.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/sanitize"
FILES=${FILES:-"tests/test_gemm.py tests/test_gemm_gated.py tests/test_quant.py tests/test_flash_attn.py
    tests/test_paged_decode.py tests/test_paged_prefill.py tests/test_norms.py
    tests/test_rotary.py tests/test_activations.py tests/test_softmax.py tests/test_argmax.py
    tests/test_sample.py tests/test_embedding.py tests/test_warp_tile.py tests/test_wgmma.py
    tests/test_bulk_stage.py"}
for tool in ${TOOLS:-memcheck racecheck}; do
    for f in $FILES; do
        name="${tool}_$(basename "$f" .py)"
        timeout "${LIMIT:-500}" compute-sanitizer --tool "$tool" --report-api-errors no \
            --error-exitcode 9 python -m pytest -q -p no:cacheprovider -m "not gpu and not hypothesis" \
            "$f" > "$OUT/sanitize/$name.log" 2>&1 &
    done
    wait  # memcheck first: racecheck then finds every kernel compiled in numba's cache
done
for f in "$OUT"/sanitize/*.log; do
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$f" | tail -n 1)
    echo "$(basename "$f" .log): ${summary:-no sanitizer summary (timed out?)}; $(grep -E "passed|failed" "$f" | tail -n 1)"
done | tee "$OUT/sanitize/summary.txt"
