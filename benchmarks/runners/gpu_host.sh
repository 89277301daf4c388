#!/usr/bin/env bash
# Issue 18's host-cost checks in one device call (logs under $OUT):
#   1. the replay fast path's GPU tests (tests/test_replay_gpu.py: a replayed call equals the
#      checked path's result bit for bit; the checks that depend on addresses and data still
#      raise), node ids spread over $BUCKETS parallel pytest processes (most of their time is
#      compiling);
#   2. alone on the GPU: bench_host.py --checked --profile (host us a repeated call of every op,
#      replayed and checked, torch's nearest op beside them), rows to $OUT/host.csv.
# Run it before gpu_model.sh in the same call: both source gpu_setup.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/runners/gpu_setup.sh || exit 1
start=$(date +%s)
python3 -m pytest --collect-only -q -p no:cacheprovider tests/test_replay_gpu.py \
    | grep "::" > /tmp/replay_ids.txt
n=${BUCKETS:-8}
for b in $(seq 0 $((n - 1))); do
    awk -v b=$b -v n=$n 'NR % n == b' /tmp/replay_ids.txt > /tmp/replay_ids_$b.txt
    # node ids hold spaces (parametrize ids): one argument a line
    xargs -d '\n' -a /tmp/replay_ids_$b.txt timeout ${TEST_LIMIT:-300} python3 -m pytest -q \
        -p no:cacheprovider > "$OUT/test_replay_gpu_$b.log" 2>&1 &
done
wait
echo "== test_replay_gpu ($(( $(date +%s) - start )) s)"
for b in $(seq 0 $((n - 1))); do tail -1 "$OUT/test_replay_gpu_$b.log"; done
grep -h -A25 "^___\|Error" "$OUT"/test_replay_gpu_*.log | head -80
LLMSPEED_RESULTS_DIR=$OUT timeout ${BENCH_LIMIT:-300} python3 benchmarks/bench_host.py --checked \
    --profile ${BENCH_ARGS:-} > "$OUT/bench_host.log" 2>&1
echo "== bench_host"; grep -v "^ *host " "$OUT/bench_host.log" | tail -45
tar czf "$OUT/host_logs.tgz" -C "$OUT" $(cd "$OUT" && ls test_replay_gpu_*.log bench_host.log) \
    && rm -f "$OUT"/test_replay_gpu_*.log "$OUT/bench_host.log"
echo "host total: $(( $(date +%s) - start )) s"
