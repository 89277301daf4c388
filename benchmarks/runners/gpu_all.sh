#!/usr/bin/env bash
# Everything the GPU machine has to run, in one call: each op's GPU script (tests, then its
# benchmark) with its own time limit, so one slow or broken op cannot eat the others' time.
# Per-op logs and CSVs are bundled into $OUT/gpu_results.tgz (the device tool returns at most 8
# files); a short summary is printed last.
#   bash benchmarks/runners/gpu_all.sh [op ...]      ops: foundation gemm flash_attn decode fused
set -uo pipefail
cd "$(dirname "$0")/../.."
FINAL_OUT=${OUT:-/tmp/gpu_out}
WORK=$(mktemp -d)
ops=("$@"); [ ${#ops[@]} -eq 0 ] && ops=(foundation gemm flash_attn decode fused)
declare -A limit=([foundation]=150 [gemm]=240 [flash_attn]=200 [decode]=200 [fused]=150)
summary=""
for op in "${ops[@]}"; do
  script=benchmarks/runners/gpu_${op}.sh
  [ -f "$script" ] || { summary+="$op: no script\n"; continue; }
  mkdir -p "$WORK/$op"
  start=$(date +%s)
  OUT="$WORK/$op" LLMSPEED_RESULTS_DIR="$WORK/$op" timeout "${LIMIT:-${limit[$op]:-180}}" \
      bash "$script" > "$WORK/$op/console.log" 2>&1
  rc=$?
  summary+="$op: rc=$rc in $(( $(date +%s) - start )) s\n"
  echo "=== $op rc=$rc"; tail -n "${TAIL:-25}" "$WORK/$op/console.log"
done
mkdir -p "$FINAL_OUT"
tar -czf "$FINAL_OUT/gpu_results.tgz" -C "$WORK" .
printf "\n== summary ==\n$summary"
