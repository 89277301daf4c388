#!/usr/bin/env bash
# The engine's and the sampler's GPU checks and benchmarks in one device call (logs under $OUT):
#   1. in parallel: the GPU tests of tests/test_engine.py, test_sample.py and test_paged_prefill.py;
#   2. alone on the GPU: bench_serve (rows to $OUT/serve.csv), then bench_sample --quick.
# SAMPLE=0 leaves the sampler's test and benchmark out.
# Set-up as gpu_model.sh (gguf wheel in .whl/, test GGUF and numba cache in .gpu/).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/runners/gpu_setup.sh || exit 1
start=$(date +%s)
T=${PHASE1_LIMIT:-300}
timeout $T python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_paged_prefill.py \
    > "$OUT/test_paged_prefill.log" 2>&1 &
timeout $T python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_engine.py \
    > "$OUT/test_engine.log" 2>&1 &
[ "${SAMPLE:-1}" = 1 ] && timeout $T python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_sample.py > "$OUT/test_sample.log" 2>&1 &
wait
echo "phase 1: $(( $(date +%s) - start )) s"
for f in test_paged_prefill test_engine test_sample; do [ -f "$OUT/$f.log" ] && { echo "== $f"; tail -4 "$OUT/$f.log"; }; done
LLMSPEED_RESULTS_DIR=$OUT timeout ${BENCH_LIMIT:-240} python3 benchmarks/bench_serve.py \
    ${SERVE_ARGS:-} > "$OUT/bench_serve.log" 2>&1
echo "== bench_serve"; grep -v "^\[" "$OUT/bench_serve.log" | tail -14
[ "${SAMPLE:-1}" = 1 ] && OUT=/tmp/sample_out timeout ${SAMPLE_LIMIT:-90} python3 benchmarks/bench_sample.py --quick \
    > "$OUT/bench_sample.log" 2>&1
cp /tmp/sample_out/sample.csv "$OUT/" 2>/dev/null   # its plot stays behind (8 files come back)
[ -f "$OUT/bench_sample.log" ] && { echo "== bench_sample"; tail -12 "$OUT/bench_sample.log"; }
tar czf "$OUT/numba_cache.tgz" -C /tmp numba_cache
# the device returns 8 files at most: the logs travel as one archive
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm -f "$OUT"/*.log
echo "total: $(( $(date +%s) - start )) s"
