#!/usr/bin/env bash
# Issue 21 at prefill sizes and in the model, one device call (logs under $OUT):
#   1. in parallel: GPU tests ($TESTS: the quantized GEMM's large-M and programmatic-launch
#      paths, the GEMV, the launch layer's programmatic test, the model's graph decode against
#      eager and the SmolLM2 GGUF against transformers), and bench_model's --warm of Llama-3-8B
#      shapes with int4 weights, with and without programmatic launches;
#   2. alone on the GPU: probes/probe_quant_large_m.py when PROBE=1 (dequantize + gemm against
#      the Tensor Core kernel and cuBLAS; $PROBE_ARGS), then bench_model (8 layers, bf16 and
#      int4) once a launch variant of $VARIANTS (';'-separated bench_model flags; default: the
#      library's defaults, then --programmatic). TESTS=none skips the tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/runners/gpu_setup.sh || exit 1
start=$(date +%s)
LAYERS=${LAYERS:-8}
T=${PHASE1_LIMIT:-260}
TESTS=${TESTS:-tests/test_quant.py::test_programmatic_variants_compute_the_same \
tests/test_gpu_runtime.py::test_programmatic_launch_waits_for_the_kernel_before \
tests/test_models_gpu.py::test_cuda_graph_decode_equals_eager \
tests/test_models_gpu.py::test_smollm2_gguf_matches_transformers}
if [ "$TESTS" != none ]; then
    timeout $T python3 -m pytest -q -rf -p no:cacheprovider -n 4 $TESTS > "$OUT/test_gpu.log" 2>&1 &
    timeout $T python3 -m pytest -q -rf -p no:cacheprovider -n 3 tests/test_quant.py \
        tests/test_gemm.py -k "${TESTS_K:-dequant or gemv}" > "$OUT/test_k.log" 2>&1 &
fi
for launch in "" --programmatic; do
    timeout $T python3 benchmarks/bench_model.py --warm --models llama-3-8b --layers "$LAYERS" \
        --quantization int4 $launch > "$OUT/warm$launch.log" 2>&1 &
done
wait
echo "phase 1: $(( $(date +%s) - start )) s"
for f in "$OUT"/test_*.log "$OUT"/warm*.log; do
    echo "== $f"; grep -E "passed|failed|FAILED|Error|warm " "$f" | tail -6 | cut -c1-300
done
if [ "${PROBE:-0}" = 1 ]; then
    timeout ${PROBE_LIMIT:-150} python3 benchmarks/probes/probe_quant_large_m.py ${PROBE_ARGS:-} \
        > "$OUT/probe_large_m.log" 2>&1
    echo "== probe_quant_large_m"; cut -c1-300 "$OUT/probe_large_m.log"
fi
IFS=';' read -ra variants <<< "${VARIANTS:-;--programmatic}"
[ ${#variants[@]} = 0 ] && variants=("")
i=0
for flags in "${variants[@]}"; do
    i=$((i + 1))
    LLMSPEED_RESULTS_DIR=$OUT timeout ${BENCH_LIMIT:-120} python3 benchmarks/bench_model.py \
        --models llama-3-8b --layers "$LAYERS" --quantization int4 $flags \
        > "$OUT/bench_model_$i.log" 2>&1
    echo "== bench_model $flags"; grep -E "^  llama" "$OUT/bench_model_$i.log" | cut -c1-250
done
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm -f "$OUT"/*.log
echo "total: $(( $(date +%s) - start )) s"
