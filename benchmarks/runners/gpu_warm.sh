#!/usr/bin/env bash
# Issue 18's start-up numbers in one device call (logs under $OUT):
#   1. `warm` of the carried 8-layer SmolLM2 GGUF (the default model's shapes and kernels) from
#      an empty kernel cache, timed;
#   2. `generate` on that cache (the marker written by warm: no compile on the way);
#   3. bench_cold_start.py (fresh processes, empty then warm cache; rows to $OUT/cold_start.csv).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/runners/gpu_setup.sh || exit 1
export NUMBA_CACHE_DIR=/tmp/warm_cache LLMSPEED_NUMBA_CACHE=/tmp/llmspeed_cache
rm -rf "$NUMBA_CACHE_DIR" "$LLMSPEED_NUMBA_CACHE"
start=$(date +%s)
timeout ${WARM_LIMIT:-200} python3 -m llmspeed_numba warm --model .gpu/smollm2-8l.gguf \
    > "$OUT/warm.log" 2>&1
echo "== warm ($(( $(date +%s) - start )) s, rc $?)"; grep -v "^\[" "$OUT/warm.log" | tail -8
t0=$(date +%s.%N)
timeout 120 python3 -m llmspeed_numba generate "The capital of France is" \
    --model .gpu/smollm2-8l.gguf --max-new-tokens 16 > "$OUT/generate.log" 2>&1
echo "== generate on the warmed cache ($(echo "$(date +%s.%N) - $t0" | bc) s)"; tail -6 "$OUT/generate.log"
LLMSPEED_RESULTS_DIR=$OUT timeout ${COLD_LIMIT:-150} python3 benchmarks/bench_cold_start.py \
    > "$OUT/cold_start.log" 2>&1
echo "== cold start"; tail -10 "$OUT/cold_start.log"
tar czf "$OUT/warm_logs.tgz" -C "$OUT" warm.log generate.log cold_start.log \
    && rm -f "$OUT/warm.log" "$OUT/generate.log" "$OUT/cold_start.log"
echo "total: $(( $(date +%s) - start )) s"
