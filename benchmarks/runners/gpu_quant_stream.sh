#!/usr/bin/env bash
# The streaming 4-bit quant_gemm kernel on the H200 (issue 21): its GPU tests, its kernels
# compiled in parallel (one process an M: each takes 10-35 s a variant), then the timed probe
# against the decode / Tensor Core kernels and cuBLAS (probes/probe_quant_stream.py --tune), and
# (NCU=1) Nsight Compute on M = 1 and 16 at 4096 x 14336. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/runners/gpu_setup.sh || exit 1
start=$(date +%s)
P=benchmarks/probes/probe_quant_stream.py
M_LIST=${M_LIST:-1,2,4,8,16}
timeout -s INT 200 python3 -m pytest -q -rf -p no:cacheprovider -n 6 tests/test_quant.py \
    -k "stream or gpu_sizes or strided" > "$OUT/test_quant.log" 2>&1 &
for m in ${M_LIST//,/ }; do
    timeout 240 python3 $P --m "$m" --tune --compile-only > "$OUT/compile_m$m.log" 2>&1 &
done
wait
echo "phase 1: $(( $(date +%s) - start )) s"
grep -E "passed|failed|FAILED" "$OUT/test_quant.log" | tail -8 | cut -c1-300
tail -qn 1 "$OUT"/compile_m*.log
timeout 300 python3 $P --m "$M_LIST" --tune > "$OUT/probe.log" 2>&1
echo "== probe"; cut -c1-420 "$OUT/probe.log"
if [ "${NCU:-0}" = 1 ]; then
    CASES="quant:1:4096:14336:stream quant:16:4096:14336:stream" \
    GREP="Duration|Throughput|Achieved Occupancy|Registers|Issued Warp|Eligible|Waves" \
    LINES_SHOWN=40 timeout 200 bash benchmarks/runners/ncu_probe.sh 2>&1 | cut -c1-200
fi
echo "total: $(( $(date +%s) - start )) s"
