#!/usr/bin/env bash
# The TMA pieces (branch tma) on the H200 in one device call (logs under $OUT):
#   1. in parallel: the GPU tests of tests/test_tma.py (the driver's tensor maps, box copies
#      through an mbarrier ring), the GEMM's TMA configurations and the producer / split ones
#      beside them, the replay tests (the wgmma kernels' parameters grew by two maps), the
#      wgmma FlashAttention's and the staging ring's (their barrier set-up moved to _stage_ring);
#      and the compiles of the sweep below;
#   2. alone on the GPU: each TMA tile against its cp.async producer twin and cuBLAS at the
#      few-row shapes (probe_gemm_small_m.py, rows to $OUT/gemm_small_m.csv).
# RACECHECK=1 adds compute-sanitizer racecheck / memcheck of one small TMA GEMM.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/runners/gpu_setup.sh || exit 1
start=$(date +%s)
P=benchmarks/probes/probe_gemm_small_m.py
TILES=${TILES:-wg_64x64x64_s8_p,wg_64x64x64_s8_p_tma,wg_64x128x64_s8_p,wg_64x128x64_s8_p_tma,wg_64x256x64_s4_p,wg_64x256x64_s4_p_tma,wg_128x128x64_s5_p,wg_128x128x64_s5_p_tma}
ARGS="--m ${MS:-16,32,64,128,256} --tiles $TILES --splits ${SPLITS:-1,2} --skip-epilogue"
timeout -s INT ${PHASE1_LIMIT:-330} python3 -m pytest -q -rf -p no:cacheprovider -m gpu -n 8 \
    tests/test_tma.py tests/test_gemm.py tests/test_replay_gpu.py tests/test_flash_attn.py \
    tests/test_bulk_stage.py -k "tma or producer or split or replay or wgmma or staging" \
    > "$OUT/test_tma.log" 2>&1 &
timeout ${PHASE1_LIMIT:-330} python3 $P $ARGS --compile-only --workers 6 > "$OUT/compile.log" 2>&1 &
wait
echo "phase 1: $(( $(date +%s) - start )) s"; tail -3 "$OUT/test_tma.log"
grep -E "^FAILED|Error" "$OUT/test_tma.log" | head -8
LLMSPEED_RESULTS_DIR=$OUT timeout ${BENCH_LIMIT:-200} python3 $P $ARGS --no-compile \
    > "$OUT/sweep.log" 2>&1
echo "== sweep"; grep "^==\|BAD\|!!" "$OUT/sweep.log"
if [ "${RACECHECK:-0}" = 1 ]; then
  cat > /tmp/tma_small.py <<'PY'
import torch
from llmspeed_numba import gemm
x = torch.randn(72, 392, device="cuda", dtype=torch.bfloat16)
w = torch.randn(136, 392, device="cuda", dtype=torch.bfloat16)
for cfg in ("wg_64x128x64_s8_p_tma_k1", "wg_128x128x64_s5_p_tma_k2"):
    err = (gemm(x, w.T, config=cfg).float() - (x @ w.T).float()).abs().max().item()
    print(cfg, "max err", err)
PY
  for tool in racecheck memcheck; do
    timeout ${SAN_LIMIT:-240} compute-sanitizer --tool $tool python3 /tmp/tma_small.py > "$OUT/sanitize_$tool.log" 2>&1
    echo "== $tool"; tail -3 "$OUT/sanitize_$tool.log"
  done
fi
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm -f "$OUT"/*.log
echo "total: $(( $(date +%s) - start )) s"
