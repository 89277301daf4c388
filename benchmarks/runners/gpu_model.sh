#!/usr/bin/env bash
# The model's GPU checks and benchmark in one device call (logs under $OUT):
#   1. in parallel: the GPU model tests (SmolLM2 GGUF, Llama-3-8B-shaped safetensors against
#      transformers; graph decode against eager) and a --warm run of bench_model per model shape
#      (compiles its kernels);
#   2. alone on the GPU: bench_model (timings), rows to $OUT/model.csv.
# Expects the gguf wheel in .whl/ and the test GGUF in .gpu/ (see tests/test_models_gpu.py).
# numba's kernel cache is carried between calls as .gpu/numba_cache.tgz (returned in $OUT; see
# gpu_setup.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/runners/gpu_setup.sh || exit 1
start=$(date +%s)
T=${PHASE1_LIMIT:-400}
timeout $T python3 -m pytest -q -s -p no:cacheprovider \
    "tests/test_models_gpu.py::test_smollm2_gguf_matches_transformers" > "$OUT/test_smollm2.log" 2>&1 &
timeout $T python3 -m pytest -q -s -p no:cacheprovider \
    "tests/test_models_gpu.py::test_llama3_shapes_safetensors_matches_transformers" > "$OUT/test_llama3.log" 2>&1 &
timeout $T python3 -m pytest -q -s -p no:cacheprovider \
    "tests/test_models_gpu.py::test_cuda_graph_decode_equals_eager" > "$OUT/test_graphs.log" 2>&1 &
timeout $T python3 benchmarks/bench_model.py --warm --models smollm2-135m >> "$OUT/warm.log" 2>&1 &
timeout $T python3 benchmarks/bench_model.py --warm --models llama-3-8b >> "$OUT/warm.log" 2>&1 &
wait
echo "phase 1: $(( $(date +%s) - start )) s"
for f in test_smollm2 test_llama3 test_graphs warm; do echo "== $f"; tail -5 "$OUT/$f.log"; done
if [ "${BENCH:-1}" = 1 ]; then
    LLMSPEED_RESULTS_DIR=$OUT timeout ${BENCH_LIMIT:-150} python3 benchmarks/bench_model.py \
        ${BENCH_ARGS:-} > "$OUT/bench_model.log" 2>&1
    echo "== bench_model"; tail -12 "$OUT/bench_model.log"
fi
tar czf "$OUT/numba_cache.tgz" -C /tmp numba_cache
# the device returns 8 files at most: the logs travel as one archive
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm -f "$OUT"/*.log
echo "total: $(( $(date +%s) - start )) s"
