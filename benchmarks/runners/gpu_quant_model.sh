#!/usr/bin/env bash
# Issue 21 at prefill sizes and in the model, one device call (logs under $OUT):
#   1. in parallel: the quantized GEMM's GPU tests ($TESTS_K: the large-M and programmatic-launch
#      paths), the launch layer's programmatic test, and bench_model's --warm of Llama-3-8B
#      shapes with int4 weights (compiles the kernels the timed run needs);
#   2. alone on the GPU: probes/probe_quant_large_m.py (dequantize + gemm against the Tensor Core
#      kernel and cuBLAS; $PROBE_ARGS), then bench_model (8 layers, bf16, int4 and int4 with
#      programmatic launches).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/runners/gpu_setup.sh || exit 1
start=$(date +%s)
LAYERS=${LAYERS:-8}
timeout ${PHASE1_LIMIT:-200} python3 -m pytest -q -rf -p no:cacheprovider -n 4 tests/test_quant.py \
    tests/test_gpu_runtime.py -k "${TESTS_K:-dequant or programmatic}" > "$OUT/test_quant.log" 2>&1 &
timeout ${PHASE1_LIMIT:-200} python3 benchmarks/bench_model.py --warm --models llama-3-8b \
    --layers "$LAYERS" --quantization int4 --programmatic > "$OUT/warm.log" 2>&1 &
wait
echo "phase 1: $(( $(date +%s) - start )) s"
for f in test_quant warm; do echo "== $f"; tail -4 "$OUT/$f.log" | cut -c1-300; done
timeout ${PROBE_LIMIT:-150} python3 benchmarks/probes/probe_quant_large_m.py ${PROBE_ARGS:-} \
    > "$OUT/probe_large_m.log" 2>&1
echo "== probe_quant_large_m ($(( $(date +%s) - start )) s)"; cut -c1-300 "$OUT/probe_large_m.log"
LLMSPEED_RESULTS_DIR=$OUT timeout ${BENCH_LIMIT:-150} python3 benchmarks/bench_model.py \
    --models llama-3-8b --layers "$LAYERS" --quantization int4 --programmatic \
    > "$OUT/bench_model.log" 2>&1
echo "== bench_model"; tail -40 "$OUT/bench_model.log" | cut -c1-300
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log)
echo "total: $(( $(date +%s) - start )) s"
