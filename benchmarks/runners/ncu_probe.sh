#!/usr/bin/env bash
# Nsight Compute on one call of each probe case (benchmarks/probes/probe_ncu.py), clocks left alone;
# text reports under $OUT. CASES="..." picks cases; SECTIONS="..." replaces the default sections;
# METRICS="a,b" the extra metrics; GREP="regex" adds lines to the summary (LINES_SHOWN of them).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
SECTIONS=${SECTIONS:-SpeedOfLight MemoryWorkloadAnalysis WarpStateStats Occupancy LaunchStats SchedulerStats}
args=()
for s in $SECTIONS; do args+=(--section "$s"); done
for c in ${CASES:-decode_b32_hk8 sdpa_b32_hk8 decode_b1_hk8 sdpa_b1_hk8 softmax_bf16 argmax_bf16 copy_16m}; do
  echo "== $c"
  timeout 150 "$NCU" --profile-from-start off --clock-control none "${args[@]}" \
    --metrics "${METRICS:-dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum}" \
    python benchmarks/probes/probe_ncu.py "$c" > "$OUT/ncu_$c.txt" 2>&1
  grep -E "Duration|DRAM Throughput|L2 Cache Throughput|L2 Hit Rate|dram__bytes_read|${GREP:-@}" \
    "$OUT/ncu_$c.txt" | head -${LINES_SHOWN:-12}
done
